"""Sampling at coordinates given at run time.

`grid_sample`  input (N, C, *spatial) sampled at grid (N, *out_spatial, nd) (last axis x, y[, z]:
               the spatial dims in reverse) with attrs mode ("bilinear", "nearest", "bicubic"),
               padding_mode ("zeros", "border", "reflection"), align_corners. nd is 2 or 3
               (bicubic: 2). Every tap is one gather of a flat index per (n, output point),
               shared by all channels; taps outside the input weigh 0.
`affine_grid`  theta (N, nd, nd + 1) -> grid (N, *size[2:], nd); attrs size (N, C, *spatial),
               align_corners. The base grid is built once; a run is one batched matmul.

Coordinate rules follow ATen's GridSampler.h (grid_sampler_compute_source_index,
reflect_coordinates, bicubic taps bounded one by one) in float32 as torch computes them.
"""

import itertools
import math

import numpy as np

from pmx.runtime import blas
from pmx.runtime.errors import PmxInputError
from pmx.runtime.kernels.attr_specs import FLAG, INT, NUMBER, POSITIVE, ints, one_of, optional
from pmx.runtime.kernels.registry import register

F32 = np.float32
CUBIC_A = F32(-0.75)


def _unnormalize(g, size, align_corners):
    if align_corners:
        return (g + F32(1)) / F32(2) * F32(size - 1)
    return ((g + F32(1)) * F32(size) - F32(1)) / F32(2)


def _reflect(c, twice_low, twice_high):
    """ATen reflect_coordinates: fold c into [low, high] by mirroring."""
    if twice_low == twice_high:
        return np.zeros_like(c)
    lo = F32(twice_low / 2)
    span = F32((twice_high - twice_low) / 2)
    c = np.abs(c - lo)
    extra = np.fmod(c, span)
    flips = np.floor(c / span)
    return np.where(np.fmod(flips, 2) == 0, extra + lo, span - extra + lo).astype(F32)


def _pad_coordinates(c, size, padding_mode, align_corners):
    """ATen compute_coordinates: border clips, reflection mirrors then clips."""
    if padding_mode == "border":
        return np.clip(c, F32(0), F32(size - 1))
    if padding_mode == "reflection":
        if align_corners:
            c = _reflect(c, 0, 2 * (size - 1))
        else:
            c = _reflect(c, -1, 2 * size - 1)
        return np.clip(c, F32(0), F32(size - 1))
    return c


def _cubic_weights(t):
    """Cubic convolution coefficients (A = -0.75) for taps at -1, 0, 1, 2 from fraction t."""

    def near(x):
        return ((CUBIC_A + F32(2)) * x - (CUBIC_A + F32(3))) * x * x + F32(1)

    def far(x):
        return ((CUBIC_A * x - F32(5) * CUBIC_A) * x + F32(8) * CUBIC_A) * x - F32(4) * CUBIC_A

    return [far(t + F32(1)), near(t), near(F32(1) - t), far(F32(2) - t)]


def _axis_taps(c, size, mode, padding_mode, align_corners):
    """[(int64 index, float32 weight or None, bool valid), ...] along one spatial axis."""
    if mode == "bicubic":
        c = _unnormalize(c, size, align_corners)
        base = np.floor(c)
        ws = _cubic_weights((c - base).astype(F32))
        taps = []
        for k in range(4):
            # bicubic bounds each tap on its own: the padding rule maps tap positions
            pos = _pad_coordinates((base + F32(k - 1)).astype(F32), size, padding_mode, align_corners)
            idx = np.where(np.isfinite(pos), pos, -1).astype(np.int64)
            taps.append((idx, ws[k].astype(F32), (idx >= 0) & (idx < size)))
        return taps
    c = _pad_coordinates(_unnormalize(c, size, align_corners), size, padding_mode, align_corners)
    if mode == "nearest":
        r = np.rint(c)  # nearbyint: half to even, as ATen
        idx = np.where(np.isfinite(r), r, -1).astype(np.int64)
        return [(idx, None, (idx >= 0) & (idx < size))]
    lo = np.floor(c)
    frac = (c - lo).astype(F32)
    lo = np.where(np.isfinite(lo), lo, -2).astype(np.int64)
    return [(lo, F32(1) - frac, (lo >= 0) & (lo < size)), (lo + 1, frac, (lo + 1 >= 0) & (lo + 1 < size))]


