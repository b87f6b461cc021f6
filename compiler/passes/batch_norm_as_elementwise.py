"""A batch_norm that no conv or linear absorbed (fuse_conv_batchnorm runs first) becomes
an elementwise node, add(mul(x, scale), shift), with scale and shift as constants shaped
(C, 1, ...) to broadcast along axis 1. fuse_elementwise then merges it with what
follows: DenseNet's pre-activation BN -> ReLU pairs become one expression, run split
over the threads, where the batch_norm kernel made two passes on one thread and the ReLU
a third. The values are the same: the kernel computed x * scale + shift in the input's
dtype too.

Does not fire on non-constant scale or shift, or on a non-float input.
"""

import numpy as np

from pmx.compiler.ir import Value
from pmx.runtime import expr as E

EXPR = E.call("add", E.call("mul", E.at(0), E.at(1)), E.at(2))


def _convertible(node):
    if len(node.inputs) != 3 or any(v is None for v in node.inputs):
        return False
    x, scale, shift = node.inputs
    return (scale.is_constant and shift.is_constant and len(x.shape) >= 2
            and np.dtype(x.dtype).kind == "f" and scale.dtype == shift.dtype == x.dtype)


def _broadcastable(node, v, rank):
    """v's values as a new constant shaped (C,) + (1,) * (rank - 2)."""
    data = np.ascontiguousarray(v.data.reshape((-1,) + (1,) * (rank - 2)))
    return Value(f"{node.name}.{v.name}.bcast", data.shape, v.dtype, data=data)


def batch_norm_as_elementwise(graph) -> bool:
    changed = False
    for node in [n for n in graph.nodes if n.op == "batch_norm"]:
        if not _convertible(node):
            continue
        rank = len(node.inputs[0].shape)
        for i in (1, 2):
            graph.set_input(node, i, _broadcastable(node, node.inputs[i], rank))
        node.op, node.expr, node.attrs, node.variant = "elementwise", EXPR, {}, ""
        changed = True
    return changed
