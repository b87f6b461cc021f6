"""Elementwise expressions (every activation and arithmetic op canonicalizes to one).

Canonical op `elementwise`: any number of inputs (broadcast), node.expr holds the
expression (runtime/expr.py grammar), node.variant "numexpr" or "numpy" says which
backend runs it; the compiler chooses per node. numexpr runs its own threads; the numpy
backend splits big tensors into one slab per thread along the first axis long enough
(each slab is the same expression over slices of the output and of every input that is
not broadcast along that axis). Suffix "_1t" keeps a numpy node on one thread.
"""

import numpy as np

from pmx.runtime import expr as E
from pmx.runtime import parallel
from pmx.runtime.kernels import register

SINGLE_THREAD = "_1t"


def variants(node):
    """The backends `pmx compile --tune` times for this node."""
    tree = E.parse(node.expr, len(node.inputs))
    found = ["numpy", "numpy" + SINGLE_THREAD]
    return found + ["numexpr"] if node.inputs and E.numexpr_supported(tree) else found


def elementwise_infer(node, shapes, dtypes):
    tree = E.parse(node.expr, len(shapes))
    return [(tuple(np.broadcast_shapes(*shapes)) if shapes else (), E.result_dtype(tree, dtypes))]


@register("elementwise", infer=elementwise_infer, inplace=True)
def make_elementwise(node, inputs, outputs):
    tree = E.parse(node.expr, len(inputs))
    out = outputs[0]
    if node.variant == "numexpr" and E.numexpr_supported(tree) and inputs:
        return E.compile_numexpr(tree, inputs, out)
    threads = 1 if node.variant.endswith(SINGLE_THREAD) else parallel.num_threads()
    axis = _split_axis(out, threads)
    if axis is None or not parallel.worth_splitting(out.size):
        return E.compile_numpy(tree, inputs, out)
    parts = []
    for lo, hi in parallel.ranges(out.shape[axis], threads):
        parts.append(E.compile_numpy(tree, [_slab(x, out, axis, lo, hi) for x in inputs], _slab(out, out, axis, lo, hi)))
    return parallel.split(parts)


def _split_axis(out, threads):
    return next((i for i, d in enumerate(out.shape) if d >= threads), None) if threads > 1 else None


def _slab(x, out, axis, lo, hi):
    """Rows lo:hi of x along out's `axis` (x broadcast there, or a scalar: x itself)."""
    if not isinstance(x, np.ndarray):
        return x
    k = axis - (out.ndim - x.ndim)  # x's axis under numpy's right-aligned broadcasting
    if k < 0 or x.shape[k] == 1:
        return x
    return x[(slice(None),) * k + (slice(lo, hi),)]
