"""Data movement by position: roll, flip, expand, tile, take, gather, cast.

`roll`    attrs axes, shifts (one shift per axis, 0 <= shift < size).
`flip`    attrs axes.
`expand`  attrs shape; numpy broadcasting of input 0 to `shape` (new leading dims allowed;
          -1 keeps the input's size, as in torch).
`tile`    attrs reps (one per output dim; the input is left-padded with 1s to that rank).
`take`    inputs data, indices (integer, any shape); attrs axis. Output shape is
          data.shape[:axis] + indices.shape + data.shape[axis+1:] (index_select, x[ids]);
          negative indices count from the end, out-of-range ones raise.
`gather`  inputs data, indices (same rank); attrs axis (torch.gather).
`index`   inputs data, then one integer tensor per dim in attrs axes (x[i, :, j]).
`cast`    attrs dtype (numpy name); C casting as torch does (float -> int truncates,
          nonzero -> True).
`index_put` inputs data, values (absent when attrs value is given), then one index
          tensor per dim in attrs axes (integer or boolean); attrs accumulate. A copy of
          data with data[indices] = values (or += values, duplicates summed); torch's
          index_put.
`scatter_add` inputs data, index, src; attrs axis (torch.scatter_add: duplicates summed).
`fill`    inputs data (for its shape and dtype), optional 0-d/one-element value tensor;
          attrs value when no tensor: data's shape full of the value (Tensor.fill).
`diag`    attrs diagonal: a vector -> the square matrix with it on that diagonal; a
          matrix -> that diagonal as a vector (torch.diag).
`cross`   inputs a, b (broadcast together); attrs axis of size 3 (torch.linalg.cross).
`cumsum` / `cumprod` attrs axis; the output dtype is the node's (torch widens integers
          to int64).
`topk`    attrs axis, k, largest, sorted; outputs values and int64 indices. Equal values
          come out in index order (lowest index first, a stable sort), which is torch's
          order where torch's own is deterministic; NaN counts as the largest value, as in
          torch. sorted=False returns the same answer as sorted=True, sorted: torch
          promises no order then (its CPU order is its selection algorithm's), so any
          order of the top k is a right answer and compares with torch's as a set
          (docs/performance.md, 2026-11-27).
`masked_select` inputs data, mask (broadcast together); attrs sized_at_run: outputs the
          selected elements (1-d), a length known only when it runs, so allocated by the
          kernel (registry.RunSized, see runtime/session.py); only ops registered
          reads_run_sized (elementwise, cast) may read it, since others need a planned shape.
`as_strided` attrs size, stride, offset (in elements, torch's storage_offset): a view of
          the input's contiguous storage, copied out.
`repeat_interleave` attrs repeats (one int), axis (torch.repeat_interleave with an int).
`arange`  input x; attrs start, step, axis, dtype: start, start + step, ... below
          x.shape[axis] (torch.arange(start, x.size(axis), step)), a shape rule of x.
`arange_values` inputs start, end, step (one element each); attrs dtype, sized_at_run:
          torch.arange with bounds read from tensor values. Its length is known only
          when it runs, so its output is sized at run time (registry.RunSized, see
          runtime/session.py): planned empty, allocated by the kernel, read only by
          ops registered reads_run_sized (elementwise, cast). Bounds inconsistent with
          the step's sign raise PmxInputError, as torch raises.
`tile_values` inputs x, dims (a 1-d integer tensor); attrs sized_at_run: torch.tile with
          the repeats read from dims' values when it runs, sized at run time like
          arange_values.
`full_values` input size (a 1-d integer tensor); attrs value, dtype, sized_at_run:
          torch.full/zeros/ones (ONNX ConstantOfShape) of the size's values, sized at
          run time like arange_values. An output sized at run over RUN_SIZED_MAX_BYTES
          is PmxResourceError.
"""

import itertools
import math

import numpy as np

