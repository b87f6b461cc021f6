"""Conv / linear / matmul followed by an activation (relu, relu6/clamp, leaky_relu,
sigmoid, silu, hardswish, hardsigmoid, gelu, tanh, ... : any elementwise node over that
output alone) becomes one node whose epilogue expression (node.expr over @0) runs in
place on the GEMM output while it is still in cache (runtime/kernels/common.py
epilogue). Chains fold one after another: conv -> mul(@0,2) -> relu gives
expr maximum(mul(@0,2),0).

Does not fire when the GEMM output has another reader, is a graph output or kept, when
the activation broadcasts or changes dtype, or for non-float outputs.
"""

import numpy as np

from pmx.runtime import expr as E

GEMM_OPS = ("conv", "linear", "matmul")


def _activation_of(graph, p):
    if p.op not in GEMM_OPS or len(p.outputs) != 1:
        return None
    x = p.outputs[0]
    act = graph.sole_reader(x)
    if np.dtype(x.dtype).kind != "f" or act is None:
        return None
    if act.op != "elementwise" or len(act.inputs) != 1 or len(act.outputs) != 1:
        return None
    y = act.outputs[0]
    if y.shape != x.shape or y.dtype != x.dtype:
        return None
    return act


def fuse_activation(graph) -> bool:
    changed = False
    for p in list(graph.nodes):
        while True:
            act = _activation_of(graph, p)
            if act is None:
                break
            p.expr = E.substitute(act.expr, {0: p.expr or E.at(0)})
            y = act.outputs[0]
            graph.remove_node(act)
            graph.set_outputs(p, [y])
            changed = True
    return changed
