"""Conv (any rank, any groups) or Linear followed by batch_norm folds into new weights
and bias: W' = W * scale (per output channel), b' = b * scale + shift, computed in float64
and stored in the weight's dtype. New constants are made (the old weight may be shared
with another node; dead-code elimination drops it if not).

Does not fire when the conv/linear output has another reader (it needs the unnormalized
values), is a graph output or kept, already carries a fused activation, or when the
batch-norm channel axis (1) is not the linear's output-feature axis (linear on rank > 2).
"""

import numpy as np

from pmx.compiler.ir import Value


def _foldable(graph, bn):
    x = bn.inputs[0]
    p = x.producer
    if p is None or p.op not in ("conv", "linear") or p.expr or len(p.outputs) != 1:
        return None
    if graph.sole_reader(x) is not bn:
        return None
    w = p.inputs[1]
    b = p.inputs[2] if len(p.inputs) > 2 else None
    scale, shift = bn.inputs[1], bn.inputs[2]
    if not all(v.is_constant for v in (w, scale, shift, b) if v is not None):
        return None
    if p.op == "linear" and len(x.shape) != 2:
        return None
    if np.dtype(w.dtype).kind != "f" or scale.data.size != w.shape[0]:
        return None
    return p


def _fold(graph, p, bn):
    w = p.inputs[1]
    b = p.inputs[2] if len(p.inputs) > 2 else None
    scale = bn.inputs[1].data.astype(np.float64).reshape(-1)
    shift = bn.inputs[2].data.astype(np.float64).reshape(-1)
    w64 = w.data.astype(np.float64) * scale.reshape((-1,) + (1,) * (w.data.ndim - 1))
    b64 = (b.data.astype(np.float64) if b is not None else 0.0) * scale + shift
    w32 = np.ascontiguousarray(w64.astype(w.dtype))
    new_w = Value(f"{p.name}.weight_bn", w.shape, w.dtype, data=w32)
    new_b = Value(f"{p.name}.bias_bn", (w.shape[0],), w.dtype, data=b64.astype(w.dtype))
    y = bn.outputs[0]
    graph.remove_node(bn)
    graph.set_input(p, 1, new_w)
    graph.set_input(p, 2, new_b)
    graph.set_outputs(p, [y])


def fuse_conv_batchnorm(graph) -> bool:
    changed = False
    for bn in [n for n in graph.nodes if n.op == "batch_norm"]:
        p = _foldable(graph, bn)
        if p is not None:
            _fold(graph, p, bn)
            changed = True
    return changed
