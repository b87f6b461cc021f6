"""Pooling by maxima / sums over strided slices of a padded buffer (one numpy call per
kernel tap; sliding_window_view reductions measured much slower: docs/performance.md,
"Kernel measurements").

`max_pool`, `avg_pool`: attrs kernel, stride, pads (begins then ends per spatial dim),
dilation, ceil_mode, and for avg count_include_pad, divisor_override (0 = none).
`adaptive_avg_pool`, `adaptive_max_pool`: attrs output_size (one int per spatial dim; 0 keeps
the input's size, torch's None).
"""

import math

import numpy as np

from pmx.runtime import parallel
from pmx.runtime.kernels.attr_specs import FLAG, NON_NEGATIVE, input_rank, ints, length_of, optional
from pmx.runtime.kernels.bind import scratch_nbytes
from pmx.runtime.kernels.common import (
    chain,
    copy_rows,
    copy_strided,
    expect_output_positions,
    padded_buffer,
    pairs_castable,
    phase_buffer,
    phase_scratch,
    phases,
    root_array,
    split_threads,
    view_as,
)
from pmx.runtime.kernels.reduce import REDUCERS, reduction
from pmx.runtime.kernels.registry import register, rows_below_rank, version_with

# kernel first: the other tuples' lengths follow it (one entry per spatial dim, pads
# begins then ends)
POOL_ATTRS = dict(
    kernel=ints(min_length=1, max_length=input_rank(0), lo=1),
    stride=ints(length_of("kernel"), lo=1),
    pads=ints(length_of("kernel", 2), lo=0),
    dilation=optional(ints(length_of("kernel"), lo=1)),
    ceil_mode=optional(FLAG),
)
AVG_POOL_ATTRS = dict(POOL_ATTRS, count_include_pad=optional(FLAG), divisor_override=optional(NON_NEGATIVE))
ADAPTIVE_ATTRS = dict(output_size=ints(min_length=1, max_length=input_rank(0), lo=0))


