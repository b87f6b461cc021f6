"""A conv (any rank, any groups) or linear followed by batch_norm takes the norm into new
weights and bias: W' = W * scale per output channel, b' = b * scale + shift, in float64,
stored in the weight's dtype (new constants: the old weight may be shared)."""

import numpy as np

from pmx.compiler.ir import Value
from pmx.compiler.rewrite import N, V, rewrite_rule, rule_pass

# a conv or linear with constant weights and no epilogue yet
GEMM = N(
    ("conv", "linear"),
    None,
    V("w", const=True, kind="f"),
    V("b", const=True, opt=True),
    name="p",
    where=lambda p, m: not p.expr,
)


@rewrite_rule(
    N(
        "batch_norm",
        V("x", GEMM, sole=True),
        V("scale", const=True),
        V("shift", const=True),
        name="bn",
        where=lambda bn, m: (m.p.op == "conv" or len(m.x.shape) == 2) and m.scale.data.size == m.w.shape[0],
    )
)
def fold_batchnorm(graph, m):
    """The conv's output has no other reader (it would need the unnormalized values); a
    linear only on (N, C) input, where the norm's axis 1 is its output feature axis."""
    p, w, b = m.p, m.w, m.b
    scale = m.scale.data.astype(np.float64).reshape(-1)
    shift = m.shift.data.astype(np.float64).reshape(-1)
    w64 = w.data.astype(np.float64) * scale.reshape((-1,) + (1,) * (w.data.ndim - 1))
    b64 = (b.data.astype(np.float64) if b is not None else 0.0) * scale + shift
    new_w = Value(f"{p.name}.weight_bn", w.shape, w.dtype, data=np.ascontiguousarray(w64.astype(w.dtype)))
    new_b = Value(f"{p.name}.bias_bn", (w.shape[0],), w.dtype, data=b64.astype(w.dtype))
    y = m.bn.outputs[0]
    graph.remove_node(m.bn)
    graph.set_input(p, 1, new_w)
    graph.set_input(p, 2, new_b)
    graph.set_outputs(p, [y])
    return True


fuse_conv_batchnorm = rule_pass("fuse_conv_batchnorm", [fold_batchnorm])
