"""Normalization.

`batch_norm`: inputs (x, scale[C], shift[C]) with scale = gamma / sqrt(var + eps) and
shift = beta - mean * scale precomputed by the compiler; channel axis 1. Also serves
InstanceNorm with tracked running statistics (eval mode uses them, as batch norm does).
`layer_norm`: inputs (x, weight?, bias?); attrs axes (how many trailing dims are
normalized), eps, rms (1: RMSNorm, no mean subtraction). weight/bias have the shape of
those trailing dims.
`group_norm`: inputs (x[N, C, ...], weight[C]?, bias[C]?); attrs groups, eps. InstanceNorm
without running statistics is group_norm with groups 0: one group per channel, however many.
`lp_normalize`: inputs (x); attrs axis, p, eps: x / max(||x||_p, eps) (F.normalize).

Statistics are two-pass (mean, then mean of squared deviations), each row mean a
reduce.reduction: a GEMV with a vector of ones, rows over 4096 long cut into chunks whose
sums are added pairwise, then one divide; that keeps float32 within torch's Welford
results for long rows. np.mean had paid numpy's reduction loop per short row, and the
GEMVs for both statistics measured faster on whole normalizations of ConvNeXt-tiny's and
ViT-B/16's layer norms, one thread, at comparable error against float64
(docs/performance.md, "Kernel measurements").
"""

import math

import numpy as np

from pmx.runtime import parallel
from pmx.runtime.kernels.attr_specs import AXIS, FLAG, NON_NEGATIVE, NUMBER, input_rank, integer, optional
from pmx.runtime.kernels.common import chain, expect_operand, split_threads, view_as
from pmx.runtime.kernels.reduce import reduction
from pmx.runtime.kernels.registry import register, rows_off_axis, version_with


def same_as_input(node, shapes, dtypes):
    return [(tuple(shapes[0]), dtypes[0])]


def batch_norm_infer(node, shapes, dtypes):
    x = tuple(shapes[0])
    if len(x) < 2:
        raise ValueError(f"input {x} has no channels axis (axis 1)")
    expect_operand(shapes, dtypes, 1, "scale", shape=(x[1],), dtype=dtypes[0])
    expect_operand(shapes, dtypes, 2, "shift", shape=(x[1],), dtype=dtypes[0])
    return [(x, dtypes[0])]


def _affine_operands(shapes, dtypes, shape):
    """The optional weight (input 1) and bias (input 2) of a normalization: `shape`, and
    the input's dtype."""
    expect_operand(shapes, dtypes, 1, "weight", shape=shape, dtype=dtypes[0], optional=True)
    expect_operand(shapes, dtypes, 2, "bias", shape=shape, dtype=dtypes[0], optional=True)


def layer_norm_infer(node, shapes, dtypes):
    x = tuple(shapes[0])
    _affine_operands(shapes, dtypes, x[len(x) - int(node.attrs["axes"]) :])
    return [(x, dtypes[0])]


@register("batch_norm", infer=batch_norm_infer, inplace=True, float_input=True, rows=True)
def make_batch_norm(node, inputs, outputs, ctx):
    x, scale, shift = inputs
    out = outputs[0]
    bshape = (1, scale.shape[0]) + (1,) * (x.ndim - 2)
    s, t = scale.reshape(bshape), shift.reshape(bshape)

    def run():
        np.multiply(x, s, out=out)
        np.add(out, t, out=out)

    return run


def _rows(a, shape, dtype, writes):
    """`a` seen as `shape` (rows x row length), plus the copy step needed when it cannot be
    viewed so (a strided arena view). Copies happen at run time, never in the factory."""
    try:
        return view_as(a, shape), None
    except AttributeError:
        buf = np.empty(shape, dtype)
        if writes:
            return buf, lambda: np.copyto(a, buf.reshape(a.shape))
        return buf, lambda: np.copyto(buf, a.reshape(shape))


# The squared deviations are formed a block of rows at a time, so the scratch stays
# cache-sized instead of a second copy of the whole tensor per norm node.
SCRATCH_ELEMENTS = 1 << 18


