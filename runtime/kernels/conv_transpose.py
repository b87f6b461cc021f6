"""Transposed convolution (1-d, 2-d, 3-d; groups, dilation, output_padding).

Canonical op `conv_transpose`: inputs (x, weight[Cin, Cout/groups, *k], bias[Cout]?),
attrs stride, pads (begins then ends per spatial dim), output_padding, dilation, groups.
node.expr is an optional fused activation.

One batched GEMM gives every (output channel, tap, input pixel) product; col2im then adds
each tap's slab into a strided view of the output (a loop over kernel taps, not pixels),
or writes it when the taps tile the output without overlap.
Taps whose positions fall into the cropped padding are clipped to the output window in
the factory, so no padded scratch output is needed.
"""

import math

import numpy as np

from pmx.runtime import blas, parallel
from pmx.runtime.kernels.attr_specs import POSITIVE, ints, optional, twice, weight_spatial
from pmx.runtime.kernels.bind import scratch_nbytes
from pmx.runtime.kernels.common import chain, expect_operand, split_activated, split_threads, view_as
from pmx.runtime.kernels.registry import register

CONV_TRANSPOSE_ATTRS = dict(
    stride=ints(weight_spatial, lo=1),
    pads=ints(twice(weight_spatial), lo=0),
    output_padding=ints(weight_spatial, lo=0),
    dilation=ints(weight_spatial, lo=1),
    groups=optional(POSITIVE),
)


def conv_transpose_out_size(n, k, s, d, pb, pe, op):
    return (n - 1) * s - pb - pe + d * (k - 1) + op + 1


def conv_transpose_infer(node, shapes, dtypes):
    x, w = shapes[0], shapes[1]
    a = node.attrs
    nd = len(w) - 2
    groups = int(a.get("groups", 1))
    if len(x) != nd + 2 or x[1] != w[0] or x[1] % groups:
        raise ValueError(f"input {tuple(x)} does not match weight {tuple(w)} in {groups} groups")
    expect_operand(shapes, dtypes, 1, "weight", dtype=dtypes[0])
    expect_operand(shapes, dtypes, 2, "bias", shape=(w[1] * groups,), dtype=dtypes[0], optional=True)
    spatial = tuple(
        conv_transpose_out_size(
            x[2 + i],
            w[2 + i],
            a["stride"][i],
            a["dilation"][i],
            a["pads"][i],
            a["pads"][nd + i],
            a["output_padding"][i],
        )
        for i in range(nd)
    )
    return [((x[0], w[1] * groups) + spatial, dtypes[0])]


def _tap_range(t, d, s, pb, n_in, n_out):
    """Input indices [lo, hi] whose product for tap t lands inside the output window, and
    the output index the first of them lands on; None when none do."""
    off = t * d - pb  # output position of input index 0
    lo = max(0, -(off // s))  # ceil(-off / s)
    hi = min(n_in - 1, (n_out - 1 - off) // s)
    if lo > hi:
        return None
    return lo, hi, off + lo * s


def _cols_shape(x, w, groups):
    """(N, G, Cout_g * taps, input pixels): every (output channel, tap, pixel) product."""
    return (x.shape[0], groups, w.shape[1] * math.prod(w.shape[2:]), math.prod(x.shape[2:]))


def conv_transpose_scratch(node, inputs, outputs, ctx):
    return scratch_nbytes((_cols_shape(inputs[0], inputs[1], int(node.attrs.get("groups", 1))), outputs[0].dtype))


@register(
    "conv_transpose",
    infer=conv_transpose_infer,
    scratch=conv_transpose_scratch,
    attrs=CONV_TRANSPOSE_ATTRS,
    float_input=True,
    rows=True,
)
def make_conv_transpose(node, inputs, outputs, ctx):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    a = node.attrs
    nd = w.ndim - 2
    groups = int(a.get("groups", 1))
    stride, dilation, pads = a["stride"], a["dilation"], a["pads"]
    n, cin = x.shape[:2]
    cin_g, cout_g = cin // groups, w.shape[1]
    cout = cout_g * groups
    k = w.shape[2:]
    kk = math.prod(k)
    in_sp, out_sp = x.shape[2:], out.shape[2:]
    length = math.prod(in_sp)
    # strided operands (an input given as a transposed view) go through contiguous copies
    w_c, copy_w = _contiguous(w)
    x_c, copy_x = _contiguous(x)
    # (G, Cout_g * kk, Cin_g): a transposed view of the weight; BLAS takes it as is
    wt = view_as(w_c, (groups, cin_g, cout_g * kk)).transpose(0, 2, 1)
    xg = view_as(x_c, (n, groups, cin_g, length))

    cols = ctx.scratch_array(_cols_shape(x, w, groups), out.dtype)
    cols_taps = view_as(cols, (n, cout) + tuple(k) + tuple(in_sp))
    adds = []
    coverage = np.zeros(out_sp, np.int64)
    for tap in np.ndindex(*k):
        src, dst = [], []
        for i in range(nd):
            r = _tap_range(tap[i], dilation[i], stride[i], pads[i], in_sp[i], out_sp[i])
            if r is None:
                break
            lo, hi, start = r
            src.append(slice(lo, hi + 1))
            dst.append(slice(start, start + (hi - lo) * stride[i] + 1, stride[i]))
        else:
            adds.append(((slice(None), slice(None)) + tuple(dst), (slice(None), slice(None)) + tap + tuple(src)))
            coverage[tuple(dst)] += 1
    bias = b.reshape((1, cout) + (1,) * nd) if b is not None else None
    # taps that tile the output exactly once (kernel == stride, no padding: the usual
    # 2x2/2 up-convolution) are written, not accumulated, so out needs no zero fill
    tiled = bool(np.all(coverage == 1))
    # one group: each thread takes a range of output channels, its rows of the GEMM and
    # its part of col2im (where BLAS runs on one thread: ctx.gemm_threads)
    threads = min(split_threads(ctx, node, cols.size), ctx.gemm_threads) if groups == 1 else 1
    parts = []
    for c0, c1 in parallel.ranges(cout, threads):
        ch = slice(c0, c1)
        pairs = [(out[o][:, ch], cols_taps[c][:, ch]) for o, c in adds]
        rows = slice(c0 * kk, c1 * kk) if groups == 1 else slice(None)
        multiply = blas.matmul(wt[:, rows], xg, cols[:, :, rows])
        parts.append((_part(multiply, pairs, None if bias is None else bias[:, ch], out[:, ch], tiled), out[:, ch]))
    return chain(copy_w, copy_x, split_activated(ctx, node, out, parts))


def _contiguous(a):
    """(a C-contiguous array with a's values, the callable refreshing it per run or None)."""
    if a.flags.c_contiguous:
        return a, None
    buffer = np.empty(a.shape, a.dtype)
    return buffer, lambda: np.copyto(buffer, a)


def _part(multiply, pairs, bias, out, tiled):
    """Callable for one range of output channels: its GEMM rows into cols, then col2im
    (written where the taps tile the output, else accumulated onto the bias or zeros)."""

    def run():
        multiply()
        if tiled:
            for o, c in pairs:
                if bias is None:
                    np.copyto(o, c)
                else:
                    np.add(c, bias, out=o)
            return
        if bias is None:
            out.fill(0)
        else:
            np.copyto(out, bias)
        for o, c in pairs:
            np.add(o, c, out=o)

    return run
