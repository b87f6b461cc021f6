"""Convolution (1-d, 2-d, 3-d; any groups, dilation, padding mode).

Canonical op `conv`: inputs (x, weight[Cout, Cin/groups, *k], bias[Cout]?),
attrs stride, pads (begins then ends per spatial dim), dilation, groups, padding_mode
("zeros", "reflect", "replicate", "circular"). node.expr is an optional fused activation.

Lowerings (node.variant, chosen by the compiler; "" lets the kernel pick):
  gemm      per image: the im2col copy, made by one np.copyto from a strided view of the
            padded input into shared scratch (split over the cores when large), then one
            GEMM per group; bias and activation follow on the image's output while it is
            still in cache. 1x1 stride-1 unpadded convs are a plain GEMM on the input.
  depthwise (groups == Cin == Cout) per-tap multiply-add over "flat" views: the padded
            input is stored split into stride phases (one phase when stride is 1), each
            flattened per channel, so every tap is one contiguous slice at a fixed offset
            and each ufunc call runs over a whole channel instead of one output row. The
            output is computed "wide" (rows as long as the phase rows, the extra columns
            discarded when it is copied out with the bias). Channels are split over the
            cores. Measured on MobileNetV2's shapes (tools/bench_conv.py): 1.6-2.5x faster
            than per-tap strided views on one core, 2.6-4x on two.
"""

import functools
import math

import numpy as np

from pmx.runtime import parallel
from pmx.runtime.kernels import register, scratch_array, scratch_nbytes
from pmx.runtime.kernels.common import (
    GEMM_SPLIT_MIN_MACS,
    SINGLE_THREAD,
    chain,
    conv_out_size,
    epilogue,
    fill_border,
    gemm,
    gemm_post,
    node_threads,
    padded_buffer,
    view_as,
)


def conv_infer(node, shapes, dtypes):
    x, w = shapes[0], shapes[1]
    a = node.attrs
    nd = len(w) - 2
    if len(x) != nd + 2 or x[1] != w[1] * a.get("groups", 1):
        raise ValueError(f"input {tuple(x)} does not have the {w[1] * a.get('groups', 1)} channels weight {tuple(w)} expects")
    spatial = tuple(
        conv_out_size(x[2 + i], w[2 + i], a["stride"][i], a["dilation"][i], a["pads"][i], a["pads"][nd + i])
        for i in range(nd)
    )
    return [((x[0], w[0]) + spatial, dtypes[0])]


def _padded_input(x, a, nd):
    """(callable that refreshes the padded copy or None, padded array)."""
    pads = tuple(a["pads"])
    if not any(pads):
        return None, x
    buf, interior = padded_buffer(x.shape, pads, x.dtype, 0)
    return chain(lambda: np.copyto(interior, x), _border_step(buf, a, x.shape[-nd:])), buf


def _border_step(buf, a, sizes):
    """Refills the padding of `buf` for non-zero padding modes (zeros stay from np.zeros)."""
    mode = a.get("padding_mode", "zeros")
    return None if mode == "zeros" else fill_border(buf, tuple(a["pads"]), sizes, mode)


def _windows(xp, k, stride, dilation, out_spatial, groups):
    """Strided view (G, Cg, *k, *out) of one padded image: no copy."""
    c = xp.shape[0]
    nd = len(k)
    s = xp.strides
    cg = c // groups
    shape = (groups, cg) + tuple(k) + tuple(out_spatial)
    strides = (cg * s[0], s[0]) + tuple(dilation[i] * s[1 + i] for i in range(nd)) + tuple(
        stride[i] * s[1 + i] for i in range(nd))
    return np.lib.stride_tricks.as_strided(xp, shape, strides, writeable=False)


def _is_depthwise(w_shape, groups):
    return groups > 1 and w_shape[1] == 1 and w_shape[0] == groups


def variants(node, w_shape):
    """The lowerings `pmx compile --tune` times for a conv with this weight shape."""
    groups = int(node.attrs.get("groups", 1))
    base = ["gemm", "depthwise"] if _is_depthwise(w_shape, groups) else ["gemm"]
    return [v + suffix for v in base for suffix in ("", SINGLE_THREAD)]


def _variant(node, w):
    """The lowering to use: the stored one when it applies (an unknown or inapplicable
    variant falls back to the rule, so any file runs), else depthwise for groups ==
    channels."""
    lowering = node.variant[:-len(SINGLE_THREAD)] if node.variant.endswith(SINGLE_THREAD) else node.variant
    depthwise = _is_depthwise(w.shape, int(node.attrs.get("groups", 1)))
    if lowering == "gemm" or (lowering == "depthwise" and depthwise):
        return lowering
    return "depthwise" if depthwise else "gemm"


def _is_pointwise(x, w, a):
    return (all(v == 1 for v in w.shape[2:]) and all(s == 1 for s in a["stride"]) and not any(a["pads"])
            and x.flags.c_contiguous)