def _normalize_rows(x2, out2, eps, rms=False):
    """Callable normalizing each row of x2 (M, K) into out2: (x - mean) / sqrt(var + eps),
    or x / sqrt(mean(x^2) + eps) for rms. Scratch is allocated once, here."""
    m, k = x2.shape
    dt = out2.dtype
    mean = np.empty((m, 1), dt)
    var = np.empty((m, 1), dt)
    rows = max(1, min(m, SCRATCH_ELEMENTS // max(k, 1)))
    sq = np.empty((rows, k), dt)
    src = x2 if rms else out2  # rms: mean of x^2; otherwise of (x - mean)^2, held in out2
    row_mean = None if rms else reduction("mean", x2, mean, (1,))
    blocks = []
    for r in range(0, m, rows):
        b = slice(r, min(m, r + rows))
        blocks.append((src[b], sq[: b.stop - r], reduction("mean", sq[: b.stop - r], var[b], (1,))))

    def run():
        if row_mean is not None:
            row_mean()
            np.subtract(x2, mean, out=out2)
        for sb, qb, block_mean in blocks:
            np.multiply(sb, sb, out=qb)
            block_mean()
        np.add(var, eps, out=var)
        np.sqrt(var, out=var)
        np.divide(src, var, out=out2)

    return run


def _affine(out, weight, bias, shape):
    steps = []
    if weight is not None:
        w = weight.reshape(shape)
        steps.append(lambda: np.multiply(out, w, out=out))
    if bias is not None:
        b = bias.reshape(shape)
        steps.append(lambda: np.add(out, b, out=out))
    return chain(*steps)


# axes: how many trailing dims are normalized
def _layer_norm_rows(node, ranks, batched):
    """layer_norm normalizes over its last `axes` dims."""
    return int(node.attrs["axes"]) < ranks[0]


@register(
    "layer_norm",
    infer=layer_norm_infer,
    inplace=True,
    attrs=dict(axes=integer(1, input_rank(0)), eps=optional(NUMBER), rms=optional(FLAG)),
    float_input=True,
    rows=_layer_norm_rows,
)
def make_layer_norm(node, inputs, outputs, ctx):
    x = inputs[0]
    weight = inputs[1] if len(inputs) > 1 else None
    bias = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    k = int(node.attrs["axes"])
    inner = math.prod(x.shape[x.ndim - k :])
    rows = math.prod(x.shape[: x.ndim - k])
    x2, pre = _rows(x, (rows, inner), out.dtype, writes=False)
    out2, post = _rows(out, (rows, inner), out.dtype, writes=True)
    eps, rms = float(node.attrs.get("eps", 1e-5)), bool(node.attrs.get("rms", 0))
    parts = [
        chain(_normalize_rows(x2[lo:hi], out2[lo:hi], eps, rms), _affine(out2[lo:hi], weight, bias, (inner,)))
        for lo, hi in _row_parts(ctx, node, rows, inner)
    ]
    return chain(pre, ctx.split(parts), post)


def _row_parts(ctx, node, rows, inner):
    """Row ranges for the threads: rows are normalized independently, so a big enough
    tensor is split by rows. ViT-B/16's 197x768 layer norms, per node in the model,
    measured faster on two threads than on one (timed alone, hot in cache, they were
    level: the parts' ~9 numpy calls each pay the GIL hand-off; docs/performance.md,
    "Kernel measurements")."""
    return parallel.ranges(rows, split_threads(ctx, node, rows * inner))


def _groups(node, channels):
    """attr groups; 0: one per channel (instance norm)."""
    return node.attrs["groups"] or channels


def group_norm_infer(node, shapes, dtypes):
    x = tuple(shapes[0])
    g = _groups(node, x[1]) if len(x) >= 2 else 0
    if not g or x[1] % g:
        raise ValueError(f"groups={node.attrs['groups']} must divide the channels (axis 1) of input {x}")
    _affine_operands(shapes, dtypes, (x[1],))
    return [(x, dtypes[0])]


@register(
    "group_norm",
    infer=group_norm_infer,
    inplace=True,
    attrs=dict(groups=NON_NEGATIVE, eps=optional(NUMBER)),
    float_input=True,
    rows=True,
    format_version=version_with("groups", 4, when=lambda groups: groups == 0),
)
def make_group_norm(node, inputs, outputs, ctx):
    x = inputs[0]
    weight = inputs[1] if len(inputs) > 1 else None
    bias = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    n, c = x.shape[0], x.shape[1]
    g = int(_groups(node, c))
    spatial = math.prod(x.shape[2:])
    cpg = c // g
    x2, pre = _rows(x, (n * g, cpg * spatial), out.dtype, writes=False)
    out2, post = _rows(out, (n * g, cpg * spatial), out.dtype, writes=True)
    eps = float(node.attrs.get("eps", 1e-5))
    threads = split_threads(ctx, node, n * c * spatial)
    # rows are (image, group) pairs: split by images, or for one image by groups, so each
    # part's channels are one range and its affine one slice of the weights. One thread
    # -> two: 1x320x64x64 with 32 groups 1.83 -> 0.98 ms, 2x128x32x32 0.41 -> 0.25
    # (a diffusion UNet's norms)
    by_groups = n == 1 and threads > 1
    parts = []
    for lo, hi in parallel.ranges(g if by_groups else n, threads):
        rows = slice(lo, hi) if by_groups else slice(lo * g, hi * g)
        channels = slice(lo * cpg, hi * cpg) if by_groups else slice(None)
        images = 1 if by_groups else hi - lo
        part_c = (hi - lo) * cpg if by_groups else c
        affine = _affine(
            view_as(out2[rows], (images, part_c, spatial)),
            None if weight is None else weight[channels],
            None if bias is None else bias[channels],
            (part_c, 1),
        )
        parts.append(chain(_normalize_rows(x2[rows], out2[rows], eps), affine))
    return chain(pre, ctx.split(parts), post)


@register(
    "lp_normalize",
    infer=same_as_input,
    inplace=True,
    attrs=dict(axis=AXIS, p=optional(NUMBER), eps=optional(NUMBER)),
    float_input=True,
    rows=rows_off_axis("axis"),
)
def make_lp_normalize(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    axis = int(node.attrs["axis"]) % x.ndim
    p = float(node.attrs.get("p", 2.0))
    eps = float(node.attrs.get("eps", 1e-12))
    red_shape = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
    norm = np.empty(red_shape, out.dtype)
    tmp = np.empty(x.shape, out.dtype)

    def run():
        if p == 2.0:
            np.multiply(x, x, out=tmp)
            np.sum(tmp, axis=axis, keepdims=True, out=norm)
            np.sqrt(norm, out=norm)
        elif p == 1.0:
            np.abs(x, out=tmp)
            np.sum(tmp, axis=axis, keepdims=True, out=norm)
        elif p == np.inf:
            np.abs(x, out=tmp)
            np.max(tmp, axis=axis, keepdims=True, out=norm)
        else:
            np.abs(x, out=tmp)
            np.power(tmp, p, out=tmp)
            np.sum(tmp, axis=axis, keepdims=True, out=norm)
            np.power(norm, 1.0 / p, out=norm)
        np.maximum(norm, eps, out=norm)
        np.divide(x, norm, out=out)

    return run
