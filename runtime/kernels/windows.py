"""Sliding-window ops beyond plain pooling: max pooling that also returns the argmax
indices, and im2col / col2im (Unfold / Fold).

`max_pool_indices`: max_pool's attrs (kernel, stride, pads, dilation, ceil_mode); outputs
    the maxima and, as int64, each maximum's flat index within its input channel's
    spatial dims (h * W + w for 2-d), as torch's max_pool*d(return_indices=True).
`adaptive_max_pool_indices`: adaptive_max_pool's attrs (output_size); the same two outputs.
`unfold`: attrs kernel, stride, pads (begins then ends), dilation; (N, C, H, W) or
    (C, H, W) -> (N, C*kh*kw, L) or (C*kh*kw, L), rows ordered channel, kernel row,
    kernel column, and L the window positions row-major.
`fold`: attrs output_size, kernel, stride, pads, dilation; the inverse layout, with
    overlapping windows summed, as torch's F.fold.

Ties and NaN follow torch's CPU loops: a window's first maximum wins, a NaN wins over
every number and a later NaN over an earlier one, and a window of -inf (or wholly made of
padding taps) points at its first element inside the input.
"""

import math

import numpy as np

from pmx.runtime.kernels.attr_specs import ints, length_of
from pmx.runtime.kernels.common import chain, copy_rows, padded_buffer, view_as
from pmx.runtime.kernels.pool import (
    ADAPTIVE_TRAITS,
    POOL_ATTRS,
    _bins,
    _ceil_pads,
    _lowest,
    adaptive_infer,
    pool_infer,
)
from pmx.runtime.kernels.registry import register, rows_below_rank

UNFOLD_ATTRS = dict(
    kernel=ints(min_length=1, lo=1),
    stride=ints(length_of("kernel"), lo=1),
    pads=ints(length_of("kernel", 2), lo=0),
    dilation=ints(length_of("kernel"), lo=1),
)
FOLD_ATTRS = dict(UNFOLD_ATTRS, output_size=ints(length_of("kernel"), lo=1))

# Taps of one window: far above any model's (a 224x224 global window is 50176), low
# enough that a hostile file cannot make a kernel loop for minutes.
MAX_WINDOW_TAPS = 1 << 20


def _check_geometry(a, pads=True):
    """Kernel, stride and dilation positive, pads non-negative, and a bounded window."""
    k, s, d = a["kernel"], a["stride"], a.get("dilation") or (1,) * len(a["kernel"])
    if min(k) < 1 or min(s) < 1 or min(d) < 1 or (pads and min(a["pads"]) < 0):
        raise ValueError(f"kernel {k}, stride {s}, dilation {d} must be positive, pads {a['pads']} non-negative")
    if math.prod(k) > MAX_WINDOW_TAPS:
        raise ValueError(f"a window of {math.prod(k)} taps (kernel {k}) is more than {MAX_WINDOW_TAPS}")


def _pool_indices_infer(node, shapes, dtypes):
    _check_geometry(node.attrs)
    ((shape, dtype),) = pool_infer(node, shapes, dtypes)
    return [(shape, dtype), (shape, np.int64)]


def _adaptive_indices_infer(node, shapes, dtypes):
    ((shape, dtype),) = adaptive_infer(node, shapes, dtypes)
    return [(shape, dtype), (shape, np.int64)]


def _first_inside(out_len, n, k, s, d, pad):
    """Per output position along one axis, the first tap of its window that lies inside
    the input (or the window's first tap when none does), as an input coordinate."""
    starts = np.arange(out_len) * s - pad
    first = starts.copy()
    for t in range(k):
        pos = starts + t * d
        undecided = first < 0
        first[undecided & (pos >= 0) & (pos < n)] = pos[undecided & (pos >= 0) & (pos < n)]
    return np.maximum(first, 0)


def _flat_index(coords, spatial):
    """Flat index over `spatial` of per-axis coordinate arrays, broadcast against each other."""
    flat = np.zeros((), np.int64)
    for c, n in zip(coords, spatial):
        flat = flat * n + c
    return flat