def conv_scratch(node, inputs, outputs):
    x, w, out = inputs[0], inputs[1], outputs[0]
    if _variant(node, w) == "depthwise":
        return scratch_nbytes(*_depthwise_scratch(_Phases.of(x, w, out, node.attrs), out.dtype))
    if _is_pointwise(x, w, node.attrs):
        return 0
    return scratch_nbytes((_cols_shape(x, w, out), x.dtype))


@register("conv", infer=conv_infer, scratch=conv_scratch)
def make_conv(node, inputs, outputs):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    if _variant(node, w) == "depthwise":
        return _depthwise(node, x, w, b, out)
    return _gemm(node, x, w, b, out)


# --- gemm ----------------------------------------------------------------------------


def _cols_shape(x, w, out):
    groups = x.shape[1] // w.shape[1]
    kk = int(np.prod(w.shape[2:]))
    return (groups, w.shape[1] * kk, int(np.prod(out.shape[2:])))


def _gemm(node, x, w, b, out):
    a = node.attrs
    n, nd = x.shape[0], w.ndim - 2
    groups = x.shape[1] // w.shape[1]
    cout, cg = w.shape[0], w.shape[1]
    k = w.shape[2:]
    o = int(np.prod(out.shape[2:]))
    threads = node_threads(node)
    wg = view_as(w, (groups, cout // groups, -1)) if w.flags.c_contiguous else w.reshape(groups, cout // groups, -1)
    out_g = view_as(out, (n, groups, cout // groups, o))
    # one group: plain 2-D GEMMs, which gemm() may also split by rows
    squeeze = (lambda t: t[0]) if groups == 1 else (lambda t: t)  # noqa: E731
    post = gemm_post(node, None if b is None else b.reshape(squeeze(out_g[0]).shape[:-1] + (1,)))
    if _is_pointwise(x, w, a):
        x_g = view_as(x, (n, groups, cg, o))
        return chain(*(gemm(squeeze(wg), squeeze(x_g[i]), squeeze(out_g[i]), threads, post)
                       for i in range(n)))
    pad_step, xp = _padded_input(x, a, nd)
    cols = scratch_array(_cols_shape(x, w, out), x.dtype)
    cols_windows = view_as(cols, (groups, cg) + tuple(k) + tuple(out.shape[2:]))
    macs = cout * cg * int(np.prod(k)) * o
    bands = parallel.ranges(out.shape[2], threads if macs >= GEMM_SPLIT_MIN_MACS else 1)
    row = o // out.shape[2]  # output positions per row of the first spatial axis
    steps = [pad_step]
    for i in range(n):
        windows = _windows(xp[i], k, a["stride"], a["dilation"], out.shape[2:], groups)
        first_axis = (slice(None),) * (2 + nd)  # (G, Cg, *k) come before the output rows
        steps.append(parallel.split([
            _im2col_gemm(cols_windows[first_axis + (slice(lo, hi),)], windows[first_axis + (slice(lo, hi),)],
                         squeeze(wg), squeeze(cols[..., lo * row:hi * row]), squeeze(out_g[i][..., lo * row:hi * row]),
                         post) for lo, hi in bands]))
    return chain(*steps)


def _im2col_gemm(cols_windows, windows, w, cols, out, post):
    """One band of output rows: its im2col columns, their GEMM, then bias and activation.
    Bands are independent, so a conv is one dispatch to the threads, not three."""
    im2col_then_gemm = lambda: (np.copyto(cols_windows, windows), np.matmul(w, cols, out=out))  # noqa: E731
    return chain(im2col_then_gemm, post(out, None) if post is not None else None)


# --- depthwise -----------------------------------------------------------------------


class _Phases:
    """Geometry of the phase-split padded input (see the module docstring).

    For stride s and dilation d along a dim, tap t reads padded rows t*d + s*y: phase
    (t*d) % s at phase row (t*d)//s + y. Each phase holds ceil(P/s) rows of the padded
    size P. Per channel, all phases lie one after another, each flattened, followed by
    a margin so the last tap's slice of the wide output stays inside the buffer.
    Built once per shape (scratch sizing and make() both ask)."""

    @classmethod
    def of(cls, x, w, out, a):
        return _phases_cached(x.shape, w.shape, out.shape, tuple(a["stride"]), tuple(a["dilation"]), tuple(a["pads"]))

    def __init__(self, x_shape, w_shape, out_shape, stride, dilation, pads):
        nd = len(w_shape) - 2
        self.n, self.c = x_shape[:2]
        self.k = tuple(w_shape[2:])
        self.stride, self.dilation, self.pads = stride, dilation, pads
        self.in_spatial, self.out_spatial = tuple(x_shape[2:]), tuple(out_shape[2:])
        self.padded = tuple(self.in_spatial[i] + pads[i] + pads[nd + i] for i in range(nd))
        self.rows = tuple(-(-self.padded[i] // stride[i]) for i in range(nd))  # per phase
        self.phase_size = math.prod(self.rows)
        row_strides = tuple(math.prod(self.rows[i + 1:]) for i in range(nd))
        self.wide = self.out_spatial[:1] + self.rows[1:]
        self.length = math.prod(self.wide)  # wide output elements per channel
        self.phases = list(np.ndindex(*stride))
        self.taps = []  # flat offset of each kernel tap's slice in a channel's buffer
        for tap in np.ndindex(*self.k):
            r = tuple(tap[i] * dilation[i] for i in range(nd))
            phase = self.phases.index(tuple(r[i] % stride[i] for i in range(nd)))
            offset = sum((r[i] // stride[i]) * row_strides[i] for i in range(nd))
            self.taps.append(phase * self.phase_size + offset)
        stored = len(self.phases) * self.phase_size
        self.per_channel = stored + max(0, max(self.taps) + self.length - stored)


_phases_cached = functools.lru_cache(maxsize=256)(_Phases)


def _depthwise_scratch(g, dtype):
    return [((g.n, g.c, g.length), dtype)] * 2  # wide output, product of one tap


def _depthwise(node, x, w, b, out):
    a = node.attrs
    g = _Phases.of(x, w, out, a)
    # persistent (not scratch): the padding and margin must stay zero between runs
    buf = np.zeros((g.n, g.c, g.per_channel), x.dtype)
    wide, prod = (scratch_array(shape, dtype) for shape, dtype in _depthwise_scratch(g, out.dtype))
    weights = w.reshape(g.c, -1)
    taps = g.taps
    valid = (slice(None), slice(None), slice(None)) + tuple(slice(0, o) for o in g.out_spatial[1:])
    wide_valid = view_as(wide, (g.n, g.c) + g.wide)[valid]
    fill = _phase_fill(x, buf, g, a)
    parts = []
    threads = node_threads(node) if parallel.worth_splitting(out.size * len(taps)) else 1
    for lo, hi in parallel.ranges(g.c, threads):
        ch = slice(lo, hi)
        tap_views = [buf[:, ch, t:t + g.length] for t in taps]
        tap_weights = [np.ascontiguousarray(weights[ch, j]).reshape(-1, 1) for j in range(len(taps))]
        parts.append(chain(
            fill(ch),
            _tap_sum(tap_views, tap_weights, wide[:, ch], prod[:, ch]),
            _copy_out(wide_valid[:, ch], out[:, ch], b[ch] if b is not None else None),
            epilogue(node, out[:, ch], threads=1)))
    return parallel.split(parts)


def _tap_sum(views, weights, acc, tmp):
    (x0, w0), rest = (views[0], weights[0]), list(zip(views[1:], weights[1:]))

    def run():
        np.multiply(x0, w0, out=acc)
        for xv, wv in rest:
            np.multiply(xv, wv, out=tmp)
            np.add(acc, tmp, out=acc)

    return run


def _copy_out(wide_valid, out, b):
    if b is None:
        return lambda: np.copyto(out, wide_valid)
    bview = b.reshape((-1,) + (1,) * (out.ndim - 2))
    return lambda: np.add(wide_valid, bview, out=out)


def _phase_fill(x, buf, g, a):
    """fill(channel slice) -> callable copying the input into the phase buffers. With
    zero padding each phase takes its rows straight from x; other padding modes build
    the padded input first (one per-node buffer) and split that."""
    nd = len(g.k)
    phase_views = [view_as(buf[:, :, p * g.phase_size:(p + 1) * g.phase_size], (g.n, g.c) + g.rows)
                   for p in range(len(g.phases))]
    if a.get("padding_mode", "zeros") == "zeros":
        src, begins = x, g.pads[:nd]
    else:
        padded, interior = padded_buffer(x.shape, g.pads, x.dtype, 0)
        border = _border_step(padded, a, g.in_spatial)
        src, begins = padded, (0,) * nd
    pairs = []
    for phase, dst in zip(g.phases, phase_views):
        d_idx, s_idx = [], []
        for i in range(nd):
            # padded row p = phase + stride*q lies in src at p - begin; keep q whose row exists
            r, s, begin, size = phase[i], g.stride[i], begins[i], src.shape[2 + i]
            q0 = max(0, -(-(begin - r) // s))
            q1 = min(g.rows[i], (begin + size - 1 - r) // s + 1)
            d_idx.append(slice(q0, max(q0, q1)))
            s_idx.append(slice(r + s * q0 - begin, r + s * max(q0, q1) - begin, s) if q1 > q0 else slice(0, 0))
        pairs.append((dst, tuple(d_idx), tuple(s_idx)))

    def fill(ch):
        copies = [(dst[(slice(None), ch) + di], src[(slice(None), ch) + si]) for dst, di, si in pairs]
        steps = [lambda d=d, s=s: np.copyto(d, s) for d, s in copies]
        if src is not x:
            interior_ch, x_ch = interior[:, ch], x[:, ch]
            steps = [lambda: np.copyto(interior_ch, x_ch), border_ch(ch)] + steps
        return chain(*steps)

    def border_ch(ch):
        return None if border is None else fill_border(padded[:, ch], g.pads, g.in_spatial, a["padding_mode"])

    return fill
