"""Shape and data-movement ops.

`reshape`  attrs shape (concrete); a view of its input when the planner aliased it.
           Optional dyn_shape, the target re-planning follows (-2-k: dim k of input 0),
           or like_shape with inputs 1.. read for their shapes only (a dynamic export's
           x.reshape(y.size(0), y.size(1), 4, 16)): -2-k copies dim k of those inputs'
           dims counted one input after another, so the target follows them exactly.
`concat`   attrs axis; no work when the planner made each input a slice of the output.
`split`    attrs axis, sizes; outputs may be aliased slices of the input.
`slice`    attrs axes, starts, ends, steps (Python slice semantics, so negative and
           out-of-range bounds clip as torch does), squeeze (axes removed by select).
`transpose` attrs perm.
`channel_shuffle` attrs groups: (N, g, C/g, ...) -> (N, C/g, g, ...) over the channels,
           torch.nn.ChannelShuffle; one strided copy. With attrs sizes, the shuffled
           channels split along axis 1 into one output per size (a shuffle and the
           split after it, as compilers fused them before the fusion was dropped: format
           version 3 files hold it, and they still load).
`copy`     identity copy (used where an output must not alias its input).
`slice_assign` inputs data, src; attrs as `slice`: a copy of data whose slice (the
           elements `slice` would read) is replaced by src, broadcast to the slice's
           shape (Tensor.slice_copy: x[2:10] = y; torch.slice_scatter).
"""

import math

import numpy as np

from pmx.runtime import blas, parallel
from pmx.runtime.kernels.attr_specs import (
    AXES,
    AXIS,
    FLAG,
    POSITIVE,
    UNREAD,
    axis,
    ints,
    length_of,
    optional,
    permutation,
    ranks_from,
    target_shape,
    widest_input,
)
from pmx.runtime.kernels.common import chain, split_copy, split_threads, view_as
from pmx.runtime.kernels.registry import register, rows_off_axis, version_with


def _resolve_shape(shape, numel):
    shape = list(shape)
    if -1 in shape:
        i = shape.index(-1)
        rest = math.prod([d for j, d in enumerate(shape) if j != i])
        shape[i] = numel // rest if rest else 0
    return tuple(shape)


def copy_dim(k):
    """The dyn_shape / like_shape code copying dim k (resolve_dyn_shape)."""
    return -2 - k


def resolve_dyn_shape(dyn_shape, in_shape, copied=None):
    """A symbolic reshape target -> concrete shape for this input shape. Entries: >= 0
    literal, -1 inferred from the element count, -2-k copy dim k of `copied` (default
    the input's own dims: the compiler's mark_dynamic_dims pass writes those so frozen
    targets follow dynamic dims; like_shape copies the like inputs' dims)."""
    copied = in_shape if copied is None else copied
    out = [copied[-2 - d] if d <= -2 else d for d in dyn_shape]
    total = math.prod(in_shape)
    if -1 in out:
        i = out.index(-1)
        rest = math.prod([d for j, d in enumerate(out) if j != i])
        if rest == 0 or total % rest:
            raise ValueError(f"cannot reshape {tuple(in_shape)} to {tuple(out)}")
        out[i] = total // rest
    if math.prod(out) != total:
        raise ValueError(f"cannot reshape {tuple(in_shape)} ({total} elements) to {tuple(out)}")
    return tuple(out)


def like_dims(shapes):
    """The dims like_shape's -2-k codes copy: those of inputs 1.., one input after
    another (input 1's dims are 0..r1-1, input 2's follow)."""
    return tuple(d for s in shapes[1:] for d in s)


def reshape_infer(node, shapes, dtypes):
    if "like_shape" in node.attrs:
        return [(resolve_dyn_shape(node.attrs["like_shape"], shapes[0], like_dims(shapes)), dtypes[0])]
    if "dyn_shape" in node.attrs:
        return [(resolve_dyn_shape(node.attrs["dyn_shape"], shapes[0]), dtypes[0])]
    numel = math.prod(shapes[0])
    shape = _resolve_shape(node.attrs["shape"], numel)
    if math.prod(shape) != numel:
        raise ValueError(f"cannot reshape {tuple(shapes[0])} to {shape}")
    return [(shape, dtypes[0])]


