"""Convolution (1-d, 2-d, 3-d; any groups, dilation, padding mode).

Canonical op `conv`: inputs (x, weight[Cout, Cin/groups, *k], bias[Cout]?),
attrs stride, pads (begins then ends per spatial dim), dilation, groups, padding_mode
("zeros", "reflect", "replicate", "circular"). node.expr is an optional fused activation.

Lowerings (node.variant, chosen by the compiler; "" lets the kernel pick):
  gemm      im2col copy built from one strided view of the padded input, then one
            batched GEMM per conv (1x1 stride-1 convs skip im2col entirely)
  depthwise per-tap multiply-add over strided views (groups == Cin == Cout)
"""

import numpy as np

from pmx.runtime.kernels import register
from pmx.runtime.kernels.common import (
    chain,
    conv_out_size,
    epilogue,
    fill_border,
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
    mode = a.get("padding_mode", "zeros")
    buf, interior = padded_buffer(x.shape, pads, x.dtype, 0)
    copy_in = lambda: np.copyto(interior, x)  # noqa: E731
    if mode == "zeros":
        return copy_in, buf
    return chain(copy_in, fill_border(buf, pads, x.shape[-nd:], mode)), buf


def _windows(xp, k, stride, dilation, out_spatial, groups):
    """Strided view (N, G, Cg, *k, *out) of the padded input: no copy."""
    n, c = xp.shape[:2]
    nd = len(k)
    s = xp.strides
    cg = c // groups
    shape = (n, groups, cg) + tuple(k) + tuple(out_spatial)
    strides = (s[0], cg * s[1], s[1]) + tuple(dilation[i] * s[2 + i] for i in range(nd)) + tuple(
        stride[i] * s[2 + i] for i in range(nd))
    return np.lib.stride_tricks.as_strided(xp, shape, strides, writeable=False)


@register("conv", infer=conv_infer)
def make_conv(node, inputs, outputs):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    a = node.attrs
    nd = w.ndim - 2
    groups = int(a.get("groups", 1))
    k = w.shape[2:]
    cout, cg = w.shape[0], w.shape[1]
    out_spatial = out.shape[2:]
    pad_step, xp = _padded_input(x, a, nd)
    variant = node.variant or ("depthwise" if groups > 1 and cg == 1 and cout == groups else "gemm")
    if variant == "depthwise" and not (cg == 1 and cout == groups):
        variant = "gemm"
    if variant == "depthwise":
        core = _depthwise(xp, w, out, a, k)
    else:
        core = _gemm(x, xp, w, out, a, k, groups, pad_step is None)
    bias_step = None
    if b is not None:
        bview = b.reshape((1, cout) + (1,) * nd)
        bias_step = lambda: np.add(out, bview, out=out)  # noqa: E731
    return chain(pad_step, core, bias_step, epilogue(node, out))


def _gemm(x, xp, w, out, a, k, groups, unpadded):
    n = x.shape[0]
    cout, cg = w.shape[0], w.shape[1]
    kk = int(np.prod(k))
    o = int(np.prod(out.shape[2:]))
    wg = view_as(w, (groups, cout // groups, cg * kk)) if w.flags.c_contiguous else w.reshape(groups, cout // groups, cg * kk)
    out_g = view_as(out, (n, groups, cout // groups, o))
    pointwise = all(v == 1 for v in k) and all(s == 1 for s in a["stride"]) and unpadded
    if pointwise and x.flags.c_contiguous:
        cols = view_as(x, (n, groups, cg, o))
        return lambda: np.matmul(wg, cols, out=out_g)
    windows = _windows(xp, k, a["stride"], a["dilation"], out.shape[2:], groups)
    cols = np.empty(windows.shape, dtype=x.dtype)
    cols_2d = view_as(cols, (n, groups, cg * kk, o))

    def run():
        np.copyto(cols, windows)
        np.matmul(wg, cols_2d, out=out_g)

    return run


def _depthwise(xp, w, out, a, k):
    nd = len(k)
    c = w.shape[0]
    stride, dilation = a["stride"], a["dilation"]
    taps = []
    for tap in np.ndindex(*k):
        sl = tuple(
            slice(tap[i] * dilation[i], tap[i] * dilation[i] + (out.shape[2 + i] - 1) * stride[i] + 1, stride[i])
            for i in range(nd))
        wv = w[(slice(None), 0) + tap].reshape((c,) + (1,) * nd)
        taps.append((xp[(Ellipsis,) + sl], wv))
    tmp = np.empty(out.shape, out.dtype)
    (x0, w0), rest = taps[0], taps[1:]

    def run():
        np.multiply(x0, w0, out=out)
        for xv, wv in rest:
            np.multiply(xv, wv, out=tmp)
            np.add(out, tmp, out=out)

    return run
