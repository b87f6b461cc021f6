"""Resampling and padding: interpolate/upsample spellings -> resize (area -> adaptive
average pool), pixel_shuffle/unshuffle -> pixel_shuffle (one op, not reshape + transpose
+ reshape, so its shape rule follows any input size), F.pad and the nn.*PadNd modules
-> pad.

pnnx rewrites most F.interpolate calls to F.upsample / F.upsample_nearest (nn.Upsample
too), keeps F.interpolate when recompute_scale_factor is given, and turns the nn.*PadNd
modules into F.pad; the other spellings are accepted in case a version keeps them.
"""

import math

import numpy as np

from pmx.compiler.canon import data_input, fail, in_shape, make, out_shape, param, rule

MODES = {
    "nearest": "nearest",
    "nearest-exact": "nearest_exact",
    "linear": "linear",
    "bilinear": "linear",
    "trilinear": "linear",
    "bicubic": "cubic",
}
LINEAR_RANK = {"linear": 1, "bilinear": 2, "trilinear": 3, "bicubic": 2}


def _per_dim(node, key, value, nd, kind):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value,) * nd
    if (
        not isinstance(value, tuple)
        or len(value) not in (1, nd)
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        fail(node, f"{key}={value!r}: expected {nd} {kind}")
    return tuple(value) * (nd if len(value) == 1 else 1)


def _resize(node, ctx, mode, align_corners):
    x = data_input(node)
    shape = in_shape(node, x)
    out = out_shape(node)
    nd = len(shape) - 2
    if nd < 1 or len(out) != len(shape) or tuple(out[:2]) != tuple(shape[:2]):
        fail(node, f"cannot resize input {shape} to {out}: expected (N, C, *spatial) in and out")
    if param(node, "antialias", False):
        fail(node, "antialias=True is not supported")
    sizes = tuple(out[2:])
    if mode == "area":
        return [make(node, "adaptive_avg_pool", [x], dict(output_size=sizes))]
    if mode not in MODES:
        fail(node, f"mode={mode!r}: expected one of {', '.join(list(MODES) + ['area'])}")
    if mode in LINEAR_RANK and LINEAR_RANK[mode] != nd:
        fail(node, f"mode={mode!r} needs a {LINEAR_RANK[mode] + 2}-d input, got shape {shape}")
    size = param(node, "size", None)
    scale = param(node, "scale_factor", None)
    if size is not None and size != ():
        _per_dim(node, "size", size, nd, "ints")
        scales = (0.0,) * nd
        follow = (0.0,) * nd
    elif scale is not None and scale != ():
        # pnnx prints the float32 of the scale; its shortest decimal is usually the
        # double the model passed (0.7, not 0.699999988), which torch computes with
        given = _per_dim(node, "scale_factor", scale, nd, "numbers")
        scales = tuple(float(str(np.float32(s))) for s in given)
        if any(s <= 0 for s in scales):
            fail(node, f"scale_factor={scale!r} must be positive")
        # an output size that follows the input (for other input shapes) where it agrees
        # with what pnnx recorded
        follow = tuple(s if math.floor(n * s) == o else 0.0 for n, s, o in zip(shape[2:], scales, sizes))
        if param(node, "recompute_scale_factor", None) is True:
            scales = (0.0,) * nd  # torch maps coordinates by in/out then
    else:
        fail(node, "needs either size or scale_factor")
    if MODES[mode] in ("linear", "cubic"):
        if align_corners is None:
            align_corners = param(node, "align_corners", False)
        align = bool(align_corners)
    else:
        align = False
    attrs = dict(mode=MODES[mode], align_corners=align, sizes=sizes, scales=scales, scale_factor=follow)
    return [make(node, "resize", [x], attrs)]


@rule("F.interpolate", "F.upsample", "nn.Upsample")
def interpolate(node, ctx):
    return _resize(node, ctx, param(node, "mode", "nearest"), None)


@rule("F.upsample_nearest", "nn.UpsamplingNearest2d")
def upsample_nearest(node, ctx):
    return _resize(node, ctx, "nearest", False)


@rule("F.upsample_bilinear", "nn.UpsamplingBilinear2d")
def upsample_bilinear(node, ctx):
    return _resize(node, ctx, "bilinear", True)


def _factor(node, key):
    r = param(node, key)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        fail(node, f"{key}={r!r} must be a positive int")
    return r


@rule("F.pixel_shuffle", "nn.PixelShuffle", "torch.pixel_shuffle")
def pixel_shuffle(node, ctx):
    x = data_input(node)
    shape = in_shape(node, x)
    r = _factor(node, "upscale_factor")
    if len(shape) < 3 or shape[-3] % (r * r):
        fail(node, f"input {shape}: channels must be divisible by upscale_factor^2 = {r * r}")
    return [make(node, "pixel_shuffle", [x], dict(factor=r, inverse=False))]


@rule("F.pixel_unshuffle", "nn.PixelUnshuffle", "torch.pixel_unshuffle")
def pixel_unshuffle(node, ctx):
    x = data_input(node)
    shape = in_shape(node, x)
    r = _factor(node, "downscale_factor")
    if len(shape) < 3 or shape[-1] % r or shape[-2] % r:
        fail(node, f"input {shape}: height and width must be divisible by downscale_factor = {r}")
    return [make(node, "pixel_shuffle", [x], dict(factor=r, inverse=True))]


PAD_MODES = ("constant", "reflect", "replicate", "circular")


def _pad(node, ctx, torch_pad, mode, value):
    """torch_pad is F.pad's list: (last-dim begin, last-dim end, previous dim ...)."""
    x = data_input(node)
    shape = in_shape(node, x)
    if mode not in PAD_MODES:
        fail(node, f"mode={mode!r}: expected one of {', '.join(PAD_MODES)}")
    if (
        not isinstance(torch_pad, tuple)
        or len(torch_pad) % 2
        or not torch_pad
        or not all(isinstance(p, int) and not isinstance(p, bool) for p in torch_pad)
    ):
        fail(node, f"pad={torch_pad!r}: expected an even number of constant ints")
    nd = len(torch_pad) // 2
    if nd > len(shape):
        fail(node, f"pad={torch_pad!r} pads {nd} dims of a rank-{len(shape)} input")
    begins = tuple(torch_pad[2 * (nd - 1 - i)] for i in range(nd))
    ends = tuple(torch_pad[2 * (nd - 1 - i) + 1] for i in range(nd))
    sizes = shape[len(shape) - nd :]
    for n, b, e in zip(sizes, begins, ends):
        if n + min(b, 0) + min(e, 0) <= 0 and (b > 0 or e > 0) and mode == "circular":
            fail(node, f"pad={torch_pad!r} crops a dim of size {n} away before padding it")
        if mode == "reflect" and (b >= n or e >= n):
            fail(node, f"reflect padding {torch_pad!r} must be smaller than the padded dims {sizes}")
        if mode == "circular" and max(b, e) > n + min(b, 0) + min(e, 0):
            fail(node, f"circular padding {torch_pad!r} wraps around more than once for dims {sizes}")
    if value is None:
        value = 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        fail(node, f"value={value!r} must be a constant number")
    attrs = dict(pads=begins + ends, mode=mode, value=float(value))
    return [make(node, "pad", [x], attrs)]


@rule("F.pad")
def pad(node, ctx):
    mode, value = param(node, "mode", "constant"), param(node, "value", 0.0)
    return _pad(node, ctx, param(node, "pad"), mode, value)


def _pad_module(mode, nd):
    def fn(node, ctx):
        p = param(node, "padding")
        if isinstance(p, int) and not isinstance(p, bool):
            p = (p,) * (2 * nd)
        if isinstance(p, tuple) and len(p) == 1:
            p = p * (2 * nd)
        value = param(node, "value", 0.0) if mode == "constant" else 0.0
        return _pad(node, ctx, p, mode, value)

    return fn


for _nd in (1, 2, 3):
    rule(f"nn.ZeroPad{_nd}d")(_pad_module("constant", _nd))
    rule(f"nn.ConstantPad{_nd}d")(_pad_module("constant", _nd))
    rule(f"nn.ReflectionPad{_nd}d")(_pad_module("reflect", _nd))
    rule(f"nn.ReplicationPad{_nd}d")(_pad_module("replicate", _nd))
    rule(f"nn.CircularPad{_nd}d")(_pad_module("circular", _nd))