def _same_memory(a, b):
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes


# shape: the target at the compiled shape; dyn_shape: the one re-planning follows;
# like_shape: the exact target of a size list, over inputs 1.. (read for their shapes);
# pnnx_shape: the shape argument as written, which only the compiler reads
@register(
    "reshape",
    infer=reshape_infer,
    view=True,
    attrs=dict(
        shape=target_shape(),
        dyn_shape=optional(target_shape(copies_dims_of=0)),
        like_shape=optional(target_shape(copies_dims_of=ranks_from(1))),
        pnnx_shape=UNREAD,
    ),
    rows=True,
    format_version=version_with("like_shape"),
)
def make_reshape(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    if _same_memory(x, out) and x.flags.c_contiguous and out.flags.c_contiguous:
        return None
    return lambda: np.copyto(out, x.reshape(out.shape))


@register("copy", infer=lambda node, shapes, dtypes: [(tuple(shapes[0]), dtypes[0])], rows=True)
def make_copy(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    return lambda: np.copyto(out, x, casting="unsafe")


def concat_infer(node, shapes, dtypes):
    """attrs broadcast=True (set by the compiler when a constant such as a class token was
    traced at batch 1) lets size-1 dims of inputs stretch to the others, as expand did.
    Empty 1-d inputs are skipped whatever the others' rank, as torch.cat skips them."""
    shapes = [s for s in shapes if not _skipped_by_cat(s)] or shapes[:1]
    rank = len(shapes[0])
    axis = node.attrs["axis"] % rank
    if any(len(s) != rank for s in shapes):
        raise ValueError(f"concat along {axis} of {[tuple(s) for s in shapes]}: ranks differ")
    broadcast = node.attrs.get("broadcast")
    shape = []
    # one tuple per dim (zip runs in C: DenseNet's concats have up to 32 inputs, and the
    # loader checks this rule for each of them)
    for i, sizes in enumerate(zip(*shapes)):
        if i == axis:
            shape.append(sum(sizes))
            continue
        sizes = set(sizes)
        if broadcast:
            sizes.discard(1)
            sizes = sizes or {1}
        if len(sizes) != 1:
            raise ValueError(f"concat along {axis} of {[tuple(s) for s in shapes]}: dim {i} differs")
        shape.append(sizes.pop())
    # np.result_type costs ~0.4 us per dtype; inputs of one dtype need none
    dtype = dtypes[0] if dtypes.count(dtypes[0]) == len(dtypes) else np.result_type(*dtypes)
    return [(tuple(shape), dtype)]


def _same_view(a, b):
    """a and b are the very same elements (not merely overlapping memory); strides of
    size-1 dims do not matter."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.__array_interface__["data"][0] != b.__array_interface__["data"][0]:
        return False
    return all(sa == sb for sa, sb, d in zip(a.strides, b.strides, a.shape) if d > 1)


def _skipped_by_cat(shape):
    return len(shape) == 1 and shape[0] == 0


def _concat_rows(node, ranks, batched):
    rank = max(r for r in ranks if r is not None)
    return rank > 0 and node.attrs["axis"] % rank != 0


@register(
    "concat", infer=concat_infer, attrs=dict(axis=axis(widest_input), broadcast=optional(FLAG)), rows=_concat_rows
)
def make_concat(node, inputs, outputs, ctx):
    out = outputs[0]
    axis = node.attrs["axis"] % out.ndim
    pairs = []
    start = 0
    inputs = [x for x in inputs if not _skipped_by_cat(x.shape)]
    for x in inputs:
        idx = [slice(None)] * out.ndim
        idx[axis] = slice(start, start + x.shape[axis])
        start += x.shape[axis]
        dst = out[tuple(idx)]
        if not _same_view(
            x, dst
        ):  # (np.copyto broadcasts size-1 dims when attrs broadcast)  # inputs the planner placed in their slice need no copy
            pairs.append((dst, x))
    if not pairs:
        return None
    if len(pairs) == len(inputs) and not node.attrs.get("broadcast"):
        return lambda: np.concatenate(inputs, axis=axis, out=out)

    def run():
        for dst, src in pairs:
            np.copyto(dst, src)

    return run


def split_infer(node, shapes, dtypes):
    axis = node.attrs["axis"] % len(shapes[0])
    if sum(node.attrs["sizes"]) != shapes[0][axis]:
        raise ValueError(f"sizes {node.attrs['sizes']} do not add up to dim {axis} of input {tuple(shapes[0])}")
    result = []
    for size in node.attrs["sizes"]:
        s = list(shapes[0])
        s[axis] = size
        result.append((tuple(s), dtypes[0]))
    return result


@register("split", infer=split_infer, attrs=dict(axis=AXIS, sizes=ints(lo=0, min_length=1)), rows=rows_off_axis("axis"))
def make_split(node, inputs, outputs, ctx):
    x = inputs[0]
    axis = node.attrs["axis"] % x.ndim
    pairs = []
    start = 0
    for out in outputs:
        n = out.shape[axis]
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(start, start + n)
        src = x[tuple(idx)]
        start += n
        if out is None or _same_view(src, out):
            continue
        pairs.append((out, src))
    if not pairs:
        return None

    def run():
        for dst, src in pairs:
            np.copyto(dst, src)

    return run


def _slice_index(attrs, ndim):
    index = [slice(None)] * ndim
    for ax, st, en, sp in zip(attrs["axes"], attrs["starts"], attrs["ends"], attrs["steps"]):
        index[ax % ndim] = slice(st, en, sp)
    for ax in attrs.get("squeeze", ()):
        s = index[ax % ndim]
        index[ax % ndim] = s.start
    # the Ellipsis keeps a selection of every dim a 0-d view, not a copied numpy scalar
    return tuple(index) + (Ellipsis,)


def _squeezed(v, attrs, ranks):
    """slice's squeeze: axes it also selects one index of, so each is one of its axes."""
    r = ranks[0]
    if type(v) is not tuple or any(type(a) is not int for a in v) or r is None:
        return "a tuple of ints"
    picked = {a % r for a in attrs["axes"]}
    if any(not -r <= a < r or a % r not in picked for a in v) or len({a % r for a in v}) != len(v):
        return f"a tuple of distinct axes among axes {attrs['axes']}"


# axes first: the other tuples hold one entry per axis
SLICE_ATTRS = dict(
    axes=AXES,
    starts=ints(length_of("axes")),
    ends=ints(length_of("axes")),
    steps=ints(length_of("axes"), lo=1),
    squeeze=optional(_squeezed),
)
# end_dims: per axis, -1 for the literal end, else the dim of input 1 (read for its shape
# only) the end follows, divided (floor) by end_divs: a dynamic export's pos[:, : x.size(1)]
# or z[..., : z.size(2) // 2]
SLICE_END_DIMS = optional(ints(length_of("axes"), lo=-1))
SLICE_END_DIVS = optional(ints(length_of("axes"), lo=1))


def _with_followed_ends(attrs, shapes):
    """attrs with each end that follows a dim of input 1 (end_dims) set to that dim's size
    floor-divided by its end_divs entry."""
    dims = attrs.get("end_dims")
    if not dims:
        return attrs
    like = shapes[1] if len(shapes) > 1 else None
    if like is None:
        raise ValueError("end_dims names dims of input 1, which is absent")
    if max(dims) >= len(like):
        raise ValueError(f"end_dims {tuple(dims)} name a dim past input 1 of shape {tuple(like)}")
    divs = attrs.get("end_divs") or (1,) * len(dims)
    ends = tuple(like[k] // q if k >= 0 else e for k, q, e in zip(dims, divs, attrs["ends"]))
    return {**attrs, "ends": ends}


def _slice_shape(shape, attrs):
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), tuple(shape), (0,) * len(shape))
    return probe[_slice_index(attrs, len(shape))].shape


_off_sliced_axes = rows_off_axis("axes")


def _slice_rows(node, ranks, batched):
    """Off dim 0, unless the slice's end follows dim 0 of a batched tensor
    (x[:, 3 : x.size(0)]): it is as long as the whole batch is, not as a chunk."""
    follows_batch = len(batched) > 1 and batched[1] and 0 in node.attrs.get("end_dims", ())
    return _off_sliced_axes(node, ranks, batched) and not follows_batch


def slice_infer(node, shapes, dtypes):
    return [(_slice_shape(shapes[0], _with_followed_ends(node.attrs, shapes)), dtypes[0])]


@register(
    "slice",
    infer=slice_infer,
    attrs=dict(SLICE_ATTRS, end_dims=SLICE_END_DIMS, end_divs=SLICE_END_DIVS),
    rows=_slice_rows,
    format_version=version_with("end_dims"),
)
def make_slice(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    attrs = _with_followed_ends(node.attrs, [None if v is None else v.shape for v in inputs])
    src = x[_slice_index(attrs, x.ndim)]
    if _same_view(src, out):
        return None
    dst = view_as(out, src.shape) if out.flags.c_contiguous else out
    return lambda: np.copyto(dst, src)


def transpose_infer(node, shapes, dtypes):
    return [(tuple(shapes[0][p] for p in node.attrs["perm"]), dtypes[0])]


def _matrix_swap(shape, perm):
    """(batch, rows, cols) when permuting `shape` by `perm` transposes a batch of
    matrices: the leading axes stay in place and the others form two runs that trade
    places (NCHW -> NHWC: (N, C, H*W) -> (N, H*W, C)); else None."""
    n, k = len(perm), 0
    while k < n and perm[k] == k:
        k += 1
    if k == n or list(perm[k:]) != list(range(perm[k], n)) + list(range(k, perm[k])):
        return None
    m = perm[k]
    return math.prod(shape[:k]), math.prod(shape[k:m]), math.prod(shape[m:])


def _blas_transposes(ctx, x, out, swap, threads):
    """Callable transposing each matrix of the batch by blas.transposed_copy, the output's
    rows split over the threads; None where BLAS cannot take them."""
    batch, rows, cols = swap
    src, dst = view_as(x, swap), view_as(out, (batch, cols, rows))
    parts = []
    for lo, hi in parallel.ranges(cols, threads):
        copies = [blas.transposed_copy(src[b, :, lo:hi], dst[b, lo:hi]) for b in range(batch)]
        if any(c is None for c in copies):
            return None
        parts.append(chain(*copies))
    return ctx.split(parts)


def _keeps_dim0(node, ranks, batched):
    return ranks[0] > 0 and node.attrs["perm"][0] % ranks[0] == 0


@register("transpose", infer=transpose_infer, attrs=dict(perm=permutation()), rows=_keeps_dim0)
def make_transpose(node, inputs, outputs, ctx):
    """A batch of matrix transposes (NCHW <-> NHWC) by BLAS's blocked transpose where it
    has one (runtime/blas.py), split over the threads by output rows: ConvNeXt-tiny's 46
    permutes, inside the model on 2 threads, measured faster than before (and faster
    split than with one thread each), and the whole model faster with them. Otherwise one
    strided copy, split over the threads along the output's first axis long enough to
    give each a part (blocked numpy copies were no faster than numpy's own order; the
    split gained on 96x56x56 and back over two threads; docs/performance.md, "Kernel
    measurements")."""
    x, out = inputs[0], outputs[0]
    threads = split_threads(ctx, node, out.size)
    swap = _matrix_swap(x.shape, node.attrs["perm"])
    if swap is not None and x.flags.c_contiguous and out.flags.c_contiguous:
        run = _blas_transposes(ctx, x, out, swap, threads)
        if run is not None:
            return run
    src = x.transpose(node.attrs["perm"])
    axis = next((i for i, d in enumerate(out.shape) if d >= threads), None) if threads > 1 else None
    if axis is None:
        return lambda: np.copyto(out, src)
    return split_copy(ctx, out, src, axis, threads)


def channel_shuffle_infer(node, shapes, dtypes):
    shape, g = tuple(shapes[0]), node.attrs["groups"]
    if len(shape) < 2 or not isinstance(g, int) or g < 1 or shape[1] % g:
        raise ValueError(f"groups={g!r} must divide the channels (axis 1) of input {shape}")
    sizes = node.attrs.get("sizes")
    if sizes is None:
        return [(shape, dtypes[0])]
    if not sizes or any(not isinstance(k, int) or k < 0 for k in sizes) or sum(sizes) != shape[1]:
        raise ValueError(f"sizes={sizes!r} must split the {shape[1]} channels of input {shape}")
    return [(shape[:1] + (k,) + shape[2:], dtypes[0]) for k in sizes]


@register(
    "channel_shuffle",
    infer=channel_shuffle_infer,
    attrs=dict(groups=POSITIVE, sizes=optional(ints(lo=0))),
    rows=True,
    format_version=version_with("sizes"),
)
def make_channel_shuffle(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    g = node.attrs["groups"]
    n, c = x.shape[:2]
    if "sizes" in node.attrs:
        return _shuffle_into_parts(x, outputs, g)
    grouped, swapped = (n, g, c // g, -1), (n, c // g, g, -1)
    if x.flags.c_contiguous and out.flags.c_contiguous:
        src, dst = view_as(x, grouped).transpose(0, 2, 1, 3), view_as(out, swapped)
        return lambda: np.copyto(dst, src)

    def run():  # a strided operand (a slice of a concat buffer): numpy's reshape copies
        np.copyto(out, x.reshape(grouped).transpose(0, 2, 1, 3).reshape(out.shape))

    return run


def _shuffle_into_parts(x, outputs, g):
    """The shuffled channels of x written straight into the split outputs: output
    channel j (counting across the outputs) is input channel (j % g) * C/g + j // g, so
    the channels of one output with one residue r = j % g form a stride-g slice of that
    output and a contiguous run of x. One np.copyto per output and residue, all on basic
    slices: any strides (an output placed in a concat slice), no temporary."""
    per_group = x.shape[1] // g
    pairs = []
    start = 0
    for out in outputs:
        size = out.shape[1]
        for r in range(g):
            first = start + (r - start) % g  # the output's first channel of residue r
            count = len(range(first, start + size, g))
            if count:
                src = x[:, r * per_group + first // g : r * per_group + first // g + count]
                pairs.append((out[:, first - start :: g], src))
        start += size
    copyto = np.copyto

    def run():
        for dst, src in pairs:
            copyto(dst, src)

    return run


def slice_assign_infer(node, shapes, dtypes):
    target = _slice_shape(shapes[0], node.attrs)
    if np.broadcast_shapes(tuple(shapes[1]), target) != target:
        raise ValueError(f"src {tuple(shapes[1])} does not broadcast to the slice's shape {target}")
    return [(tuple(shapes[0]), dtypes[0])]


@register("slice_assign", infer=slice_assign_infer, inplace=True, attrs=SLICE_ATTRS, rows=_off_sliced_axes)
def make_slice_assign(node, inputs, outputs, ctx):
    x, src, out = inputs[0], inputs[1], outputs[0]
    dst = out[_slice_index(node.attrs, out.ndim)]
    np.broadcast_shapes(src.shape, dst.shape)  # a src that cannot fill the slice fails at bind
    if _same_memory(x, out):
        return lambda: np.copyto(dst, src)

    def run():
        np.copyto(out, x)
        np.copyto(dst, src)

    return run
