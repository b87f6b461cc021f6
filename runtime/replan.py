"""Memory layouts: the one stored in the file, and new ones for other input shapes.

A Layout says, for one set of input shapes, each tensor's shape and where its bytes live:
either at an arena offset or as a view of another tensor (root index + byte offset, with
optional strides). The compiled shape's layout is read from the file (no planning at
load); any other allowed shape gets a layout computed here by running every node's shape
rule in the stored order and planning the arena with the same greedy-by-size planner the
compiler uses (runtime/plan.py).

When re-planning, views that do not depend on the shape (reshape-like views, in-place
outputs: offset 0, contiguous) are kept; views into a slice of another tensor (concat
inputs written in place) are dropped: those tensors get their own buffers and the
concat kernel, which copies only inputs not already in their slice, copies them.
"""

from __future__ import annotations

import math

import numpy as np

from pmx.runtime.errors import PmxInputError
from pmx.runtime.kernels.registry import output_shapes
from pmx.runtime.plan import check_plan, lifetimes, plan_arena, root_spans
from pmx.runtime.record import Record
from pmx.schema.layout import TensorKind


class Layout(Record):
    __slots__ = ("shapes", "offsets", "views", "arena_size")

    def __init__(self, shapes, offsets, views, arena_size):
        self.shapes = shapes  # per tensor
        self.offsets = offsets  # root tensor index -> arena offset
        self.views = views  # tensor index -> (root index, byte offset, strides | None)
        self.arena_size = arena_size


def compiled_layout(model) -> Layout:
    """The layout stored in the file, for the shape the model was compiled with."""
    offsets, views = {}, {}
    for i, t in enumerate(model.tensors):
        if t.kind == TensorKind.Constant:
            continue
        if t.alias_of >= 0:
            root, off = model.roots[i]  # resolved once by the loader's verifier
            views[i] = (root, off, t.alias_strides)
        else:
            offsets[i] = t.arena_offset
    return Layout([t.shape for t in model.tensors], offsets, views, model.arena_size)


def infer_shapes(model, input_shapes: dict) -> list:
    """Shapes of every tensor for the given input shapes (tensor index -> shape), by each
    node's shape rule in stored order. Raises PmxInputError naming the node that cannot
    take the shapes."""
    shapes = [t.shape for t in model.tensors]
    for i, s in input_shapes.items():
        shapes[i] = tuple(int(d) for d in s)
    dtypes = [t.dtype for t in model.tensors]
    for node in model.nodes:
        # None where an optional input is absent (-1): shape rules read positions
        in_shapes = [shapes[i] if i >= 0 else None for i in node.inputs]
        try:
            results = output_shapes(node, in_shapes, [dtypes[i] if i >= 0 else None for i in node.inputs])
            for out, (shape, _dtype) in zip(node.outputs, results):
                shapes[out] = shape
        except PmxInputError:
            raise
        except Exception as e:  # any rule failure means "this shape is not allowed"
            raise PmxInputError(f"node {node.name!r} ({node.op}) cannot take input shapes {in_shapes}: {e}") from None
    return shapes


def tensor_lifetimes(model):
    """{tensor index: (first step, last step)} of every non-constant tensor over the
    stored order (runtime/plan.py lifetimes)."""
    tensors = model.tensors
    steps = [([i if i >= 0 else None for i in node.inputs], node.outputs) for node in model.nodes]
    return lifetimes(
        steps, model.inputs, list(model.outputs) + list(model.kept), lambda i: tensors[i].kind == TensorKind.Constant
    )


def root_buffers(model, shapes, root_of):
    """The planner's input: one buffer per root tensor (root_of(i) for every tensor that
    lives in the arena) over the stored order. Returns (root indices, [(bytes, first
    step, last step)])."""
    tensors = model.tensors
    per_root = root_spans(tensor_lifetimes(model), root_of)
    roots = sorted(per_root, key=lambda r: (per_root[r][0], r))
    return roots, [(_nbytes(shapes[r], tensors[r].dtype), *per_root[r]) for r in roots]


def plan_layout(model, shapes) -> Layout:
    """Plan the arena for `shapes` (from infer_shapes), keeping shape-independent views."""

    def keepable(i):
        # Whole-buffer views (reshape-like, in-place) stay valid while they cover their
        # target at these shapes; a view of part of its target (a concat slice, even the
        # first one) does not. An alias of the same shape (an in-place output) must keep
        # it: an elementwise output that broadcasts over its input at these shapes (a
        # batch against a slice of a batch-1 constant) needs its own buffer.
        t = model.tensors[i]
        target = model.tensors[t.alias_of]
        if t.alias_offset != 0 or t.alias_strides is not None or t.nbytes != target.nbytes:
            return False
        if tuple(t.shape) == tuple(target.shape):
            return tuple(shapes[i]) == tuple(shapes[t.alias_of])
        return _nbytes(shapes[i], t.dtype) == _nbytes(shapes[t.alias_of], target.dtype)

    views = {}
    for i, t in enumerate(model.tensors):
        if t.kind == TensorKind.Constant or t.alias_of < 0:
            continue
        root = i
        while model.tensors[root].alias_of >= 0 and keepable(root):
            root = model.tensors[root].alias_of
        if root != i:
            views[i] = (root, 0, None)
    roots, buffers = root_buffers(model, shapes, lambda i: views[i][0] if i in views else i)
    offsets, arena = plan_arena(buffers)
    check_plan(buffers, offsets, arena)
    return Layout(list(shapes), dict(zip(roots, offsets)), views, arena)


def _nbytes(shape, dtype):
    return math.prod(shape) * np.dtype(dtype).itemsize