def grid_sample_infer(node, shapes, dtypes):
    x, g = tuple(shapes[0]), tuple(shapes[1])
    nd = len(x) - 2
    if nd not in (2, 3) or len(g) != nd + 2 or g[-1] != nd or g[0] != x[0]:
        raise ValueError(f"grid_sample: input {x} and grid {g} must be (N, C, *{nd} dims) and (N, *out, {nd})")
    if node.attrs.get("mode") == "bicubic" and nd != 2:
        raise ValueError("grid_sample: bicubic needs a 4-d input")
    return [((x[0], x[1]) + g[1:-1], dtypes[0])]


@register(
    "grid_sample",
    infer=grid_sample_infer,
    attrs=dict(
        mode=one_of("bilinear", "nearest", "bicubic"),
        padding_mode=one_of("zeros", "border", "reflection"),
        align_corners=optional(FLAG),
    ),
    float_input=True,
    rows=True,
)
def make_grid_sample(node, inputs, outputs, ctx):
    x, grid, out = inputs[0], inputs[1], outputs[0]
    a = node.attrs
    mode, padding_mode, align = a["mode"], a["padding_mode"], bool(a.get("align_corners", False))
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    nd = len(spatial)
    points = math.prod(grid.shape[1:-1])
    flat_x = x.reshape(n, c, -1)
    flat_out = out.reshape(n, c, points)
    strides = [math.prod(spatial[i + 1 :]) for i in range(nd)]

    def run():
        g = grid.reshape(n, points, nd).astype(F32, copy=False)
        # grid's last axis lists x (the last spatial dim) first
        per_axis = [_axis_taps(g[..., nd - 1 - i], spatial[i], mode, padding_mode, align) for i in range(nd)]
        acc = np.zeros((n, c, points), F32)
        with np.errstate(invalid="ignore", over="ignore"):
            for combo in itertools.product(*per_axis):
                flat = np.zeros((n, points), np.int64)
                valid = np.ones((n, points), bool)
                weight = None
                for i, (idx, w, ok) in enumerate(combo):
                    flat += np.where(ok, idx, 0) * strides[i]
                    valid &= ok
                    if w is not None:
                        weight = w if weight is None else weight * w
                vals = np.take_along_axis(flat_x, flat[:, None, :], axis=2)
                w = valid.astype(F32) if weight is None else np.where(valid, weight, F32(0))
                # 0 * inf stays out of the sum: a tap outside the input adds nothing at all
                acc += np.where(valid[:, None, :], vals * w[:, None, :], F32(0))
        flat_out[...] = acc

    return run


def _base_coords(n, align_corners):
    """ATen linspace_from_neg_one in float32."""
    if n <= 1:
        return np.zeros(n, F32)
    r = np.linspace(-1, 1, n, dtype=F32)
    return r if align_corners else (r * F32(n - 1) / F32(n)).astype(F32)


def affine_grid_infer(node, shapes, dtypes):
    size = tuple(node.attrs["size"])
    nd = len(size) - 2
    t = tuple(shapes[0])
    if nd not in (2, 3) or t != (size[0], nd, nd + 1):
        raise ValueError(f"affine_grid: theta {t} must be ({size[0]}, {nd}, {nd + 1}) for size {size}")
    return [((size[0],) + size[2:] + (nd,), dtypes[0])]


