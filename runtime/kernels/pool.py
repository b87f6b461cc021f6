"""Pooling by maxima / sums over strided slices of a padded buffer (one numpy call per
kernel tap; sliding_window_view reductions are ~20x slower).

`max_pool`, `avg_pool`: attrs kernel, stride, pads (begins then ends per spatial dim),
dilation, ceil_mode, and for avg count_include_pad, divisor_override (0 = none).
`adaptive_avg_pool`, `adaptive_max_pool`: attrs output_size (one int per spatial dim).
"""

import math

import numpy as np

from pmx.runtime import parallel
from pmx.runtime.kernels import persistent_buffer, register, scratch_array, scratch_nbytes
from pmx.runtime.kernels.common import chain, padded_buffer, phase_fill, phases, view_as
from pmx.runtime.kernels.reduce import REDUCERS, reduction


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
        _pool_len(x[-nd + i], a["kernel"][i], a["stride"][i], dil[i], a["pads"][i], a["pads"][nd + i], a.get("ceil_mode", False))
        for i in range(nd))
    return [(tuple(x[:-nd]) + spatial, dtypes[0])]


def _taps(x, out, a, fill):
    """Padded copy step and one strided view of it per kernel tap."""
    nd = len(a["kernel"])
    k, s = a["kernel"], a["stride"]
    d = a.get("dilation") or (1,) * nd
    pads = _ceil_pads(x, out, a)
    if any(pads):
        buf, interior = padded_buffer(x.shape, pads, x.dtype, fill)
        copy_in = lambda: np.copyto(interior, x)  # noqa: E731
    else:
        buf, copy_in = x, None
    views = []
    for tap in np.ndindex(*k):
        sl = tuple(slice(tap[i] * d[i], tap[i] * d[i] + (out.shape[-nd + i] - 1) * s[i] + 1, s[i]) for i in range(nd))
        views.append(buf[(Ellipsis,) + sl])
    return copy_in, views


def _max_pool_scratch(node, inputs, outputs):
    x, out = inputs[0], outputs[0]
    if x.ndim != len(node.attrs["kernel"]) + 2:
        return 0
    g = _max_pool_phases(x, out, node.attrs)
    separable = _separable_taps(g)
    row_maxima = [((g.n, g.c, separable[2]), out.dtype)] if separable else []
    return scratch_nbytes(((g.n, g.c, g.length), out.dtype), *row_maxima)


def _max_pool_phases(x, out, a):
    nd = len(a["kernel"])
    return phases(x.shape, a["kernel"], out.shape, a["stride"], a.get("dilation") or (1,) * nd, _ceil_pads(x, out, a),
                  shared_padding=True)


def _lowest(dtype):
    """The padding value of max pooling."""
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


@register("max_pool", infer=pool_infer, scratch=_max_pool_scratch)
def make_max_pool(node, inputs, outputs):
    """Maxima over the taps of the phase-split padded input (common.Phases, the depthwise
    conv's layout): every tap is a contiguous slice of each channel's buffer, so each
    np.maximum runs over whole channels instead of strided output rows (a 3x3 stride-2
    pool on 64x112x112 took 1.57 ms as strided views). Channels split over the cores."""
    x, out = inputs[0], outputs[0]
    if x.ndim != len(node.attrs["kernel"]) + 2:
        return _max_pool_views(node, x, out)
    g = _max_pool_phases(x, out, node.attrs)
    # persistent: the padding stays lowest (shared with max pools of the same geometry)
    buf = persistent_buffer(("max_pool", x.shape, out.shape, g.k, g.stride, g.dilation, g.pads),
                            (g.n, g.c, g.per_channel), x.dtype, _lowest(x.dtype))
    wide = scratch_array((g.n, g.c, g.length), out.dtype)
    valid = (slice(None), slice(None), slice(None)) + tuple(slice(0, o) for o in g.out_spatial[1:])
    wide_valid = view_as(wide, (g.n, g.c) + g.wide)[valid]
    fill_phases = phase_fill(x, buf, g)  # copies the interior only: the padding keeps its value
    separable = _separable_taps(g)
    row_maxima = scratch_array((g.n, g.c, separable[2]), out.dtype) if separable else None
    threads = parallel.num_threads() if parallel.worth_splitting(out.size * len(g.taps)) else 1
    parts = []
    for lo, hi in parallel.ranges(g.c, threads):
        ch = slice(lo, hi)
        if separable:
            maxima = _separable_maximum(buf[:, ch], separable, g.length, row_maxima[:, ch], wide[:, ch])
        else:
            maxima = _maximum_of([buf[:, ch, t:t + g.length] for t in g.taps], wide[:, ch])
        parts.append(chain(fill_phases(ch), maxima, lambda d=out[:, ch], s=wide_valid[:, ch]: np.copyto(d, s)))
    return parallel.split(parts)