@register("max_pool_indices", infer=_pool_indices_infer, attrs=POOL_ATTRS, rows=rows_below_rank("kernel"))
def make_max_pool_indices(node, inputs, outputs, ctx):
    """Maxima over strided tap views of the input padded with the lowest value, and for
    each the tap's input position, updated where a tap is greater (or NaN)."""
    x, (out, idx) = inputs[0], outputs
    a = node.attrs
    nd = len(a["kernel"])
    k, s = a["kernel"], a["stride"]
    d = a.get("dilation") or (1,) * nd
    pads = _ceil_pads(x.shape, out.shape, a)
    spatial, out_sp = x.shape[-nd:], out.shape[-nd:]
    buf, interior = padded_buffer(ctx, x.shape, pads, x.dtype, _lowest(x.dtype))
    copy_in = copy_rows(interior, x)
    # per output position, the window's first valid element: where an all -inf window points
    first = _flat_index(
        np.ix_(*[_first_inside(out_sp[i], spatial[i], k[i], s[i], d[i], pads[i]) for i in range(nd)]), spatial
    )
    taps = []
    for tap in np.ndindex(*k):
        sl = tuple(slice(tap[i] * d[i], tap[i] * d[i] + (out_sp[i] - 1) * s[i] + 1, s[i]) for i in range(nd))
        # input position of this tap at every output position (padding taps never win)
        pos = _flat_index(np.ix_(*[np.arange(out_sp[i]) * s[i] - pads[i] + tap[i] * d[i] for i in range(nd)]), spatial)
        taps.append((buf[(Ellipsis,) + sl], pos))
    better = np.empty(out.shape, bool)
    nan = np.empty(out.shape, bool) if out.dtype.kind == "f" else None

    def run():
        copy_in()
        out.fill(_lowest(out.dtype))
        idx[...] = first
        for view, pos in taps:
            np.greater(view, out, out=better)
            if nan is not None:
                np.isnan(view, out=nan)
                np.logical_or(better, nan, out=better)
            np.copyto(out, view, where=better)
            np.copyto(idx, pos, where=better)

    return run


@register("adaptive_max_pool_indices", infer=_adaptive_indices_infer, **ADAPTIVE_TRAITS)
def make_adaptive_max_pool_indices(node, inputs, outputs, ctx):
    """One argmax per output cell over its bin (torch's floor / ceil bin edges), the
    window flattened; a NaN in the window gives the last NaN's index."""
    x, (out, idx) = inputs[0], outputs
    nd = len(node.attrs["output_size"])
    lead = x.shape[:-nd]
    spatial, out_sp = x.shape[-nd:], out.shape[-nd:]
    bins = [_bins(spatial[i], out_sp[i]) for i in range(nd)]
    cells = []
    for cell in np.ndindex(*out_sp):
        edges = [bins[i][cell[i]] for i in range(nd)]
        window = x[(Ellipsis,) + tuple(slice(lo, hi) for lo, hi in edges)]
        extent = tuple(hi - lo for lo, hi in edges)
        # window-local flat index -> input flat index
        local = np.arange(math.prod(extent)).reshape(extent)
        coords = np.unravel_index(local.reshape(-1), extent)
        to_input = _flat_index([c + lo for c, (lo, _) in zip(coords, edges)], spatial).astype(np.int64)
        cells.append((window, lead + (-1,), to_input, (Ellipsis,) + cell))
    is_float = x.dtype.kind == "f"

    def run():
        for window, flat_shape, to_input, at in cells:
            w = window.reshape(flat_shape)
            best = np.argmax(w, axis=-1)
            if is_float:
                nans = np.isnan(w)
                if nans.any():
                    last_nan = nans.shape[-1] - 1 - np.argmax(nans[..., ::-1], axis=-1)
                    best = np.where(nans.any(axis=-1), last_nan, best)
            out[at] = np.take_along_axis(w, best[..., None], axis=-1)[..., 0]
            idx[at] = to_input[best]

    return run


# --- unfold / fold ----------------------------------------------------------------------


def _reshaped(a, shape):
    """(a viewed as shape, the copy step that keeps it current): a itself when it can be
    viewed so, else a contiguous buffer (a strided arena alias) and, for an input, a
    copy into it at each run (`copy_from_a`), for an output a copy out of it (`copy_to_a`)."""
    try:
        return view_as(a, shape), None, None
    except (AttributeError, ValueError):
        buf = np.empty(a.shape, a.dtype)
        return buf.reshape(shape), (lambda: np.copyto(buf, a)), (lambda: np.copyto(a, buf))


