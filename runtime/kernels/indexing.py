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
"""

import itertools

import numpy as np

from pmx.runtime.kernels import register
from pmx.runtime.kernels.common import view_as


def same_shape(node, shapes, dtypes):
    return [(tuple(shapes[0]), dtypes[0])]


def _copies(pairs):
    pairs = tuple(pairs)
    if len(pairs) == 1:
        (d, s), = pairs
        return lambda: np.copyto(d, s)

    def run():
        for d, s in pairs:
            np.copyto(d, s)

    return run


@register("roll", infer=same_shape)
def make_roll(node, inputs, outputs):
    x, out = inputs[0], outputs[0]
    # A roll along k axes is 2^k block copies: along each axis the tail moves to the front.
    pieces = []
    for ax in range(x.ndim):
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


@register("flip", infer=same_shape)
def make_flip(node, inputs, outputs):
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


@register("expand", infer=expand_infer)
def make_expand(node, inputs, outputs):
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


@register("tile", infer=tile_infer)
def make_tile(node, inputs, outputs):
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
    axis = node.attrs["axis"] % len(x)
    return [(tuple(x[:axis]) + tuple(idx) + tuple(x[axis + 1:]), dtypes[0])]


@register("take", infer=take_infer)
def make_take(node, inputs, outputs):
    x, idx, out = inputs[0], inputs[1], outputs[0]
    axis = node.attrs["axis"] % x.ndim
    return lambda: np.take(x, idx, axis=axis, out=out, mode="raise")


def gather_infer(node, shapes, dtypes):
    return [(tuple(shapes[1]), dtypes[0])]


@register("gather", infer=gather_infer)
def make_gather(node, inputs, outputs):
    x, idx, out = inputs[0], inputs[1], outputs[0]
    axis = node.attrs["axis"] % x.ndim
    if not x.flags.c_contiguous or not out.flags.c_contiguous:
        sub = x[tuple(slice(None) if i == axis else slice(0, n) for i, n in enumerate(idx.shape))]
        return lambda: np.copyto(out, np.take_along_axis(sub, idx, axis=axis))
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
            raise IndexError(f"gather index out of range for dim {axis} of size {n_axis}")
        np.remainder(idx, n_axis, out=pos)
        np.multiply(pos, stride, out=pos)
        np.add(pos, base, out=pos)
        np.take(flat_x, flat_pos, out=flat_out)

    return run


def cast_infer(node, shapes, dtypes):
    return [(tuple(shapes[0]), np.dtype(node.attrs["dtype"]))]


@register("cast", infer=cast_infer)
def make_cast(node, inputs, outputs):
    x, out = inputs[0], outputs[0]
    return lambda: np.copyto(out, x, casting="unsafe")


def _index_key(ndim, axes, indices):
    key = [slice(None)] * ndim
    for a, i in zip(axes, indices):
        key[a] = i
    return tuple(key)


def index_infer(node, shapes, dtypes):
    x = tuple(shapes[0])
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), x, (0,) * len(x))
    idx = [np.zeros(s, np.intp) for s in shapes[1:]]
    return [(probe[_index_key(len(x), node.attrs["axes"], idx)].shape, dtypes[0])]


@register("index", infer=index_infer)
def make_index(node, inputs, outputs):
    """x[i0, :, i1] with several integer index tensors (attrs axes: the dims they index),
    numpy's advanced indexing rules, which are torch's: the index tensors broadcast
    together and their dims replace the indexed ones (in place when adjacent, else first)."""
    x, out = inputs[0], outputs[0]
    key = _index_key(x.ndim, node.attrs["axes"], inputs[1:])
    return lambda: np.copyto(out, x[key])