def _pool_len(n, k, s, d, pb, pe, ceil_mode):
    span = n + pb + pe - d * (k - 1) - 1
    if ceil_mode:
        out = -(-span // s) + 1
        if (out - 1) * s >= n + pb:  # last window must start inside the input or left pad
            out -= 1
    else:
        out = span // s + 1
    return out


def pool_infer(node, shapes, dtypes):
    x = shapes[0]
    a = node.attrs
    nd = len(a["kernel"])
    dil = a.get("dilation") or (1,) * nd
    spatial = tuple(
        _pool_len(
            x[-nd + i],
            a["kernel"][i],
            a["stride"][i],
            dil[i],
            a["pads"][i],
            a["pads"][nd + i],
            a.get("ceil_mode", False),
        )
        for i in range(nd)
    )
    if np.dtype(dtypes[0]).kind == "b":
        raise ValueError(f"input of dtype bool: {node.op} takes numbers (torch refuses bool too)")
    expect_output_positions(x, spatial, f"window {tuple(a['kernel'])} (pads {tuple(a['pads'])})")
    return [(tuple(x[:-nd]) + spatial, dtypes[0])]


def _taps(ctx, x, out, a, fill):
    """Padded copy step and one strided view of it per kernel tap."""
    nd = len(a["kernel"])
    k, s = a["kernel"], a["stride"]
    d = a.get("dilation") or (1,) * nd
    pads = _ceil_pads(x.shape, out.shape, a)
    if any(pads):
        buf, interior = padded_buffer(ctx, x.shape, pads, x.dtype, fill)
        copy_in = copy_rows(interior, x)
    else:
        buf, copy_in = x, None
    views = []
    for tap in np.ndindex(*k):
        sl = tuple(slice(tap[i] * d[i], tap[i] * d[i] + (out.shape[-nd + i] - 1) * s[i] + 1, s[i]) for i in range(nd))
        views.append(buf[(Ellipsis,) + sl])
    return copy_in, views


def _on_strided_views(node, x, out):
    """Whether a pool reduces strided views of its input (unbatched inputs, which have no
    channel axis to split, and averages of non-float ones) instead of taking
    _whole_channel_pool's paths."""
    return x.ndim != len(node.attrs["kernel"]) + 2 or (node.op == "avg_pool" and out.dtype.kind != "f")


def _pool_scratch(node, inputs, outputs, ctx):
    """Scratch bytes of the path _whole_channel_pool takes (none on strided views)."""
    x, out = inputs[0], outputs[0]
    a = node.attrs
    if _on_strided_views(node, x, out):
        return 0
    pairs = _ColumnPairs.of(x, out, a)
    if pairs is not None:
        return scratch_nbytes(*pairs.scratch(x.dtype, x.shape))
    if _same_size_stride_one(x, out, a):
        return scratch_nbytes((x.shape, out.dtype))
    g = _pool_phases(x, out, a)
    separable = _separable_taps(g)
    row_maxima = [((g.n, g.c, separable[2]), out.dtype)] if separable else []
    return scratch_nbytes(*phase_scratch(g, x.shape, x.dtype), ((g.n, g.c, g.length), out.dtype), *row_maxima)


def _pool_phases(x, out, a):
    nd = len(a["kernel"])
    return phases(
        x.shape,
        a["kernel"],
        out.shape,
        a["stride"],
        a.get("dilation") or (1,) * nd,
        _ceil_pads(x.shape, out.shape, a),
        shared_padding=True,
    )


def _lowest(dtype):
    """The padding value of max pooling."""
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


@register("max_pool", infer=pool_infer, scratch=_pool_scratch, attrs=POOL_ATTRS, rows=rows_below_rank("kernel"))
def make_max_pool(node, inputs, outputs, ctx):
    """Maxima over the taps of whole channels (_whole_channel_pool)."""
    x, out = inputs[0], outputs[0]
    if _on_strided_views(node, x, out):
        return _max_pool_views(ctx, node, x, out)
    return _whole_channel_pool(ctx, node, x, out, _maximum_of, _lowest(x.dtype))


def _whole_channel_pool(ctx, node, x, out, combine, pad_value, finish=None):
    """Max or average pooling (`combine`: _maximum_of or _sum_of; `pad_value` the lowest
    value or 0; `finish` (channel slice -> callable) run last in each part) over whole
    channels, split over the threads: by column pairs (_ColumnPairs) for 2-d pools with
    stride 2 along the width, on the input as it is for stride-1 pools as large as their
    input (_same_size_pool), else over the phase-split padded input (_phase_pool)."""
    pairs = _ColumnPairs.of(x, out, node.attrs)
    if pairs is not None:
        return _column_pairs_pool(ctx, node, pairs, x, out, combine, pad_value, finish)
    if _same_size_stride_one(x, out, node.attrs):
        return _same_size_pool(ctx, node, x, out, combine, finish)
    return _phase_pool(ctx, node, x, out, combine, pad_value, finish)


def _same_size_stride_one(x, out, a):
    """Whether a 2-d pool runs on x as it is (_same_size_pool): stride 1, an output as
    large as the input (Inception's 3x3 pools with padding 1), and each image's channels
    stored one after another in both x and out."""
    return (
        x.ndim == 4
        and len(a["kernel"]) == 2
        and tuple(a["stride"]) == (1, 1)
        and out.shape == x.shape
        and _image_rows(x) is not None
        and _image_rows(out) is not None
    )


def _image_rows(a):
    """(N, C, H, W) as (N, C * H * W) without copying, or None."""
    try:
        return view_as(a, (a.shape[0], math.prod(a.shape[1:])))
    except (AttributeError, ValueError):
        return None


def _same_size_pool(ctx, node, x, out, combine, finish=None):
    """Stride-1 pooling with an output as large as the input, separably and with no padded
    copy: each image's channels as one flat range, a tap along the width is a shift of
    that range and one along the height a shift by whole rows, so the row pass (into
    scratch) and the column pass (into out) are kw - 1 and kh - 1 reductions over flat
    slices. A tap that would read across a row's end (or above the first row, below the
    last) lands only on the outputs whose window reaches into the padding: those columns
    and rows are computed again from their valid taps. Against the phase path it skips
    the copy into the padded buffer and the copy out of the wide output: faster on 3x3
    pools with padding 1 (GoogLeNet's and Inception-v3's, max and average), one thread
    and two (level on 832x7x7 max over two; docs/performance.md, "Kernel
    measurements")."""
    _n, c, h, w = x.shape
    a = node.attrs
    dil = a.get("dilation") or (1, 1)
    pads = a["pads"]
    column_shifts = [kx * dil[1] - pads[1] for kx in range(a["kernel"][1])]
    row_shifts = [ky * dil[0] - pads[0] for ky in range(a["kernel"][0])]
    edge_columns = [ox for ox in range(w) if not all(0 <= ox + dx < w for dx in column_shifts)]
    edge_rows = [oy for oy in range(h) if not all(0 <= oy + dy < h for dy in row_shifts)]
    row_acc = ctx.scratch_array(x.shape, out.dtype)
    parts = []
    for c0, c1 in parallel.ranges(c, split_threads(ctx, node, out.size * (len(column_shifts) + len(row_shifts)))):
        ch = slice(c0, c1)
        src, acc, dst = x[:, ch], row_acc[:, ch], out[:, ch]
        steps = [_shifted(combine, _image_rows(src), _image_rows(acc), column_shifts)]
        steps += [
            combine([src[..., ox + dx] for dx in column_shifts if 0 <= ox + dx < w], acc[..., ox])
            for ox in edge_columns
        ]
        steps.append(_shifted(combine, _image_rows(acc), _image_rows(dst), [dy * w for dy in row_shifts]))
        steps += [
            combine([acc[:, :, oy + dy] for dy in row_shifts if 0 <= oy + dy < h], dst[:, :, oy]) for oy in edge_rows
        ]
        parts.append(chain(*steps, finish(ch) if finish else None))
    return ctx.split(parts)


def _shifted(combine, src, dst, shifts):
    """Callable writing into dst (N, L) the reduction over the shifts of src (N, L): dst[i]
    from src[i + shift] for every shift, over the i where all of those lie inside."""
    length = src.shape[1]
    lo, hi = max(0, -min(shifts)), length - max(0, *shifts)
    if hi <= lo:
        return None
    return combine([src[:, lo + s : hi + s] for s in shifts], dst[:, lo:hi])


def _phase_pool(ctx, node, x, out, combine, pad_value, finish=None):
    """Pooling over the taps of the phase-split padded input (common.Phases, the depthwise
    conv's layout), its padding `pad_value`: every tap is a contiguous slice of each
    channel's buffer, so each reduction runs over whole channels instead of strided
    output rows (slow as strided views on a 3x3 stride-2 max pool on 64x112x112:
    docs/performance.md, "Kernel measurements").
    Stride 1 reduces separably (_separable_taps)."""
    g = _pool_phases(x, out, node.attrs)
    buf, fill_phases = phase_buffer(ctx, x, g, fill=pad_value)
    wide = ctx.scratch_array((g.n, g.c, g.length), out.dtype)
    valid = (slice(None), slice(None), slice(None)) + tuple(slice(0, o) for o in g.out_spatial[1:])
    wide_valid = view_as(wide, (g.n, g.c) + g.wide)[valid]
    separable = _separable_taps(g)
    row_acc = ctx.scratch_array((g.n, g.c, separable[2]), out.dtype) if separable else None
    parts = []
    for lo, hi in parallel.ranges(g.c, split_threads(ctx, node, out.size * len(g.taps))):
        ch = slice(lo, hi)
        if separable:
            reduced = _separable_reduce(buf[:, ch], separable, g.length, row_acc[:, ch], wide[:, ch], combine)
        else:
            reduced = combine([buf[:, ch, t : t + g.length] for t in g.taps], wide[:, ch])
        parts.append(
            chain(fill_phases(ch), reduced, copy_rows(out[:, ch], wide_valid[:, ch]), finish(ch) if finish else None)
        )
    return ctx.split(parts)


def _separable_taps(g):
    """(offsets along the last axis, offsets of the rows, row-maxima length) when the pool
    on Phases g runs separably, else None. A window's maximum (sum) is the maximum (sum)
    over its rows of each row's, and with stride 1 every tap's offset in the phase
    buffer is a row offset plus a column offset, so one pass of kw - 1 maxima over the
    buffer gives every row's maximum and kh - 1 more over those give the output: 4
    np.maximum calls for 3x3 instead of 8 (kh * kw - 1), 8 for 5x5 instead of 24.
    Only where every stride is 1: with stride 2 the rows of a window lie in two phases,
    and the row maxima span both. Single thread, separable measured faster than taps at
    stride 1, but slower at stride 2 on most shapes (docs/performance.md, "Kernel
    measurements")."""
    if any(s != 1 for s in g.stride) or len(g.k) < 2 or g.k[-1] < 2 or len(g.taps) == g.k[-1]:
        return None
    kw = g.k[-1]
    columns, rows = g.taps[:kw], g.taps[::kw]
    return columns, rows, g.length + max(rows)


def _separable_reduce(buf, taps, length, row_acc, acc, combine):
    """Callable writing into acc (..., length) the maxima or sums (`combine`) over the taps
    of buf as rows x columns (_separable_taps): each row's at every offset a row may
    start, then theirs."""
    columns, rows, span = taps
    return chain(
        combine([buf[..., c : c + span] for c in columns], row_acc),
        combine([row_acc[..., r : r + length] for r in rows], acc),
    )


class _ColumnPairs:
    """Geometry of 2-d max (or average) pooling with stride 2 along the width W, for 4- and
    2-byte items on a little-endian host (W even; an odd-width input is read through a
    copy one column wider, see _column_pairs_pool). The phase path split such inputs into
    four phases by strided copies, as slow as all the maxima after them, and maxima over strided views
    of short rows pay numpy's per-row loop cost. Here every pass is over whole channels:
      1. the input's columns split into even and odd ones by casting each channel, viewed
         as pairs of items in one unsigned integer twice as wide, to the item-sized
         integer: the cast keeps the low half (the even column); a view one item in gives
         the odd one. Contiguous casts, several times faster than strided copies;
      2. maxima along the width: a tap reads input column 2x + kx*d - left, an even or
         odd column at a fixed offset in column pairs, so over each channel's rows
         flattened, each tap is one contiguous slice, and kw - 1 maxima give every input
         row's maxima (H, W/2). Output columns whose window reaches into the padding read
         the neighbouring row there (`edge_columns`): they are computed again from their
         valid taps;
      3. maxima along the height the same way: output row y, tap ky reads row maxima row
         s*y + ky*d - top, at offset (ky*d - top) * W/2 from position y * s * W/2, so the
         "wide" output (rows of s * W/2, of which the first out_w are kept) is kh - 1
         maxima over contiguous slices. Output rows whose window reaches into the padding
         (`edge_rows`) are computed from their valid rows straight into the output.
    Two threads, faster than the phase path on every shape measured (GoogLeNet's and
    ResNet-18's 3x3 and 2x2 stride-2 max pools; docs/performance.md, "Kernel
    measurements")."""

    def __init__(self, x_shape, out_shape, kernel, stride, dilation, pads):
        self.n, self.c, self.height, self.width = x_shape
        self.out_h, self.out_w = out_shape[2:]
        self.half = self.width // 2
        kh, kw = kernel
        # per tap along the width: (0 even / 1 odd input column, offset in column pairs)
        self.column_taps = [divmod(kx * dilation[1] - pads[1], 2)[::-1] for kx in range(kw)]
        offsets = [offset for _, offset in self.column_taps]
        self.edge_columns = [x for x in range(self.out_w) if not 0 <= x + min(offsets) <= x + max(offsets) < self.half]
        # per tap along the height: input row offset from stride * y
        self.row_taps = [ky * dilation[0] - pads[0] for ky in range(kh)]
        self.wide_row = stride[0] * self.half
        self.stride_h = stride[0]
        inner = [y for y in range(self.out_h) if all(0 <= stride[0] * y + r < self.height for r in self.row_taps)]
        self.inner_rows = (inner[0], inner[-1] + 1) if inner else (0, 0)
        self.edge_rows = [y for y in range(self.out_h) if not self.inner_rows[0] <= y < self.inner_rows[1]]

    @staticmethod
    def of(x, out, a):
        """The geometry when this path applies, else None: 2-d, stride 2 along the width,
        every output column at most ceil(W/2), and an input _widened takes."""
        x_shape = _widened(x)
        if (
            len(a["kernel"]) != 2
            or a["stride"][1] != 2
            or x_shape is None
            or out.shape[-1] > x_shape[-1] // 2
            or x.dtype != out.dtype
        ):
            return None
        return _ColumnPairs(
            x_shape,
            out.shape,
            tuple(a["kernel"]),
            tuple(a["stride"]),
            tuple(a.get("dilation") or (1, 1)),
            _ceil_pads(x_shape, out.shape, a),
        )

    def scratch(self, dtype, x_shape):
        """(even columns, odd columns, row maxima, and for an input x_shape of odd width
        its copy one column wider) as (shape, dtype) pairs, each channel's block as long
        as the longer of the row maxima (H * W/2) and the wide output; the even columns'
        buffer takes the wide output once the row maxima are done."""
        blocks = [((self.n, self.c, max(self.height * self.half, self.out_h * self.wide_row)), dtype)] * 3
        return blocks + ([(tuple(x_shape[:-1]) + (self.width,), dtype)] if x_shape[-1] != self.width else [])


def _column_pairs_pool(ctx, node, g, x, out, combine, pad_value, finish=None):
    """Pooling by _ColumnPairs (see _whole_channel_pool for the arguments). The
    reductions run over each image's channels of a part as one flat range (channel blocks
    of one length), so numpy runs one loop per image, not one per channel (measured
    faster on 192x56x56: docs/performance.md, "Kernel measurements"):
    a tap's slice crosses into the next channel only at outputs recomputed as edges or
    discarded. An input of odd width is first copied into scratch one column
    wider, whose last column is set to the padding value (the lowest value for maxima,
    zero for sums): faster than the phase path on SqueezeNet's odd-width max pools, 2
    threads (docs/performance.md, "Kernel measurements")."""
    even, odd, row_max, *widened = (ctx.scratch_array(shape, dt) for shape, dt in g.scratch(x.dtype, x.shape))
    source, widen = x, None
    if widened:
        source = widened[0]
        widen = lambda ch: chain(
            copy_rows(source[:, ch, :, :-1], x[:, ch]), lambda last=source[:, ch, :, -1]: last.fill(pad_value)
        )
    parts = []
    for c0, c1 in parallel.ranges(g.c, split_threads(ctx, node, out.size * len(g.column_taps) * 4)):
        ch = slice(c0, c1)
        parts.append(
            chain(
                widen(ch) if widen else None,
                _split_columns(source[:, ch], even[:, ch], odd[:, ch]),
                _row_pass(g, even[:, ch], odd[:, ch], row_max[:, ch], combine),
                _column_pass(g, row_max[:, ch], even[:, ch], out[:, ch], combine),
                finish(ch) if finish else None,
            )
        )
    return ctx.split(parts)


def _widened(x):
    """The shape _ColumnPairs reads x as: x's own when _split_columns takes it, one
    column wider for an odd width (copied), else None."""
    if not (x.ndim >= 3 and pairs_castable(x.dtype)):
        return None
    if x.shape[-1] % 2:
        return x.shape[:-1] + (x.shape[-1] + 1,)
    contiguous_channels = x.strides[-1] == x.itemsize and all(
        x.strides[i] == x.itemsize * math.prod(x.shape[i + 1 :]) for i in range(2, x.ndim)
    )
    return x.shape if contiguous_channels else None


def _split_columns(x, even, odd):
    """Callable writing x's even and odd columns (x: N, C, ..., W, W even, each channel's
    rows adjacent), each channel's rows flattened, into even and odd (N, C, >= size / 2):
    copy_strided's pair casts, several times faster than strided copies of every other
    item (96x112x112 float32: docs/performance.md, "Kernel measurements"). The odd
    columns' last item is copied on its own: its pair would read one item past the
    channel."""
    size = math.prod(x.shape[2:])
    flat = view_as(x, x.shape[:2] + (size,))
    owner = root_array(x)
    last_odd, last = odd[..., size // 2 - 1], flat[..., -1]
    return chain(
        copy_strided(even[..., : size // 2], flat[..., 0::2], owner),
        copy_strided(odd[..., : size // 2 - 1], flat[..., 1:-1:2], owner),
        lambda: np.copyto(last_odd, last),
    )


def _flat(a):
    """(N, C, B) blocks as (N, C * B): one range per image."""
    return view_as(a, (a.shape[0], a.shape[1] * a.shape[2]))


def _grid(a, rows, columns):
    """(N, C, B) blocks as (N, C, rows, columns), the first rows * columns of each."""
    return a[..., : rows * columns].reshape(a.shape[:2] + (rows, columns))


def _row_pass(g, even, odd, row_max, combine):
    """Callable writing into row_max's blocks each input row's maximum (or sum: `combine`)
    over the window columns of every output column x < W/2 (x >= out_w: unused)."""
    columns = (_flat(even), _flat(odd))
    offsets = [offset for _, offset in g.column_taps]
    lo, hi = max(0, -min(offsets)), columns[0].shape[1] - max(0, *offsets)
    bulk = combine(
        [columns[parity][:, lo + offset : hi + offset] for parity, offset in g.column_taps], _flat(row_max)[:, lo:hi]
    )
    grid = [_grid(a, g.height, g.half) for a in (even, odd, row_max)]
    edges = [
        combine(
            [grid[parity][..., x + offset] for parity, offset in g.column_taps if 0 <= x + offset < g.half],
            grid[2][..., x],
        )
        for x in g.edge_columns
    ]
    return chain(bulk, *edges)


def _column_pass(g, row_max, wide, out, combine):
    """Callable writing the output: the maxima (or sums: `combine`) over the window rows
    of row_max, "wide" into `wide`'s blocks for the rows whose windows lie inside the
    input, then copied out; the other rows straight into out."""
    y0, y1 = g.inner_rows
    steps = []
    if y1 > y0:
        rows, target = _flat(row_max), _flat(wide)
        shifts = [r * g.half for r in g.row_taps]
        lo, hi = y0 * g.wide_row, target.shape[1] - max(0, *shifts)
        steps.append(combine([rows[:, lo + shift : hi + shift] for shift in shifts], target[:, lo:hi]))
        steps.append(copy_rows(out[..., y0:y1, :], _grid(wide, g.out_h, g.wide_row)[..., y0:y1, : g.out_w]))
    grid = _grid(row_max, g.height, g.half)
    for y in g.edge_rows:
        taps = [grid[..., g.stride_h * y + r, : g.out_w] for r in g.row_taps if 0 <= g.stride_h * y + r < g.height]
        steps.append(combine(taps, out[..., y, :]))
    return chain(*steps)


def _maximum_of(taps, acc):
    """Callable writing into acc the maximum of the arrays `taps`, or the lowest value when
    there are none (a window wholly in the padding)."""
    return _reduce_taps(np.maximum, taps, acc, _lowest(acc.dtype))


def _sum_of(taps, acc):
    """Callable writing into acc the sum of the arrays `taps`, or zero when there are none."""
    return _reduce_taps(np.add, taps, acc, 0)


def _reduce_taps(ufunc, taps, acc, empty):
    if not taps:
        return lambda: acc.fill(empty)
    if len(taps) == 1:
        return lambda: np.copyto(acc, taps[0])
    first, second, rest = taps[0], taps[1], taps[2:]

    def run():
        ufunc(first, second, out=acc)
        for t in rest:
            ufunc(acc, t, out=acc)

    return run


def _ceil_pads(x_shape, out_shape, a):
    """The explicit pads, with the ends grown where ceil_mode windows run past them."""
    nd = len(a["kernel"])
    k, s = a["kernel"], a["stride"]
    d = a.get("dilation") or (1,) * nd
    pads = list(a["pads"])
    for i in range(nd):
        need = (out_shape[-nd + i] - 1) * s[i] + d[i] * (k[i] - 1) + 1
        have = x_shape[-nd + i] + pads[i] + pads[nd + i]
        pads[nd + i] += max(0, need - have)
    return tuple(pads)


def _max_pool_views(ctx, node, x, out):
    """Unbatched inputs (no channel axis to split): maxima over strided views."""
    copy_in, views = _taps(ctx, x, out, node.attrs, _lowest(x.dtype))
    return chain(copy_in, _maximum_of(views, out))


def _avg_divisor(x, out, a):
    """Per-output-position divisor, the product of per-axis window counts (torch rules)."""
    nd = len(a["kernel"])
    if a.get("divisor_override"):
        return np.float32(a["divisor_override"])
    div = np.ones(out.shape[-nd:], np.float64)
    for i in range(nd):
        n, k, s = x.shape[-nd + i], a["kernel"][i], a["stride"][i]
        pb, pe = a["pads"][i], a["pads"][nd + i]
        counts = []
        for o in range(out.shape[-nd + i]):
            start = o * s - pb
            end = min(start + k, n + pe)
            if a.get("count_include_pad", True):
                counts.append(end - start)
            else:
                counts.append(min(end, n) - max(start, 0))
        shape = [1] * nd
        shape[i] = -1
        div = div * np.array(counts, np.float64).reshape(shape)
    return (1.0 / div).astype(out.dtype)


@register("avg_pool", infer=pool_infer, scratch=_pool_scratch, attrs=AVG_POOL_ATTRS, rows=rows_below_rank("kernel"))
def make_avg_pool(node, inputs, outputs, ctx):
    """Sums over the taps, scaled by each window's divisor. Batched float inputs sum as
    max pooling takes its maxima (_whole_channel_pool); unbatched or integer inputs add
    strided views of the padded input. Column pairs measured faster than strided views
    on DenseNet-121's 2x2 stride-2 transitions, 2 threads, per node inside the model and
    timed alone, and phases (separable) faster than strided views on Inception-v3's 3x3
    stride-1 pools, timed alone, 2 threads (docs/performance.md, "Kernel
    measurements")."""
    x, out = inputs[0], outputs[0]
    a = node.attrs
    scale = _avg_divisor(x, out, a)
    if np.ndim(scale) == 0:
        scale = np.float32(1.0 / float(scale)) if out.dtype == np.float32 else 1.0 / float(scale)
    elif scale.size and np.all(scale == scale.flat[0]):
        scale = scale.dtype.type(scale.flat[0])  # one multiplier: no broadcast array per pass
    if _on_strided_views(node, x, out):
        return _avg_pool_views(ctx, x, out, a, scale)

    def finish(ch):
        part = out[:, ch]
        return lambda: np.multiply(part, scale, out=part)

    return _whole_channel_pool(ctx, node, x, out, _sum_of, 0, finish)


def _avg_pool_views(ctx, x, out, a, scale):
    """Unbatched or integer inputs: sums over strided views of the padded input."""
    copy_in, views = _taps(ctx, x, out, a, 0)
    first, rest = views[0], views[1:]

    def run():
        if copy_in is not None:
            copy_in()
        np.copyto(out, first)
        for v in rest:
            np.add(out, v, out=out)
        np.multiply(out, scale, out=out)

    return run


def adaptive_infer(node, shapes, dtypes):
    x = shapes[0]
    size = node.attrs["output_size"]
    nd = len(size)
    spatial = tuple(o or x[-nd + i] for i, o in enumerate(size))  # 0: the input's size (torch's None)
    return [(tuple(x[:-nd]) + spatial, dtypes[0])]


def _bins(n, o):
    return [(math.floor(i * n / o), math.ceil((i + 1) * n / o)) for i in range(o)]


def _make_adaptive(kind, node, inputs, outputs):
    x, out = inputs[0], outputs[0]
    reduce_fn = REDUCERS[kind]
    nd = len(node.attrs["output_size"])
    lead = x.ndim - nd
    in_sp, out_sp = x.shape[lead:], out.shape[lead:]
    axes = tuple(range(lead, x.ndim))
    if all(o == 1 for o in out_sp):
        # global pooling (squeeze-and-excitation, heads): the reduce ops' kernel
        return reduction(kind, x, out, axes)
    if all(n % o == 0 for n, o in zip(in_sp, out_sp)):
        split = tuple(x.shape[:lead])
        for n, o in zip(in_sp, out_sp):
            split += (o, n // o)
        inner = tuple(lead + 2 * i + 1 for i in range(nd))
        return lambda: reduce_fn(x.reshape(split), axis=inner, out=out)
    cells = []
    for idx in np.ndindex(*out_sp):
        sl = tuple(slice(*_bins(in_sp[i], out_sp[i])[idx[i]]) for i in range(nd))
        cells.append((x[(Ellipsis,) + sl], out[(Ellipsis,) + idx]))

    def run():
        for src, dst in cells:
            reduce_fn(src, axis=axes, out=dst)

    return run


# the adaptive pools' registration traits (adaptive_max_pool_indices in windows.py too)
# (an output size 0, the input's size, means nothing to a version-3 runtime)
ADAPTIVE_TRAITS = dict(
    attrs=ADAPTIVE_ATTRS,
    rows=rows_below_rank("output_size"),
    format_version=version_with("output_size", 4, when=lambda size: 0 in size),
)


@register("adaptive_avg_pool", infer=adaptive_infer, **ADAPTIVE_TRAITS)
def make_adaptive_avg_pool(node, inputs, outputs, ctx):
    return _make_adaptive("mean", node, inputs, outputs)


@register("adaptive_max_pool", infer=adaptive_infer, **ADAPTIVE_TRAITS)
def make_adaptive_max_pool(node, inputs, outputs, ctx):
    return _make_adaptive("max", node, inputs, outputs)
