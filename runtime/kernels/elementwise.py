"""Elementwise expressions (every activation and arithmetic op canonicalizes to one).

Canonical op `elementwise`: any number of inputs (broadcast), node.expr holds the
expression (runtime/expr.py grammar), node.variant "numexpr" or "numpy" says which
backend runs it; the compiler chooses per node.
"""

import numpy as np

from pmx.runtime import expr as E
from pmx.runtime.kernels import register


def elementwise_infer(node, shapes, dtypes):
    tree = E.parse(node.expr, len(shapes))
    return [(tuple(np.broadcast_shapes(*shapes)) if shapes else (), E.result_dtype(tree, dtypes))]


@register("elementwise", infer=elementwise_infer, inplace=True)
def make_elementwise(node, inputs, outputs):
    tree = E.parse(node.expr, len(inputs))
    out = outputs[0]
    if node.variant == "numexpr" and E.numexpr_supported(tree) and inputs:
        return E.compile_numexpr(tree, inputs, out)
    return E.compile_numpy(tree, inputs, out)
