"""Elementwise expressions (every activation and arithmetic op canonicalizes to one).

Canonical op `elementwise`: any number of inputs (broadcast), node.expr holds the
expression (runtime/expr/tree.py grammar), node.variant "numexpr" or "numpy" says which
backend runs it; the compiler chooses per node. Either backend splits big tensors into
one slab per thread along the first axis long enough (each slab is the same expression
over slices of the output and of every input that is not broadcast along that axis; a
numexpr program is split only while numexpr's own pool has one thread). Suffix "_1t" keeps
a numpy node on one thread (`pmx compile --tune` wrote it before it left threading to
the rule; such files still run as stored).
"""

import numpy as np

from pmx.runtime import expr as E
from pmx.runtime.kernels.common import expression_backend, node_threads, split_expression
from pmx.runtime.kernels.registry import register


def variants(node, shapes):
    """The backends `pmx compile --tune` times for this node."""
    return ["numpy", "numexpr"] if shapes and E.numexpr_supported(node.expr) else ["numpy"]


def elementwise_infer(node, shapes, dtypes):
    tree = node.expr
    if shapes and shapes.count(shapes[0]) == len(shapes):
        shape = tuple(shapes[0])  # np.broadcast_shapes costs ~3 us even for equal shapes
    else:
        shape = tuple(np.broadcast_shapes(*shapes)) if shapes else ()
    return [(shape, E.result_dtype(tree, dtypes))]


@register("elementwise", infer=elementwise_infer, inplace=True, rows=True, variants=variants, reads_run_sized=True)
def make_elementwise(node, inputs, outputs, ctx):
    tree = node.expr
    out = outputs[0]
    backend = expression_backend(node, tree) if inputs else None  # numexpr needs an input
    return split_expression(ctx, tree, inputs, out, node_threads(ctx, node), backend)
