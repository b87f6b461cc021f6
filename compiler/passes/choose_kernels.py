"""Pick each node's kernel implementation (stored as node.variant) by a rule measured on
a 2-core x86-64 machine (tools/bench_elementwise.py):

- elementwise: numexpr pays off on large tensors with several operations, where its
  blocked evaluation saves passes over memory; numpy's SIMD ufuncs win on small tensors
  and single operations.
- conv: per-tap depthwise for groups == channels, one GEMM otherwise.

`pmx compile --tune` replaces the rule by measurement of each node.
"""

import numpy as np

from pmx.runtime import expr as E

NUMEXPR_MIN_ELEMENTS = 1 << 17
NUMEXPR_MIN_OPS = 3


def elementwise_variant(node):
    tree = E.parse(node.expr, len(node.inputs))
    numel = int(np.prod(node.outputs[0].shape))
    ops = E.size(tree) - len(E.inputs_used(tree))
    if E.numexpr_supported(tree) and numel >= NUMEXPR_MIN_ELEMENTS and ops >= NUMEXPR_MIN_OPS:
        return "numexpr"
    return "numpy"


def choose_kernels(graph) -> bool:
    for node in graph.nodes:
        if node.variant:
            continue
        if node.op == "elementwise":
            node.variant = elementwise_variant(node)
        elif node.op == "conv":
            w = node.inputs[1].shape
            groups = node.attrs.get("groups", 1)
            node.variant = "depthwise" if groups > 1 and w[1] == 1 and w[0] == groups else "gemm"
    return False