from pmx.runtime.errors import PmxInputError
from pmx.runtime.kernels.attr_specs import (
    AXES,
    AXIS,
    DTYPE,
    FLAG,
    INT,
    MISSING,
    NON_NEGATIVE,
    NUMBER,
    TRUE,
    at_least_1d,
    axis,
    distinct_axes,
    input_rank,
    ints,
    length_of,
    number,
    optional,
    target_shape,
    widest_input,
)
from pmx.runtime.kernels.common import expect_operand, view_as
from pmx.runtime.kernels.registry import check_run_sized, register, rows_off_axis


def same_shape(node, shapes, dtypes):
    return [(tuple(shapes[0]), dtypes[0])]


def _copies(pairs):
    pairs = tuple(pairs)
    if len(pairs) == 1:
        ((d, s),) = pairs
        return lambda: np.copyto(d, s)

    def run():
        for d, s in pairs:
            np.copyto(d, s)

    return run


@register("roll", infer=same_shape, attrs=dict(axes=AXES, shifts=ints(length_of("axes"))), rows=rows_off_axis("axes"))
def make_roll(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    # A roll along k axes is 2^k block copies: along each axis the tail moves to the front.
    pieces = []
    for _ in range(x.ndim):
        pieces.append([(slice(None), slice(None))])
    for ax, shift in zip(node.attrs["axes"], node.attrs["shifts"]):
        ax %= x.ndim
        n = x.shape[ax]
        s = shift % n if n else 0
        if s:
            pieces[ax] = [(slice(s, None), slice(None, n - s)), (slice(None, s), slice(n - s, None))]
    pairs = []
    for combo in itertools.product(*pieces):
        dst = tuple(c[0] for c in combo)
        src = tuple(c[1] for c in combo)
        pairs.append((out[dst], x[src]))
    return _copies(pairs)


@register("flip", infer=same_shape, attrs=dict(axes=AXES), rows=rows_off_axis("axes"))
def make_flip(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    index = [slice(None)] * x.ndim
    for ax in node.attrs["axes"]:
        index[ax % x.ndim] = slice(None, None, -1)
    src = x[tuple(index)]
    return lambda: np.copyto(out, src)


def expand_infer(node, shapes, dtypes):
    """Sizes: >= 0 literal, -1 the input's own, -2-k dim k of the optional second input
    (expand_as / expand(y.size()): the size follows that tensor at run time)."""
    x, sizes = tuple(shapes[0]), tuple(node.attrs["shape"])
    like = tuple(shapes[1]) if len(shapes) > 1 else ()
    lead = len(sizes) - len(x)
    target = tuple(x[i - lead] if d == -1 else like[-2 - d] if d <= -2 else d for i, d in enumerate(sizes))
    return [(tuple(np.broadcast_shapes(x, target)), dtypes[0])]


@register(
    "expand", infer=expand_infer, attrs=dict(shape=target_shape(copies_dims_of=1, min_length=input_rank(0))), rows=True
)
def make_expand(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    return lambda: np.copyto(out, x)


def _tile_dims(shape, reps):
    shape = (1,) * (len(reps) - len(shape)) + tuple(shape)
    return shape, tuple(reps)


def tile_infer(node, shapes, dtypes):
    reps = tuple(node.attrs["reps"])
    if len(reps) < len(shapes[0]):
        reps = (1,) * (len(shapes[0]) - len(reps)) + reps
    shape, reps = _tile_dims(shapes[0], reps)
    return [(tuple(s * r for s, r in zip(shape, reps)), dtypes[0])]


@register("tile", infer=tile_infer, attrs=dict(reps=ints(lo=0)), rows=True)
def make_tile(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    reps = tuple(node.attrs["reps"])
    if len(reps) < x.ndim:
        reps = (1,) * (x.ndim - len(reps)) + reps
    shape, reps = _tile_dims(x.shape, reps)
    if not out.flags.c_contiguous:
        return lambda: np.copyto(out, np.tile(x, reps))
    # out seen as (r0, d0, r1, d1, ...) receives x seen as (1, d0, 1, d1, ...): one
    # broadcasting copy, no temporary.
    dst = view_as(out, tuple(v for r, d in zip(reps, shape) for v in (r, d)))
    src = x.reshape(tuple(v for d in shape for v in (1, d)))
    return lambda: np.copyto(dst, src)


def take_infer(node, shapes, dtypes):
    x, idx = shapes[0], shapes[1]
    expect_operand(shapes, dtypes, 1, "indices", kinds="iu")
    axis = node.attrs["axis"] % len(x)
    return [(tuple(x[:axis]) + tuple(idx) + tuple(x[axis + 1 :]), dtypes[0])]


def index_values_checked(node, run):
    """`run`, with an index value out of range (IndexError: values come from the inputs at
    run time) raised as PmxInputError naming the node, as torch refuses it."""

    def checked():
        try:
            run()
        except IndexError as e:
            raise PmxInputError(f"node {node.name[:40]!r} ({node.op}): {e}") from None

    return checked


def _take_rows(node, ranks, batched):
    """Rows stay apart when the indices pick along another axis, or pick rows of a table
    that is not the batch (an embedding)."""
    return not batched[0] or node.attrs["axis"] % ranks[0] != 0


@register("take", infer=take_infer, attrs=dict(axis=AXIS), rows=_take_rows)
def make_take(node, inputs, outputs, ctx):
    x, idx, out = inputs[0], inputs[1], outputs[0]
    axis = node.attrs["axis"] % x.ndim
    return index_values_checked(node, lambda: np.take(x, idx, axis=axis, out=out, mode="raise"))


def gather_infer(node, shapes, dtypes):
    x, idx = tuple(shapes[0]), tuple(shapes[1])
    expect_operand(shapes, dtypes, 1, "index", kinds="iu")
    axis = node.attrs["axis"] % len(x)
    if len(idx) != len(x) or any(i > n for d, (i, n) in enumerate(zip(idx, x)) if d != axis):
        raise ValueError(f"index {idx} does not fit input {x} off dim {axis} (torch.gather)")
    return [(idx, dtypes[0])]


def _gather_rows(node, ranks, batched):
    """out[i][j] = x[i][index[i][j]] off axis 0 (x must be the batch), and
    x[index[i][j]][j] along it (x must not be)."""
    return (node.attrs["axis"] % ranks[0] != 0) == bool(batched[0])


@register("gather", infer=gather_infer, attrs=dict(axis=AXIS), rows=_gather_rows)
def make_gather(node, inputs, outputs, ctx):
    x, idx, out = inputs[0], inputs[1], outputs[0]
    axis = node.attrs["axis"] % x.ndim
    if not x.flags.c_contiguous or not out.flags.c_contiguous:
        sub = x[tuple(slice(None) if i == axis else slice(0, n) for i, n in enumerate(idx.shape))]
        return index_values_checked(node, lambda: np.copyto(out, np.take_along_axis(sub, idx, axis=axis)))
    # flat position = offset of the element with index 0 along axis + index * stride
    strides = [s // x.itemsize for s in x.strides]
    base = np.zeros(idx.shape, np.int64)
    for d, n in enumerate(idx.shape):
        if d != axis:
            shape = [1] * idx.ndim
            shape[d] = n
            base = base + (np.arange(n, dtype=np.int64) * strides[d]).reshape(shape)
    n_axis, stride = x.shape[axis], strides[axis]
    flat_x = x.reshape(-1)
    flat_out = view_as(out, (out.size,))
    pos = np.empty(idx.shape, np.int64)
    flat_pos = pos.reshape(-1)

    def run():
        if idx.size and (idx.min() < -n_axis or idx.max() >= n_axis):
            raise PmxInputError(f"node {node.name[:40]!r} (gather): index out of range for dim {axis} of size {n_axis}")
        np.remainder(idx, n_axis, out=pos)
        np.multiply(pos, stride, out=pos)
        np.add(pos, base, out=pos)
        np.take(flat_x, flat_pos, out=flat_out)

    return run


def cast_infer(node, shapes, dtypes):
    return [(tuple(shapes[0]), np.dtype(node.attrs["dtype"]))]


@register("cast", infer=cast_infer, attrs=dict(dtype=DTYPE), rows=True, reads_run_sized=True)
def make_cast(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    return lambda: np.copyto(out, x, casting="unsafe")


def _index_key(ndim, axes, indices):
    key = [slice(None)] * ndim
    for a, i in zip(axes, indices):
        key[a] = i
    return tuple(key)


def _index_inputs(attrs, ranks):
    """The index tensors after the data: one per axis."""
    return len(ranks) - 1


def _indexed_shape(x, axes, index_shapes):
    """The shape of x[key] with integer index tensors of `index_shapes` at `axes`."""
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), x, (0,) * len(x))
    idx = [np.zeros(s, np.intp) for s in index_shapes]
    return probe[_index_key(len(x), axes, idx)].shape


def index_infer(node, shapes, dtypes):
    for k in range(1, len(shapes)):
        expect_operand(shapes, dtypes, k, "index", kinds="iu")
    return [(_indexed_shape(tuple(shapes[0]), node.attrs["axes"], shapes[1:]), dtypes[0])]


@register("index", infer=index_infer, attrs=dict(axes=distinct_axes(length=_index_inputs)), rows=rows_off_axis("axes"))
def make_index(node, inputs, outputs, ctx):
    """x[i0, :, i1] with several integer index tensors (attrs axes: the dims they index),
    numpy's advanced indexing rules, which are torch's: the index tensors broadcast
    together and their dims replace the indexed ones (in place when adjacent, else first)."""
    x, out = inputs[0], outputs[0]
    key = _index_key(x.ndim, node.attrs["axes"], inputs[1:])
    return index_values_checked(node, lambda: np.copyto(out, x[key]))


def _key_with(axes, indices):
    """data[key] with indices at `axes`, whole dims before and between them; dims after
    the last are left to numpy (a boolean index spans as many dims as it has), and the
    Ellipsis keeps a key of plain ints a 0-d view rather than a copied scalar."""
    key = [slice(None)] * (max(axes) + 1 if axes else 0)
    for a, i in zip(axes, indices):
        key[a] = i
    return tuple(key) + (Ellipsis,)


def _put_axes(v, attrs, ranks):
    """index_put's axes: rising dims of the data, one per index tensor (inputs 2 on)."""
    r, n = ranks[0], len(ranks) - 2
    if (
        r is None
        or type(v) is not tuple
        or any(type(a) is not int or not 0 <= a < r for a in v)
        or list(v) != sorted(set(v))
        or len(v) != n
    ):
        return f"a tuple of {n} rising dims of a rank-{r} input, one per index input"


def _value_unless_input(v, attrs, ranks):
    """The value to write (index_put, fill): a number, absent when input 1 holds it."""
    if v is MISSING:
        if len(ranks) > 1 and ranks[1] is not None:
            return None
        return "a number (input 1, which would hold the value, is absent)"
    if type(v) not in (int, float):
        return "a number"


def index_put_infer(node, shapes, dtypes):
    """Integer or boolean indices; values of the data's dtype that broadcast to what the
    integer indices select (a boolean index selects as many as it has True values, known
    at run time only)."""
    x = tuple(shapes[0])
    for k in range(2, len(shapes)):
        expect_operand(shapes, dtypes, k, "index", kinds="biu")
    if "value" not in node.attrs:
        expect_operand(shapes, dtypes, 1, "values", dtype=dtypes[0])
        if all(np.dtype(d).kind in "iu" for d in dtypes[2:]):
            target = _indexed_shape(x, node.attrs["axes"], shapes[2:])
            if np.broadcast_shapes(tuple(shapes[1]), target) != target:
                raise ValueError(f"values {tuple(shapes[1])} do not broadcast to the {target} they are put into")
    return [(x, dtypes[0])]


def scatter_add_infer(node, shapes, dtypes):
    x, idx = tuple(shapes[0]), tuple(shapes[1])
    expect_operand(shapes, dtypes, 1, "index", kinds="iu")
    expect_operand(shapes, dtypes, 2, "src", dtype=dtypes[0])
    axis = node.attrs["axis"] % len(x)
    src = tuple(shapes[2])
    if len(idx) != len(x) or len(src) != len(x) or any(i > s for i, s in zip(idx, src)):
        raise ValueError(f"index {idx} does not fit src {src} and input {x} (torch.scatter_add)")
    if any(i > n for d, (i, n) in enumerate(zip(idx, x)) if d != axis):
        raise ValueError(f"index {idx} does not fit input {x} off dim {axis} (torch.scatter_add)")
    return [(x, dtypes[0])]


def fill_infer(node, shapes, dtypes):
    if len(shapes) > 1 and shapes[1] is not None and math.prod(shapes[1]) != 1:
        raise ValueError(f"the fill value (input 1) has shape {tuple(shapes[1])}, not one element")
    return [(tuple(shapes[0]), dtypes[0])]


@register(
    "index_put",
    infer=index_put_infer,
    inplace=True,
    attrs=dict(axes=_put_axes, accumulate=optional(FLAG), value=_value_unless_input),
)
def make_index_put(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    values = inputs[1] if "value" not in node.attrs else np.asarray(node.attrs["value"], x.dtype)
    key = _key_with(node.attrs["axes"], inputs[2:])
    copy = None if _same(x, out) else (lambda: np.copyto(out, x))
    if node.attrs.get("accumulate"):

        def put():
            np.add.at(out, key, values)
    else:

        def put():
            out[key] = values

    put = index_values_checked(node, put)
    return put if copy is None else _chain(copy, put)


def _same(a, b):
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape


def _chain(first, second):
    def run():
        first()
        second()

    return run


@register("scatter_add", infer=scatter_add_infer, inplace=True, attrs=dict(axis=AXIS))
def make_scatter_add(node, inputs, outputs, ctx):
    x, idx, src, out = inputs[0], inputs[1], inputs[2], outputs[0]
    axis = node.attrs["axis"] % x.ndim
    # torch reads src only where index has elements: src's leading corner of index's shape
    src = src[tuple(slice(0, n) for n in idx.shape)]
    grids = np.indices(idx.shape, sparse=True)
    n_axis = x.shape[axis]

    def put():
        if idx.size and (idx.min() < -n_axis or idx.max() >= n_axis):
            raise PmxInputError(
                f"node {node.name[:40]!r} (scatter_add): index out of range for dim {axis} of size {n_axis}"
            )
        key = tuple(idx if d == axis else g for d, g in enumerate(grids))
        np.add.at(out, key, src)

    return put if _same(x, out) else _chain(lambda: np.copyto(out, x), put)


@register("fill", infer=fill_infer, attrs=dict(value=_value_unless_input), rows=True)
def make_fill(node, inputs, outputs, ctx):
    out = outputs[0]
    if len(inputs) > 1 and inputs[1] is not None:
        flat = inputs[1].reshape(())  # one element: fill_infer checked it
        return lambda: out.fill(flat)
    value = node.attrs["value"]
    return lambda: out.fill(value)


def diag_infer(node, shapes, dtypes):
    shape, k = tuple(shapes[0]), node.attrs["diagonal"]
    if len(shape) == 1:
        n = shape[0] + abs(k)
        return [((n, n), dtypes[0])]
    if len(shape) != 2:
        raise ValueError(f"diag takes a 1-d or 2-d input, got shape {shape}")
    rows, cols = shape
    n = max(0, min(rows + min(k, 0), cols - max(k, 0)))
    return [((n,), dtypes[0])]


@register("diag", infer=diag_infer, attrs=dict(diagonal=INT))
def make_diag(node, inputs, outputs, ctx):
    x, out, k = inputs[0], outputs[0], node.attrs["diagonal"]
    if x.ndim == 1:
        n = x.shape[0]
        rows = np.arange(n) + max(-k, 0)
        cols = np.arange(n) + max(k, 0)

        def run():
            out.fill(0)
            out[rows, cols] = x

        return run
    src = np.diagonal(x, k)
    return lambda: np.copyto(out, src)


def cross_infer(node, shapes, dtypes):
    shape = tuple(np.broadcast_shapes(tuple(shapes[0]), tuple(shapes[1])))
    axis = node.attrs["axis"]
    if not -len(shape) <= axis < len(shape) or shape[axis] != 3:
        raise ValueError(f"cross needs size 3 along dim {axis}, got shape {shape}")
    return [(shape, np.result_type(dtypes[0], dtypes[1]))]


@register("cross", infer=cross_infer, attrs=dict(axis=axis(widest_input)), rows=rows_off_axis("axis"))
def make_cross(node, inputs, outputs, ctx):
    a, b, out = inputs[0], inputs[1], outputs[0]
    axis = node.attrs["axis"] % out.ndim
    a = np.broadcast_to(a, out.shape)
    b = np.broadcast_to(b, out.shape)

    a0, a1, a2 = (a[_key_with((axis,), (i,))] for i in range(3))  # views: read at run time
    b0, b1, b2 = (b[_key_with((axis,), (i,))] for i in range(3))
    o0, o1, o2 = (out[_key_with((axis,), (i,))] for i in range(3))

    def run():
        np.subtract(a1 * b2, a2 * b1, out=o0)
        np.subtract(a2 * b0, a0 * b2, out=o1)
        np.subtract(a0 * b1, a1 * b0, out=o2)

    return run


def cumulative_infer(node, shapes, dtypes):
    dtype = node.attrs.get("dtype")
    return [(tuple(shapes[0]), np.dtype(dtype) if dtype else dtypes[0])]


def _cumulative(accumulate):
    """Kernel factory of cumsum / cumprod (`accumulate`: np.cumsum or np.cumprod)."""

    def make(node, inputs, outputs, ctx):
        x, out = inputs[0], outputs[0]
        axis = node.attrs["axis"] % max(x.ndim, 1)
        if x.ndim == 0:
            return lambda: np.copyto(out, x, casting="unsafe")
        return lambda: accumulate(x, axis=axis, dtype=out.dtype, out=out)

    return make


CUMULATIVE_ATTRS = dict(axis=axis(at_least_1d), dtype=optional(DTYPE))
make_cumsum = register("cumsum", infer=cumulative_infer, attrs=CUMULATIVE_ATTRS, rows=rows_off_axis("axis"))(
    _cumulative(np.cumsum)
)
make_cumprod = register("cumprod", infer=cumulative_infer, attrs=CUMULATIVE_ATTRS, rows=rows_off_axis("axis"))(
    _cumulative(np.cumprod)
)


def topk_infer(node, shapes, dtypes):
    shape = list(shapes[0])
    axis, k = node.attrs["axis"] % max(len(shape), 1), node.attrs["k"]
    if shape:
        if not 0 <= k <= shape[axis]:
            raise ValueError(f"topk k={k} out of range for dim {axis} of size {shape[axis]}")
        shape[axis] = k
    return [(tuple(shape), dtypes[0]), (tuple(shape), np.dtype(np.int64))]


# sorted: written by the compiler; the values come out sorted either way
@register(
    "topk",
    infer=topk_infer,
    attrs=dict(axis=axis(at_least_1d), k=NON_NEGATIVE, largest=FLAG, sorted=optional(FLAG)),
    rows=rows_off_axis("axis"),
)
def make_topk(node, inputs, outputs, ctx):
    x, values, indices = inputs[0], outputs[0], outputs[1]
    if x.ndim == 0:

        def scalar():
            np.copyto(values, x)
            indices.fill(0)

        return scalar
    axis, k, largest = node.attrs["axis"] % x.ndim, node.attrs["k"], node.attrs["largest"]
    kind = x.dtype.kind

    def run():
        if largest and kind == "f":
            # negated, a stable ascending sort puts the largest first and keeps equal
            # values in index order; NaN (the largest in torch) goes before everything
            order = _stable_order(-x, ~np.isnan(x), axis)
        elif largest:
            order = np.argsort(~x, axis=axis, kind="stable")  # ~ reverses every integer order
        else:
            order = np.argsort(x, axis=axis, kind="stable")  # NaN sorts last: the largest
        top = order[_key_with((axis,), (slice(0, k),))]
        np.copyto(indices, top)
        np.copyto(values, np.take_along_axis(x, top, axis=axis))

    return run


def _stable_order(key, secondary, axis):
    """Argsort by (secondary, key), stable: NaNs (secondary False) first, then key."""
    order = np.argsort(key, axis=axis, kind="stable")
    sec = np.take_along_axis(secondary, order, axis=axis)
    return np.take_along_axis(order, np.argsort(sec, axis=axis, kind="stable"), axis=axis)


def masked_select_infer(node, shapes, dtypes):
    expect_operand(shapes, dtypes, 1, "mask", kinds="b")
    np.broadcast_shapes(tuple(shapes[0]), tuple(shapes[1]))  # raises when they do not broadcast
    return [((0,), dtypes[0])]


@register("masked_select", infer=masked_select_infer, attrs=dict(sized_at_run=TRUE))
def make_masked_select(node, inputs, outputs, ctx):
    x, mask, out = inputs[0], inputs[1], outputs[0]
    shape = np.broadcast_shapes(x.shape, mask.shape)
    xb, mb = np.broadcast_to(x, shape), np.broadcast_to(mask, shape)

    def run():
        out.value = xb[mb]

    return run


def as_strided_infer(node, shapes, dtypes):
    size, stride, offset = node.attrs["size"], node.attrs["stride"], node.attrs.get("offset", 0)
    numel = int(np.prod(shapes[0], dtype=np.int64))
    if len(size) != len(stride) or any(s < 0 for s in size) or any(s < 0 for s in stride) or offset < 0:
        raise ValueError(f"as_strided size={size} stride={stride} offset={offset} must be non-negative and of one rank")
    if all(size):
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= numel:
            raise ValueError(
                f"as_strided size={size} stride={stride} offset={offset} reaches element {last} "
                f"of an input with {numel}"
            )
    return [(tuple(size), dtypes[0])]


@register(
    "as_strided",
    infer=as_strided_infer,
    attrs=dict(size=ints(lo=0), stride=ints(length_of("size"), lo=0), offset=optional(NON_NEGATIVE)),
)
def make_as_strided(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    size, stride, offset = tuple(node.attrs["size"]), node.attrs["stride"], node.attrs.get("offset", 0)
    if x.flags.c_contiguous:
        flat = x.reshape(-1)
        src = np.lib.stride_tricks.as_strided(
            flat[offset:], size, tuple(s * x.itemsize for s in stride), writeable=False
        )
        return lambda: np.copyto(out, src)

    def run():  # a strided operand: its storage order is its logical order
        flat = np.ascontiguousarray(x).reshape(-1)
        np.copyto(out, np.lib.stride_tricks.as_strided(flat[offset:], size, tuple(s * x.itemsize for s in stride)))

    return run


def repeat_interleave_infer(node, shapes, dtypes):
    shape = list(shapes[0])
    axis, r = node.attrs["axis"] % len(shape), node.attrs["repeats"]
    shape[axis] *= r
    return [(tuple(shape), dtypes[0])]


@register(
    "repeat_interleave",
    infer=repeat_interleave_infer,
    attrs=dict(axis=AXIS, repeats=NON_NEGATIVE),
    rows=rows_off_axis("axis"),
)
def make_repeat_interleave(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    axis, r = node.attrs["axis"] % x.ndim, node.attrs["repeats"]
    # out seen with the repeats as a new axis after `axis` receives x broadcast along it
    dst = view_as(out, x.shape[: axis + 1] + (r,) + x.shape[axis + 1 :]) if out.flags.c_contiguous else None
    if dst is None:
        return lambda: np.copyto(out, np.repeat(x, r, axis=axis))
    src = np.expand_dims(x, axis + 1)
    return lambda: np.copyto(dst, src)


def _arange_length(node, shapes):
    end, start, step = shapes[0][node.attrs["axis"]], node.attrs["start"], node.attrs["step"]
    return max(0, math.ceil((end - start) / step))


def arange_infer(node, shapes, dtypes):
    return [((_arange_length(node, shapes),), np.dtype(node.attrs["dtype"]))]


@register("arange", infer=arange_infer, attrs=dict(start=NUMBER, step=number(nonzero=True), axis=AXIS, dtype=DTYPE))
def make_arange(node, inputs, outputs, ctx):
    out, start, step = outputs[0], node.attrs["start"], node.attrs["step"]
    exact = isinstance(start, int) and isinstance(step, int)
    # torch computes start + i * step in int64 for integer bounds, else in double
    values = (start + np.arange(out.shape[0], dtype=np.int64 if exact else np.float64) * step).astype(out.dtype)
    return lambda: np.copyto(out, values)


def arange_values_infer(node, shapes, dtypes):
    if len(shapes) != 3:
        raise ValueError(f"{len(shapes)} inputs: arange_values reads start, end and step")
    for k, name in enumerate(("start", "end", "step")):
        expect_operand(shapes, dtypes, k, name, kinds="biuf")
        if math.prod(shapes[k]) != 1:
            raise ValueError(f"{name} (input {k}) has shape {tuple(shapes[k])}, not one element")
    return [((0,), np.dtype(node.attrs["dtype"]))]


@register("arange_values", infer=arange_values_infer, attrs=dict(dtype=DTYPE, sized_at_run=TRUE))
def make_arange_values(node, inputs, outputs, ctx):
    """torch's arange: an integer result computes in int64 from bounds truncated to
    integers, a floating one in double (at::acc_type), then casts."""
    (start_t, end_t, step_t), out = inputs, outputs[0]
    dtype = np.dtype(node.attrs["dtype"])
    acc = np.int64 if dtype.kind in "iu" else np.float64

    def run():
        start, end, step = (acc(v.reshape(-1)[0]) for v in (start_t, end_t, step_t))
        if step == 0 or not (np.isfinite(start) and np.isfinite(end)) or (end - start) * step < 0:
            raise PmxInputError(
                f"node {node.name[:40]!r} (arange): start={start}, end={end}, step={step} read from "
                f"the inputs are not finite or inconsistent with the step's sign (torch raises too)"
            )
        n = math.ceil(float(end - start) / float(step))
        check_run_sized(node, (n,), dtype)
        out.value = (start + np.arange(n, dtype=acc) * step).astype(dtype)

    return run


def full_values_infer(node, shapes, dtypes):
    expect_operand(shapes, dtypes, 0, "size", kinds="iu")
    if len(shapes[0]) != 1:
        raise ValueError(f"size {tuple(shapes[0])} is not a 1-d tensor of dims")
    return [((0,) * shapes[0][0], np.dtype(node.attrs["dtype"]))]


@register("full_values", infer=full_values_infer, attrs=dict(value=NUMBER, dtype=DTYPE, sized_at_run=TRUE))
def make_full_values(node, inputs, outputs, ctx):
    """torch.full(size, value) (zeros, ones; ONNX ConstantOfShape) with the size read from
    a tensor's values when the node runs."""
    size_t, out = inputs[0], outputs[0]
    dtype, value = np.dtype(node.attrs["dtype"]), node.attrs["value"]

    def run():
        shape = tuple(int(n) for n in size_t)
        if min(shape, default=0) < 0:
            raise PmxInputError(
                f"node {node.name[:40]!r} (full): size {list(shape)} read from the inputs has a negative dim"
            )
        check_run_sized(node, shape, dtype)
        out.value = np.full(shape, value, dtype)

    return run


def tile_values_infer(node, shapes, dtypes):
    expect_operand(shapes, dtypes, 1, "dims", kinds="iu")
    if len(shapes[1]) != 1:
        raise ValueError(f"dims {tuple(shapes[1])} is not a 1-d tensor of repeats")
    return [((0,) * max(len(shapes[0]), shapes[1][0]), dtypes[0])]


@register("tile_values", infer=tile_values_infer, attrs=dict(sized_at_run=TRUE))
def make_tile_values(node, inputs, outputs, ctx):
    """torch.tile(x, dims) (ONNX Tile) with the repeats read from a tensor's values when
    the node runs."""
    x, dims_t = inputs
    out = outputs[0]

    def run():
        reps = tuple(int(r) for r in dims_t)
        if min(reps, default=0) < 0:
            raise PmxInputError(
                f"node {node.name[:40]!r} (tile): repeats {list(reps)} read from the inputs include a negative one"
            )
        shape, reps = _tile_dims(x.shape, (1,) * (x.ndim - len(reps)) + reps)
        check_run_sized(node, tuple(s * r for s, r in zip(shape, reps)), x.dtype)
        out.value = np.tile(x, reps)

    return run
