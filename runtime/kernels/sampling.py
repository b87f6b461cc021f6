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

from pmx.runtime.kernels import register

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
    return [(lo, F32(1) - frac, (lo >= 0) & (lo < size)),
            (lo + 1, frac, (lo + 1 >= 0) & (lo + 1 < size))]


def grid_sample_infer(node, shapes, dtypes):
    x, g = tuple(shapes[0]), tuple(shapes[1])
    nd = len(x) - 2
    if nd not in (2, 3) or len(g) != nd + 2 or g[-1] != nd or g[0] != x[0]:
        raise ValueError(f"grid_sample: input {x} and grid {g} must be (N, C, *{nd} dims) and "
                         f"(N, *out, {nd})")
    if node.attrs.get("mode") == "bicubic" and nd != 2:
        raise ValueError("grid_sample: bicubic needs a 4-d input")
    return [((x[0], x[1]) + g[1:-1], dtypes[0])]


@register("grid_sample", infer=grid_sample_infer)
def make_grid_sample(node, inputs, outputs):
    x, grid, out = inputs[0], inputs[1], outputs[0]
    a = node.attrs
    mode, padding_mode, align = a["mode"], a["padding_mode"], bool(a.get("align_corners", False))
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    nd = len(spatial)
    points = math.prod(grid.shape[1:-1])
    flat_x = x.reshape(n, c, -1)
    flat_out = out.reshape(n, c, points)
    strides = [math.prod(spatial[i + 1:]) for i in range(nd)]

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


@register("affine_grid", infer=affine_grid_infer)
def make_affine_grid(node, inputs, outputs):
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

    def run():
        np.matmul(base, theta.transpose(0, 2, 1), out=target)

    return run