def _separable_taps(g):
    """(offsets along the last axis, offsets of the rows, row-maxima length) when the max
    pool on Phases g runs separably, else None. A window's maximum is the maximum over
    its rows of each row's maximum, and with stride 1 every tap's offset in the phase
    buffer is a row offset plus a column offset, so one pass of kw - 1 maxima over the
    buffer gives every row's maximum and kh - 1 more over those give the output: 4
    np.maximum calls for 3x3 instead of 8 (kh * kw - 1), 8 for 5x5 instead of 24.
    Only where every stride is 1: with stride 2 the rows of a window lie in two phases,
    and the row maxima span both. Single thread, us, taps -> separable: 3x3 stride 1
    512x14x14 224 -> 140, 256x28x28 388 -> 239, 832x7x7 122 -> 86; but stride 2 192x56x56
    304 -> 384, 480x28x28 229 -> 290, 832x14x14 (2x2) 60 -> 98 (64x112x112: 369 -> 218)."""
    if any(s != 1 for s in g.stride) or len(g.k) < 2 or g.k[-1] < 2 or len(g.taps) == g.k[-1]:
        return None
    kw = g.k[-1]
    columns, rows = g.taps[:kw], g.taps[::kw]
    return columns, rows, g.length + max(rows)


def _separable_maximum(buf, taps, length, row_maxima, acc):
    """Callable writing into acc (..., length) the maxima over the taps of buf as rows x
    columns (_separable_taps): the row maxima at every offset a row may start, then their
    maxima."""
    columns, rows, span = taps
    by_column = [buf[..., c:c + span] for c in columns]
    by_row = [row_maxima[..., r:r + length] for r in rows]
    maximum = np.maximum

    def run():
        maximum(by_column[0], by_column[1], out=row_maxima)
        for t in by_column[2:]:
            maximum(row_maxima, t, out=row_maxima)
        maximum(by_row[0], by_row[1], out=acc)
        for t in by_row[2:]:
            maximum(acc, t, out=acc)

    return run


def _maximum_of(taps, acc):
    first, rest = taps[0], taps[1:]

    def run():
        np.copyto(acc, first)
        for t in rest:
            np.maximum(acc, t, out=acc)

    return run


def _ceil_pads(x, out, a):
    """The explicit pads, with the ends grown where ceil_mode windows run past them."""
    nd = len(a["kernel"])
    k, s = a["kernel"], a["stride"]
    d = a.get("dilation") or (1,) * nd
    pads = list(a["pads"])
    for i in range(nd):
        need = (out.shape[-nd + i] - 1) * s[i] + d[i] * (k[i] - 1) + 1
        have = x.shape[-nd + i] + pads[i] + pads[nd + i]
        pads[nd + i] += max(0, need - have)
    return tuple(pads)


def _max_pool_views(node, x, out):
    """Unbatched inputs (no channel axis to split): maxima over strided views."""
    copy_in, views = _taps(x, out, node.attrs, _lowest(x.dtype))
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


@register("avg_pool", infer=pool_infer)
def make_avg_pool(node, inputs, outputs):
    x, out = inputs[0], outputs[0]
    copy_in, views = _taps(x, out, node.attrs, 0)
    scale = _avg_divisor(x, out, node.attrs)
    if np.ndim(scale) == 0:
        scale = np.float32(1.0 / float(scale)) if out.dtype == np.float32 else 1.0 / float(scale)
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
    spatial = tuple(x[-nd + i] if o is None else o for i, o in enumerate(size))
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


@register("adaptive_avg_pool", infer=adaptive_infer)
def make_adaptive_avg_pool(node, inputs, outputs):
    return _make_adaptive("mean", node, inputs, outputs)


@register("adaptive_max_pool", infer=adaptive_infer)
def make_adaptive_max_pool(node, inputs, outputs):
    return _make_adaptive("max", node, inputs, outputs)