def _blocks(spatial, a):
    """Window positions along each spatial axis."""
    k, s, d, p = a["kernel"], a["stride"], a["dilation"], a["pads"]
    nd = len(k)
    return tuple((spatial[i] + p[i] + p[nd + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(nd))


def unfold_infer(node, shapes, dtypes):
    x = shapes[0]
    a = node.attrs
    _check_geometry(a)
    nd = len(a["kernel"])
    if len(x) not in (nd + 1, nd + 2):
        raise ValueError(f"unfold takes a {nd + 1}-d or {nd + 2}-d input, got shape {tuple(x)}")
    blocks = _blocks(x[-nd:], a)
    if min(blocks) < 1:
        raise ValueError(f"unfold: no window fits input {tuple(x)} (kernel {a['kernel']}, pads {a['pads']})")
    return [(tuple(x[: -nd - 1]) + (x[-nd - 1] * math.prod(a["kernel"]), math.prod(blocks)), dtypes[0])]


def _tap_slices(a, blocks):
    k, s, d = a["kernel"], a["stride"], a["dilation"]
    for tap in np.ndindex(*k):
        yield tuple(slice(tap[i] * d[i], tap[i] * d[i] + (blocks[i] - 1) * s[i] + 1, s[i]) for i in range(len(k)))


@register("unfold", infer=unfold_infer, attrs=UNFOLD_ATTRS, rows=True)
def make_unfold(node, inputs, outputs, ctx):
    """One copy per kernel tap from a strided view of the zero-padded input into that
    tap's rows of the output."""
    x, out = inputs[0], outputs[0]
    a = node.attrs
    nd = len(a["kernel"])
    blocks = _blocks(x.shape[-nd:], a)
    if any(a["pads"]):
        buf, interior = padded_buffer(ctx, x.shape, a["pads"], x.dtype, 0)
        copy_in = copy_rows(interior, x)
    else:
        buf, copy_in = x, None
    c = x.shape[-nd - 1]
    rows, _, copy_out = _reshaped(out, out.shape[:-2] + (c, math.prod(a["kernel"])) + blocks)
    copies = [
        copy_rows(rows[(Ellipsis, t) + (slice(None),) * nd], buf[(Ellipsis,) + sl])
        for t, sl in enumerate(_tap_slices(a, blocks))
    ]
    return chain(copy_in, *copies, copy_out)


def fold_infer(node, shapes, dtypes):
    x = shapes[0]
    a = node.attrs
    _check_geometry(a)
    size = tuple(a["output_size"])
    taps = math.prod(a["kernel"])
    if len(x) not in (2, 3) or x[-2] % taps:
        raise ValueError(f"fold: input {tuple(x)} must be (N, C * {taps}, L) or (C * {taps}, L)")
    blocks = _blocks(size, a)
    if min(blocks) < 1 or math.prod(blocks) != x[-1]:
        raise ValueError(
            f"fold: {x[-1]} blocks given, output_size {size} with kernel {a['kernel']} makes "
            f"{math.prod(blocks) if min(blocks) > 0 else 0}"
        )
    return [(tuple(x[:-2]) + (x[-2] // taps,) + size, dtypes[0])]


@register("fold", infer=fold_infer, attrs=FOLD_ATTRS, rows=True)
def make_fold(node, inputs, outputs, ctx):
    """Sums of each tap's rows into a strided view of a zero-padded output buffer, whose
    interior is then copied out."""
    x, out = inputs[0], outputs[0]
    a = node.attrs
    nd = len(a["kernel"])
    size = tuple(a["output_size"])
    blocks = _blocks(size, a)
    taps = math.prod(a["kernel"])
    c = x.shape[-2] // taps
    cols, copy_in, _ = _reshaped(x, x.shape[:-2] + (c, taps) + blocks)
    pads = a["pads"]
    padded = tuple(size[i] + pads[i] + pads[nd + i] for i in range(nd))
    buf = np.zeros(out.shape[:-nd] + padded, out.dtype) if any(pads) else out
    interior = buf[(Ellipsis,) + tuple(slice(pads[i], pads[i] + size[i]) for i in range(nd))]
    adds = [
        (buf[(Ellipsis,) + sl], cols[(Ellipsis, t) + (slice(None),) * nd])
        for t, sl in enumerate(_tap_slices(a, blocks))
    ]

    def run():
        if copy_in is not None:
            copy_in()
        buf.fill(0)
        for dst, src in adds:
            np.add(dst, src, out=dst)
        if buf is not out:
            np.copyto(out, interior)

    return run