@register(
    "affine_grid",
    infer=affine_grid_infer,
    attrs=dict(size=ints(min_length=4, max_length=5, lo=0), align_corners=optional(FLAG)),
    rows=True,
)
def make_affine_grid(node, inputs, outputs, ctx):
    theta, out = inputs[0], outputs[0]
    size = tuple(node.attrs["size"])
    align = bool(node.attrs.get("align_corners", False))
    spatial = size[2:]
    nd = len(spatial)
    # base[..., :nd] is (x, y[, z]) = the spatial dims reversed; the last column is 1
    axes = [_base_coords(s, align) for s in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")
    base = np.ones(spatial + (nd + 1,), F32)
    for i in range(nd):
        base[..., i] = mesh[nd - 1 - i]
    base = base.reshape(1, -1, nd + 1).astype(theta.dtype)
    target = out.reshape(size[0], -1, nd)
    return blas.matmul(base, theta.transpose(0, 2, 1), target)


# --- torchvision: roi_align, deform_conv ---------------------------------------------------
# `roi_align`    input (N, C, H, W), rois (K, 5) rows (batch index, x1, y1, x2, y2) -> (K, C, *output_size);
#                attrs output_size, spatial_scale, sampling_ratio (<= 0: ceil(roi size / bin) points per
#                bin), aligned. Each bin averages bilinear samples; a sample beyond one pixel outside the
#                input reads 0, one within it reads the nearest edge (torchvision's roi_align_kernel).
# `deform_conv`  inputs x (N, C, H, W), offset (N, 2 * G * kh * kw, Ho, Wo), weight (O, C / groups, kh, kw),
#                then mask (N, G * kh * kw, Ho, Wo) if attrs has_mask and bias (O,) if has_bias; attrs
#                stride, pads, dilation, groups. G (offset groups) = offset channels / (2 kh kw); each
#                group of C / G input channels samples at its own offsets (bilinear, zero outside).


def roi_align_infer(node, shapes, dtypes):
    x, r = tuple(shapes[0]), tuple(shapes[1])
    if len(x) != 4 or len(r) != 2 or r[1] != 5:
        raise ValueError(f"roi_align: input {x} and rois {r} must be (N, C, H, W) and (K, 5)")
    return [((r[0], x[1]) + tuple(node.attrs["output_size"]), dtypes[0])]


def _roi_bilinear(plane, y, x):
    """plane (C, H, W); y, x float64 arrays of one shape -> (C, *shape)."""
    h, w = plane.shape[1:]
    outside = (y < -1.0) | (y > h) | (x < -1.0) | (x > w)
    y, x = np.maximum(y, 0.0), np.maximum(x, 0.0)
    y0, x0 = np.minimum(y.astype(np.int64), h - 1), np.minimum(x.astype(np.int64), w - 1)
    y = np.where(y0 >= h - 1, y0.astype(np.float64), y)
    x = np.where(x0 >= w - 1, x0.astype(np.float64), x)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    ly, lx = y - y0, x - x0
    hy, hx = 1.0 - ly, 1.0 - lx
    val = (
        hy * hx * plane[:, y0, x0]
        + hy * lx * plane[:, y0, x1]
        + ly * hx * plane[:, y1, x0]
        + ly * lx * plane[:, y1, x1]
    )
    return np.where(outside, 0.0, val)


@register(
    "roi_align",
    infer=roi_align_infer,
    attrs=dict(output_size=ints(2, lo=1), spatial_scale=NUMBER, sampling_ratio=INT, aligned=FLAG),
    float_input=True,
)
def make_roi_align(node, inputs, outputs, ctx):
    x, rois, out = inputs[0], inputs[1], outputs[0]
    a = node.attrs
    ph, pw = a["output_size"]
    scale, ratio, aligned = float(a["spatial_scale"]), int(a["sampling_ratio"]), bool(a["aligned"])
    n = x.shape[0]

    def run():
        boxes = rois.astype(np.float64)
        shift = 0.5 if aligned else 0.0
        for k in range(boxes.shape[0]):
            b = int(boxes[k, 0])
            if not 0 <= b < n:
                raise PmxInputError(f"{node.name} (roi_align): roi {k} names batch {b}, the input has {n}")
            x1, y1, x2, y2 = boxes[k, 1:] * scale - shift
            rw, rh = x2 - x1, y2 - y1
            if not aligned:
                rw, rh = max(rw, 1.0), max(rh, 1.0)
            bh, bw = rh / ph, rw / pw
            gh = ratio if ratio > 0 else int(np.ceil(rh / ph))
            gw = ratio if ratio > 0 else int(np.ceil(rw / pw))
            count = max(gh * gw, 1)
            ys = y1 + np.arange(ph)[:, None] * bh + (np.arange(gh)[None, :] + 0.5) * bh / max(gh, 1)
            xs = x1 + np.arange(pw)[:, None] * bw + (np.arange(gw)[None, :] + 0.5) * bw / max(gw, 1)
            yy = np.broadcast_to(ys[:, :, None, None], (ph, gh, pw, gw))
            xx = np.broadcast_to(xs[None, None, :, :], (ph, gh, pw, gw))
            vals = _roi_bilinear(x[b].astype(np.float64), yy, xx)  # (C, ph, gh, pw, gw)
            out[k] = vals.sum(axis=(2, 4)) / count

    return run


def deform_conv_infer(node, shapes, dtypes):
    a = node.attrs
    x, off, w = tuple(shapes[0]), tuple(shapes[1]), tuple(shapes[2])
    if len(shapes) != 3 + bool(a.get("has_mask")) + bool(a.get("has_bias")):
        raise ValueError(f"{len(shapes)} inputs, but has_mask={a.get('has_mask')} and has_bias={a.get('has_bias')}")
    if len(x) != 4 or len(w) != 4 or x[1] != w[1] * a["groups"] or w[0] % a["groups"]:
        raise ValueError(f"input {x} and weight {w} do not fit {a['groups']} groups")
    kh, kw = w[2:]
    ho = (x[2] + 2 * a["pads"][0] - a["dilation"][0] * (kh - 1) - 1) // a["stride"][0] + 1
    wo = (x[3] + 2 * a["pads"][1] - a["dilation"][1] * (kw - 1) - 1) // a["stride"][1] + 1
    offset_groups = off[1] // (2 * kh * kw) if len(off) == 4 else 0
    if not offset_groups or off[1] % (2 * kh * kw) or x[1] % offset_groups or (off[0], *off[2:]) != (x[0], ho, wo):
        raise ValueError(f"deform_conv: offset {off} does not fit input {x} and weight {w}")
    if a.get("has_mask") and tuple(shapes[3]) != (x[0], offset_groups * kh * kw, ho, wo):
        raise ValueError(f"deform_conv: mask {tuple(shapes[3])} does not fit offset {off}")
    if a.get("has_bias") and tuple(shapes[-1]) != (w[0],):
        raise ValueError(f"deform_conv: bias {tuple(shapes[-1])} does not fit weight {w}")
    return [((x[0], w[0], ho, wo), dtypes[0])]


@register(
    "deform_conv",
    infer=deform_conv_infer,
    attrs=dict(
        stride=ints(2, lo=1),
        pads=ints(2, lo=0),
        dilation=ints(2, lo=1),
        groups=POSITIVE,
        has_mask=optional(FLAG),
        has_bias=optional(FLAG),
    ),
    float_input=True,
    rows=True,
)
def make_deform_conv(node, inputs, outputs, ctx):
    a = node.attrs
    x, offset, w, out = inputs[0], inputs[1], inputs[2], outputs[0]
    rest = list(inputs[3:])
    mask = rest.pop(0) if a.get("has_mask") else None
    bias = rest.pop(0) if a.get("has_bias") else None
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    ho, wo = out.shape[2:]
    k = kh * kw
    p = ho * wo
    groups = a["groups"]
    og = offset.shape[1] // (2 * k)
    sh, sw = a["stride"]
    pad_h, pad_w = a["pads"]
    dh, dw = a["dilation"]
    # base sampling positions per kernel tap and output pixel, (k, p)
    ki, kj = np.divmod(np.arange(k), kw)
    oy, ox = np.divmod(np.arange(p), wo)
    base_y = (oy * sh - pad_h)[None, :] + (ki * dh)[:, None]
    base_x = (ox * sw - pad_w)[None, :] + (kj * dw)[:, None]
    wmat = w.reshape(groups, o // groups, cg * k)
    flat_x = x.reshape(n, c, h * wd)
    cpg = c // og  # channels per offset group
    cols = np.empty((n, c, k, p), F32)  # every channel's columns are written each run
    res = np.empty((n, groups, o // groups, p), F32)
    multiply = blas.matmul(wmat[None], cols.reshape(n, groups, cg * k, p), res)

    def run():
        offs = offset.reshape(n, og, k, 2, p)
        for g in range(og):
            y = base_y + offs[:, g, :, 0, :]  # (n, k, p)
            xx = base_x + offs[:, g, :, 1, :]
            y0, x0 = np.floor(y), np.floor(xx)
            ly, lx = (y - y0).astype(F32), (xx - x0).astype(F32)
            y0, x0 = y0.astype(np.int64), x0.astype(np.int64)
            acc = np.zeros((n, cpg, k * p), F32)
            for yi, wy in ((y0, 1 - ly), (y0 + 1, ly)):
                for xi, wx in ((x0, 1 - lx), (x0 + 1, lx)):
                    ok = (yi >= 0) & (yi < h) & (xi >= 0) & (xi < wd)
                    idx = np.where(ok, yi * wd + xi, 0).reshape(n, 1, k * p)
                    vals = np.take_along_axis(flat_x[:, g * cpg : (g + 1) * cpg], idx, axis=2)
                    acc += vals * np.where(ok, wy * wx, F32(0)).reshape(n, 1, k * p)
            acc = acc.reshape(n, cpg, k, p)
            if mask is not None:
                acc *= mask.reshape(n, og, k, p)[:, g][:, None]
            cols[:, g * cpg : (g + 1) * cpg] = acc
        multiply()
        r = res.reshape(n, o, p)
        if bias is not None:
            r += bias.reshape(1, o, 1)
        out[...] = r.reshape(out.shape)

    return run
