"""Convolution (1-d, 2-d, 3-d; any groups, dilation, padding mode).

Canonical op `conv`: inputs (x, weight[Cout, Cin/groups, *k], bias[Cout]?,
input_scale[N or 1, Cin, 1, ...]?), attrs stride, pads (begins then ends per spatial dim),
dilation, groups, padding_mode ("zeros", "reflect", "replicate", "circular"). node.expr is
an optional fused activation. `input_scale` multiplies each input channel first (a
squeeze-and-excitation gate folded in by compilers before the fold was dropped: format
version 3 files hold it, and they still load): a 1x1 conv with one group scales its
(Cout, Cin) weights per gate instead of the (Cin, H, W) input; any other conv multiplies
its input into scratch.

A batch is one computation: where images can be GEMM columns or the batch dim of one
call, no lowering loops over them in Python, since each call's fixed cost is then paid
once per batch rather than once per image. The exception is a batch of large images
(input or output over CONV_IMAGE_BYTES each): a whole batch's columns and outputs do
not stay in L2, one image's do, so such a batch runs image by image (make_conv).

Lowerings (node.variant, chosen by the compiler; "" lets the kernel pick):
  gemm      the im2col copy, made by one np.copyto from a strided view of the padded
            input into shared scratch, then one GEMM per group (onto the bias,
            runtime/blas.py); the activation follows on the output while it is still in
            cache. On small maps (FOLD_MAX_POSITIONS) the batch is folded into the GEMM
            columns, each thread taking whole images (_folded); on larger maps per image,
            the copy and GEMM split over the cores. 1x1 stride-1 unpadded convs are a
            plain GEMM on the input, one batched GEMM for a batch (folded on 7x7 maps).
  depthwise (groups == Cin == Cout) im2col + batched GEMV over "flat" views: the padded
            input is stored split into stride phases (one phase when stride is 1), each
            flattened per channel, so every tap is one contiguous slice at a fixed offset
            and the taps reading one phase form a regular grid: one strided np.copyto per
            grid builds a block of channels' im2col columns (C, taps, L) with copies that
            run over whole channels, then one batched GEMM (C, 1, taps) @ (C, taps, L) runs
            the C GEMVs. On small maps a batch's images are side by side in the columns,
            (C, taps, N x L), so a GEMV covers several images (DEPTHWISE_FOLD_COLUMNS).
            The output is computed "wide" (rows as long as the phase rows, the extra
            columns discarded when it is copied out with the bias). Channels are
            split over the cores, and within a core taken in blocks of
            DEPTHWISE_BLOCK_BYTES of columns, so the columns are still in L2 when the GEMVs
            read them (blocks of 256 KiB to 4 MiB measured alike within noise alone, but
            in models 256 KiB lost; unblocked columns, up to 15 MB on MobileNetV2, were
            slower: docs/performance.md, "Kernel measurements"). Scratch: the padded input
            (its border rewritten each run where a valid output reads it,
            common.restore_stale), the wide output and one block of columns per core; the
            weights are used as they are, a (C, 1, taps) view.
            Stride-1 convs at most 3 wide that keep the row width (3x3 "same") skip the
            padded rows: see _Flat ("flat": the input flattened per channel, taps reading
            across a row's end zeroed in the columns, the GEMVs writing the output directly).
            This replaced a per-tap multiply-add (two ufunc passes per tap over the wide
            output): a GEMV reads each column once and accumulates in registers
            (docs/performance.md, "Kernel choice: the tables").
"""

import math

import numpy as np

from pmx.runtime import blas, parallel
from pmx.runtime.kernels.attr_specs import POSITIVE, ints, one_of, optional, twice, weight_spatial
from pmx.runtime.kernels.bind import scratch_nbytes
from pmx.runtime.kernels.common import (
    GEMM_SPLIT_MIN_COLUMNS,
    GEMM_SPLIT_MIN_ROWS,
    SINGLE_THREAD,
    chain,
    check_border_pads,
    conv_out_size,
    copy_rows,
    copy_strided,
    epilogue,
    expect_operand,
    expect_output_positions,
    fill_border,
    gemm,
    gemm_node_threads,
    gemm_split_minimum,
    node_threads,
    padded_buffer,
    phase_buffer,
    phase_scratch,
    phases,
    product,
    restore_stale,
    root_array,
    runs_of,
    split_activated,
    view_as,
)
from pmx.runtime.kernels.registry import register, weight_macs

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
# the attributes of conv (and, with output_padding, conv_transpose): one stride and
# dilation per spatial dim of the weight, pads begins then ends
CONV_ATTRS = dict(
    stride=ints(weight_spatial, lo=1),
    pads=ints(twice(weight_spatial), lo=0),
    dilation=ints(weight_spatial, lo=1),
    groups=optional(POSITIVE),
    padding_mode=optional(one_of(*PADDING_MODES)),
)


def conv_infer(node, shapes, dtypes):
    x, w = shapes[0], shapes[1]
    a = node.attrs
    nd = len(w) - 2
    groups = a.get("groups", 1)
    if len(x) != nd + 2 or x[1] != w[1] * groups:
        raise ValueError(f"input {tuple(x)} does not have the {w[1] * groups} channels weight {tuple(w)} expects")
    if w[0] % groups:
        raise ValueError(f"groups={groups} does not divide the {w[0]} output channels of weight {tuple(w)}")
    expect_operand(shapes, dtypes, 1, "weight", dtype=dtypes[0])
    expect_operand(shapes, dtypes, 2, "bias", shape=(w[0],), dtype=dtypes[0], optional=True)
    if len(shapes) > 3 and shapes[3] is not None:
        _check_input_scale(tuple(shapes[3]), np.dtype(dtypes[3]), tuple(x), np.dtype(dtypes[0]))
    mode = a.get("padding_mode", "zeros")
    if mode != "zeros":
        check_border_pads(mode, a["pads"], x[2:])
    spatial = tuple(
        conv_out_size(x[2 + i], w[2 + i], a["stride"][i], a["dilation"][i], a["pads"][i], a["pads"][nd + i])
        for i in range(nd)
    )
    expect_output_positions(
        x, spatial, f"kernel {tuple(w[2:])} (dilation {tuple(a['dilation'])}, pads {tuple(a['pads'])})"
    )
    return [((x[0], w[0]) + spatial, dtypes[0])]


def _padded_input(ctx, x, a, nd):
    """(callable that refreshes the padded copy or None, padded array)."""
    pads = tuple(a["pads"])
    if not any(pads):
        return None, x
    mode = a.get("padding_mode", "zeros")
    buf, interior = padded_buffer(ctx, x.shape, pads, x.dtype, 0, shared_as=("conv input", mode))
    return chain(copy_rows(interior, x), _border_step(buf, a, x.shape[-nd:])), buf


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
    strides = (
        (cg * s[0], s[0])
        + tuple(dilation[i] * s[1 + i] for i in range(nd))
        + tuple(stride[i] * s[1 + i] for i in range(nd))
    )
    return np.lib.stride_tricks.as_strided(xp, shape, strides, writeable=False)


def _is_depthwise(w_shape, groups):
    return groups > 1 and w_shape[1] == 1 and w_shape[0] == groups


def variants(node, shapes):
    """The lowerings `pmx compile --tune` times for a conv with these input shapes."""
    groups = int(node.attrs.get("groups", 1))
    return ["gemm", "depthwise"] if _is_depthwise(shapes[1], groups) else ["gemm"]


def format_version(node):
    """3 with an input scale (a folded gate), which a version-2 runtime would ignore."""
    return 3 if len(node.inputs) > 3 and node.inputs[3] is not None else None


def _variant(node, w):
    """The lowering to use: the stored one when it applies (an unknown or inapplicable
    variant falls back to the rule, so any file runs), else depthwise for groups ==
    channels."""
    lowering = node.variant[: -len(SINGLE_THREAD)] if node.variant.endswith(SINGLE_THREAD) else node.variant
    depthwise = _is_depthwise(w.shape, int(node.attrs.get("groups", 1)))
    if lowering == "gemm" or (lowering == "depthwise" and depthwise):
        return lowering
    return "depthwise" if depthwise else "gemm"


def _is_pointwise(x, w, a):
    return (
        all(v == 1 for v in w.shape[2:])
        and all(s == 1 for s in a["stride"])
        and not any(a["pads"])
        and x.flags.c_contiguous
    )


def conv_scratch(node, inputs, outputs, ctx):
    x, w, out = inputs[0], inputs[1], outputs[0]
    scale = _input_scale(inputs)
    if scale is not None and _scales_weights(node, x, w, out):
        return scratch_nbytes(((scale.shape[0], w.shape[0], w.shape[1]), w.dtype))
    scaled = () if scale is None else ((x.shape, x.dtype),)
    if _image_by_image(x, out):  # the images take the same scratch in turn (make_conv)
        x, out = x[:1], out[:1]
    if _variant(node, w) == "depthwise":
        g = _depthwise_geometry(x, w, out, node.attrs)
        padded, rest = _depthwise_scratch(
            g, *_depthwise_plan(ctx, node, g, out.dtype), out.dtype, x.shape, node.attrs.get("padding_mode", "zeros")
        )
        return scratch_nbytes(*scaled, *padded, *rest)
    parts = _fold_parts(ctx, node, x, w, out)
    if parts:
        return scratch_nbytes(*scaled, *_fold_scratch(x, w, out, parts) * len(parts))
    if _is_pointwise(x, w, node.attrs):
        return scratch_nbytes(*scaled)
    threads, bands, tile_rows = _im2col_plan(ctx, node, x, w, out)
    groups = x.shape[1] // w.shape[1]
    if _split_by_channels(threads, groups, w.shape[0], math.prod(out.shape[2:])):
        return scratch_nbytes(*scaled, (_cols_shape(x, w, out), x.dtype))
    tiles = [(_tile_shape(x, w, out, min(tile_rows, hi - lo)), x.dtype) for lo, hi in bands]
    return scratch_nbytes(*scaled, *tiles)


@register(
    "conv",
    infer=conv_infer,
    scratch=conv_scratch,
    attrs=CONV_ATTRS,
    float_input=True,
    rows=True,
    variants=variants,
    format_version=format_version,
    macs=weight_macs,
)
def make_conv(node, inputs, outputs, ctx):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    scale = _input_scale(inputs)
    if scale is not None:
        if _scales_weights(node, x, w, out):
            return _scaled_pointwise(ctx, node, x, w, b, scale, out)
        scaled = ctx.scratch_array(x.shape, x.dtype)
        return chain(lambda: np.multiply(x, scale, out=scaled), make_conv(node, [scaled, w, b], outputs, ctx))
    if not _image_by_image(x, out):
        return _lowered(ctx, node, x, w, b, out)
    mark, steps = ctx.mark(), []
    for i in range(x.shape[0]):
        ctx.rewind(mark)  # the images run one after another: they take the same scratch
        steps.append(_lowered(ctx, node, x[i : i + 1], w, b, out[i : i + 1]))
    return chain(*steps)


# Bytes of one image's input or output above which a conv over a batch runs one image
# after another, each bound as a batch of one: one image's padded copy, im2col columns
# and output stay in L2, the whole batch's do not (docs/performance.md, "Large convs
# image by image").
CONV_IMAGE_BYTES = 512 << 10


def _image_by_image(x, out):
    return x.shape[0] > 1 and max(x[0].nbytes, out[0].nbytes) > CONV_IMAGE_BYTES


def _lowered(ctx, node, x, w, b, out):
    if _variant(node, w) == "depthwise":
        return _depthwise(ctx, node, x, w, b, out)
    return _gemm(ctx, node, x, w, b, out)


# --- input scale (folded squeeze-and-excitation gates) ---------------------------------


def _input_scale(inputs):
    """The optional per-input-channel scale (None if absent), which conv_infer checked
    against x when the file loaded."""
    return inputs[3] if len(inputs) > 3 else None


def _check_input_scale(shape, dtype, x, x_dtype):
    """An input scale of `shape` and `dtype` scales the channels of an input `x`, or a
    ValueError says what it should be."""
    if (
        len(shape) != len(x)
        or shape[0] not in (1, x[0])
        or shape[1] != x[1]
        or any(d != 1 for d in shape[2:])
        or dtype != x_dtype
    ):
        raise ValueError(
            f"input scale {shape} {dtype} does not scale the channels of input "
            f"{x} {x_dtype}: expected ({'1' if x[0] == 1 else f'{x[0]} or 1'}, "
            f"{x[1]}{', 1' * (len(x) - 2)}) {x_dtype}"
        )


def _scales_weights(node, x, w, out):
    """Whether the scale goes into the weights: a 1x1 conv with one group that runs as a
    plain GEMM on its input."""
    return (
        _variant(node, w) == "gemm"
        and x.shape[1] == w.shape[1]
        and _is_pointwise(x, w, node.attrs)
        and math.prod(out.shape[2:]) > 1
    )


def _scaled_pointwise(ctx, node, x, w, b, scale, out):
    """A 1x1 conv of x * scale as (W * scale) @ x: the scaled (Cout, Cin) weights of
    every gate (one per image, or one for the batch) go into scratch in one multiply,
    then one GEMM (split, bias, activation) over the batch reads x as it is. The compiler
    folds a gate in only where the weights are smaller than the input (Cout < H x W), so
    this replaces a pass over the input with a smaller one."""
    n, cout, cin = x.shape[0], w.shape[0], w.shape[1]
    gates = scale.shape[0]
    scaled = ctx.scratch_array((gates, cout, cin), w.dtype)
    w2 = w.reshape(cout, cin)
    rows = scale[(slice(None), slice(None)) + (0,) * (scale.ndim - 2)][
        :, None, :
    ]  # (gates, 1, Cin): a view at any strides
    x2 = view_as(x, (n, cin, -1))
    out2 = view_as(out, (n, cout, -1))
    bias = None if b is None else b.reshape(cout, 1)
    threads = gemm_node_threads(ctx, node)
    multiply = np.multiply
    weights = scaled if gates > 1 else scaled[0]
    if n == 1:
        x2, out2 = x2[0], out2[0]
    return chain(
        lambda: multiply(w2, rows, out=scaled),
        gemm(ctx, weights, x2, out2, threads, node, rows_first=True, bias=bias),
    )


# --- gemm ----------------------------------------------------------------------------


def _cols_shape(x, w, out):
    groups = x.shape[1] // w.shape[1]
    kk = math.prod(w.shape[2:])
    return (groups, w.shape[1] * kk, math.prod(out.shape[2:]))


def _gemm(ctx, node, x, w, b, out):
    a = node.attrs
    n, nd = x.shape[0], w.ndim - 2
    groups = x.shape[1] // w.shape[1]
    cout, cg = w.shape[0], w.shape[1]
    k = w.shape[2:]
    o = math.prod(out.shape[2:])
    threads = gemm_node_threads(ctx, node)
    if _is_pointwise(x, w, a) and groups == 1 and o == 1 and (threads == 1 or n * cout * cg < gemm_split_minimum(True)):
        return _gemv(ctx, node, x, w, b, out)
    wg = view_as(w, (groups, cout // groups, -1)) if w.flags.c_contiguous else w.reshape(groups, cout // groups, -1)
    out_g = view_as(out, (n, groups, cout // groups, o))
    # one group: plain 2-D GEMMs, which gemm() may also split by rows
    squeeze = (lambda t: t[0]) if groups == 1 else (lambda t: t)
    bias = None if b is None else b.reshape(squeeze(out_g[0]).shape[:-1] + (1,))
    parts = _fold_parts(ctx, node, x, w, out)
    if parts:
        return _folded(ctx, node, x, w, b, out, parts)
    if _is_pointwise(x, w, a):
        x_g = view_as(x, (n, groups, cg, o))
        if n > 1:
            return _batched_pointwise(ctx, node, squeeze(wg), x_g, out_g, bias, threads, groups)
        return gemm(ctx, squeeze(wg), squeeze(x_g[0]), squeeze(out_g[0]), threads, node, rows_first=True, bias=bias)
    pad_step, xp = _padded_input(ctx, x, a, nd)
    owner = root_array(xp)  # the windows below are as_strided views, which lose their bases
    threads, bands, tile_rows = _im2col_plan(ctx, node, x, w, out)
    row = o // out.shape[2]  # output positions per row of the first spatial axis
    first_axis = (slice(None),) * (2 + nd)  # (G, Cg, *k) come before the output rows
    by_channels = _split_by_channels(threads, groups, cout, o)
    if by_channels:
        cols = ctx.scratch_array(_cols_shape(x, w, out), x.dtype)
        cols_windows = view_as(cols, (groups, cg) + tuple(k) + tuple(out.shape[2:]))
    else:
        tiles = [ctx.scratch_array(_tile_shape(x, w, out, min(tile_rows, hi - lo)), x.dtype) for lo, hi in bands]
    steps = [pad_step]
    for i in range(n):
        windows = _windows(xp[i], k, a["stride"], a["dilation"], out.shape[2:], groups)
        if by_channels:
            views = [
                (cols_windows[first_axis + (slice(lo, hi),)], windows[first_axis + (slice(lo, hi),)])
                for lo, hi in bands
            ]
            steps.append(ctx.split([copy_strided(d, s, owner) for d, s in views]))
            steps.append(gemm(ctx, wg[0], cols[0], out_g[i][0], threads, node, rows_first=True, bias=bias))
            continue
        parts = []
        for (lo, hi), tile in zip(bands, tiles):
            tile_windows = view_as(tile, (groups, cg, *k, -1, *out.shape[3:]))
            work = []
            for r0, r1 in _row_tiles(lo, hi, tile_rows):
                used = squeeze(tile[..., : (r1 - r0) * row])
                copy = copy_strided(
                    tile_windows[first_axis + (slice(0, r1 - r0),)], windows[first_axis + (slice(r0, r1),)], owner
                )
                # the tile's copy, then its GEMM onto the bias, while the columns are in cache
                work += [copy, product(squeeze(wg), used, squeeze(out_g[i][..., r0 * row : r1 * row]), bias)]
            parts.append((chain(*work), squeeze(out_g[i][..., lo * row : hi * row])))
        steps.append(split_activated(ctx, node, out_g[i], parts))
    return chain(*steps)


# An im2col conv on a large map builds and multiplies its columns a tile of output rows
# at a time, each tile at most this many bytes: the tile stays in cache between its copy
# and its GEMM, and the scratch is a few tiles rather than the whole map's columns (58 MB
# for a 32-channel 3x3 conv at 224x224, every page of it touched first by the first run).
IM2COL_TILE_BYTES = 2 << 20


def _im2col_plan(ctx, node, x, w, out):
    """(threads, bands of output rows per thread, rows per tile) of an unfolded im2col conv."""
    o = math.prod(out.shape[2:])
    threads = gemm_node_threads(ctx, node)
    macs = w.shape[0] * math.prod(w.shape[1:]) * o
    threads = threads if macs >= gemm_split_minimum(o == 1) else 1
    row_bytes = math.prod(_cols_shape(x, w, out)[:2]) * (o // out.shape[2]) * x.itemsize
    return threads, parallel.ranges(out.shape[2], threads), max(1, IM2COL_TILE_BYTES // max(1, row_bytes))


def _tile_shape(x, w, out, rows):
    groups, depth, o = _cols_shape(x, w, out)
    return (groups, depth, rows * (o // out.shape[2]))


def _row_tiles(lo, hi, rows):
    return [(r, min(r + rows, hi)) for r in range(lo, hi, rows)]


def _batched_pointwise(ctx, node, w, x_g, out_g, bias, threads, groups):
    """A 1x1 conv of a batch as one batched GEMM (the images its batch dim, one
    ?gemm_batch_strided call), split over the threads by output channels as gemm() splits
    one image's: the kernels after a conv split by channels too, so each core then reads
    what it just wrote."""
    if groups > 1:
        return gemm(ctx, w, x_g, out_g, threads, node, rows_first=True, bias=bias)
    x_b, out_b = x_g[:, 0], out_g[:, 0]
    macs = out_b.size * w.shape[-1]
    if threads < 2 or macs < gemm_split_minimum(False) or w.shape[0] < threads:
        return split_activated(ctx, node, out_b, [(product(w, x_b, out_b, bias), out_b)])
    parts = []
    for lo, hi in parallel.ranges(w.shape[0], threads):
        part = out_b[:, lo:hi]
        parts.append((product(w[lo:hi], x_b, part, None if bias is None else bias[lo:hi]), part))
    return split_activated(ctx, node, out_b, parts)


# The batch is folded into the GEMM columns of an im2col conv whose images have fewer
# output positions than this (see _folded); a 1x1 conv, which needs a copy of its input
# for it, only on 7x7 and 8x8 maps: from 14x14 up one batched GEMM over the images as
# they lie (gemm_batch_strided) was faster.
FOLD_MAX_POSITIONS = 256
FOLD_POINTWISE_MAX_POSITIONS = 65
# ...in GEMMs of as many images as keep their im2col columns within this many bytes
FOLD_COLUMNS_BYTES = 4 << 20


def _fold_parts(ctx, node, x, w, out):
    """The image ranges a folded im2col conv gives its threads, one each ([(0, N)] on one
    thread); [] where images run one after another (_folded says when)."""
    n, o = x.shape[0], math.prod(out.shape[2:])
    limit = FOLD_POINTWISE_MAX_POSITIONS if _is_pointwise(x, w, node.attrs) else FOLD_MAX_POSITIONS
    if n < 2 or o >= limit:
        return []
    threads = gemm_node_threads(ctx, node)
    macs = n * w.shape[0] * math.prod(w.shape[1:]) * o
    if threads < 2 or macs < gemm_split_minimum(False):
        return [(0, n)]
    return parallel.ranges(n, threads) if n >= threads else []


def _fold_images(x, w, out, parts):
    """Images per folded GEMM: as many of a part's as keep their columns within
    FOLD_COLUMNS_BYTES, at least one."""
    per_image = math.prod(_cols_shape(x, w, out)) * x.itemsize
    return max(1, min(max(hi - lo for lo, hi in parts), FOLD_COLUMNS_BYTES // per_image))


def _fold_scratch(x, w, out, parts):
    """One thread's scratch of a folded conv: its im2col columns and the GEMM's output,
    (groups, rows, images x positions) each, as (shape, dtype) pairs."""
    m = _fold_images(x, w, out, parts)
    groups, kk, o = _cols_shape(x, w, out)
    return [((groups, kk, m * o), x.dtype), ((groups, w.shape[0] // groups, m * o), x.dtype)]


def _folded(ctx, node, x, w, b, out, parts):
    """An im2col conv on small maps with the batch as GEMM columns: for a few images at a
    time, one strided copy builds their columns (groups, Cin/groups x taps, images x
    positions), one GEMM (onto the bias) multiplies them, the activation runs on its
    output, and a row copy puts that back in NCHW order. Per-image GEMMs on 7x7 maps are
    49 columns wide, which BLAS runs well below its speed on wider ones; from 16x16 maps
    up the extra copy costs what the wider GEMM saves. With several threads each takes
    whole images (`parts`), so the conv is one dispatch."""
    a = node.attrs
    n, nd = x.shape[0], w.ndim - 2
    groups = x.shape[1] // w.shape[1]
    cout, k = w.shape[0], w.shape[2:]
    rows = cout // groups
    o = math.prod(out.shape[2:])
    m = _fold_images(x, w, out, parts)
    wg = view_as(w, (groups, rows, -1)) if w.flags.c_contiguous else w.reshape(groups, rows, -1)
    squeeze = (lambda t: t[0]) if groups == 1 else (lambda t: t)
    bias = None if b is None else squeeze(b.reshape(groups, rows, 1))
    out_g = view_as(out, (n, groups, rows, o))
    xp, interior = x, None
    if any(a["pads"]):
        mode = a.get("padding_mode", "zeros")
        xp, interior = padded_buffer(ctx, x.shape, tuple(a["pads"]), x.dtype, 0, shared_as=("conv input", mode))
    owner = root_array(xp)  # the windows below are as_strided views, which lose their bases
    works = []
    for lo, hi in parts:
        cols_buf, y_buf = (ctx.scratch_array((math.prod(s),), dt) for s, dt in _fold_scratch(x, w, out, parts))
        steps = []
        if interior is not None:  # each thread pads its own images
            steps += [copy_rows(interior[lo:hi], x[lo:hi]), _border_step(xp[lo:hi], a, x.shape[-nd:])]
        activations = {}
        for i0 in range(lo, hi, m):
            count = min(hi, i0 + m) - i0
            cols = view_as(cols_buf[: groups * w[0].size * count * o], (groups, -1, count * o))
            y = view_as(y_buf[: cout * count * o], (groups, rows, count * o))
            dst = view_as(cols, (groups, w.shape[1]) + tuple(k) + (count,) + tuple(out.shape[2:]))
            steps.append(copy_strided(dst, _batch_windows(xp[i0 : i0 + count], k, a, out.shape[2:], groups), owner))
            steps.append(product(squeeze(wg), squeeze(cols), squeeze(y), bias))
            if count not in activations:  # chunks of one size share y, so its activation
                activations[count] = epilogue(ctx, node, y, threads=1)
            steps.append(activations[count])
            steps.append(copy_rows(out_g[i0 : i0 + count], view_as(y, (groups, rows, count, o)).transpose(2, 0, 1, 3)))
        works.append(chain(*steps))
    return ctx.split(works)


def _batch_windows(xp, k, a, out_spatial, groups):
    """Strided view (G, Cg, *k, N, *out) of padded images xp (N, C, *spatial): no copy."""
    nd = len(k)
    s = xp.strides
    cg = xp.shape[1] // groups
    shape = (groups, cg) + tuple(k) + (xp.shape[0],) + tuple(out_spatial)
    strides = (
        (cg * s[1], s[1])
        + tuple(a["dilation"][i] * s[2 + i] for i in range(nd))
        + (s[0],)
        + tuple(a["stride"][i] * s[2 + i] for i in range(nd))
    )
    return np.lib.stride_tricks.as_strided(xp, shape, strides, writeable=False)


def _split_by_channels(threads, groups, cout, positions):
    """Whether a split im2col conv builds its columns in bands of output rows, then splits
    its GEMM by output channels (two dispatches), rather than giving each thread a band's
    columns and their GEMM (one). Bands leave each thread positions/threads GEMM columns:
    on small maps that is a narrow, slow GEMM (7x7: 24 and 25 columns), and the kernels
    after it split by channel. Per node inside models, 2 threads, channels measured
    faster than bands on 7x7 to 14x14 maps (ResNet-18, GoogLeNet, SqueezeNet). Big maps
    keep bands (stems at 112x112 were slower by channels), and so do convs with too few
    channels for gemm() to split (DenseNet's 128->32 at 7x7, with the GEMM on one thread)
    (docs/performance.md, "Kernel measurements")."""
    return threads > 1 and groups == 1 and cout >= GEMM_SPLIT_MIN_ROWS and positions // threads < GEMM_SPLIT_MIN_COLUMNS


def _gemv(ctx, node, x, w, b, out):
    """A 1x1 conv on one position per image (squeeze-and-excitation blocks): one GEMV
    of the (Cout, Cin) weights with the input vector (a batch: the (N, Cin) inputs with the
    transposed weights), then bias and activation, in one callable. The general path's
    matmul over (Cin, 1) columns and its chained bias/activation closures cost more per
    call (measured on MobileNetV3's squeeze-and-excitation convs); most of what is left
    is the activation, much of it numpy's np.clip wrapper (docs/performance.md, "Kernel
    measurements")."""
    n, cout, cin = x.shape[0], w.shape[0], w.shape[1]
    w2 = w.reshape(cout, cin)
    if n == 1:
        a, m, o = w2, view_as(x, (cin,)), view_as(out, (cout,))
    else:
        a, m, o = view_as(x, (n, cin)), w2.T, view_as(out, (n, cout))
    product = blas.matmul(a, m, o)
    if b is not None:
        multiply, add = product, np.add

        def product():
            multiply()
            add(o, b, out=o)

    return chain(product, epilogue(ctx, node, out, threads=1))


# --- depthwise -----------------------------------------------------------------------

# Channels per im2col block: a block's columns (channels x taps x wide length) stay in
# L2 between their copy and their GEMVs. See the module docstring for the measurements.
DEPTHWISE_BLOCK_BYTES = 1 << 20
# Split channels over the cores only from this many im2col column elements (N x C x taps
# x wide length) up. Timed alone, splits lost below ~400K (232x7x7 3x3, 131K: 0.095 ms on
# one thread, 0.103 on two), but inside models, where the input was just written by a
# split producer and the workers are pinned off the caller's core, they won from 128K
# (per-node medians of 4x40 runs, threshold 512K -> 128K): ShuffleNetV2 232x7x7 3x3
# (131K) 0.083 -> 0.072 ms, 116x14x14 3x3 (234K) 0.087 -> 0.074, 58x28x28 3x3 (438K)
# 0.143 -> 0.108; MobileNetV3-small 16x112x112 3x3 s2 0.268 -> 0.171, 288x14x14 5x5 s2
# 0.297 -> 0.202. The module docstring's table (0.8M-7M elements): 1.0-1.8x on two.
DEPTHWISE_SPLIT_MIN_ELEMENTS = 1 << 17  # was 1 << 19
# A batch's images are folded into the columns of each channel's GEMV, up to this many
# columns, where one image gives at most a quarter of them: numpy's matmul makes one BLAS
# call per GEMV, and on 7x7 maps that call's cost is most of the GEMV. On 14x14 maps the
# copy out of the folded columns cost what the wider GEMVs saved.
DEPTHWISE_FOLD_COLUMNS = 512


def _phases(x, w, out, a):
    return phases(
        x.shape,
        w.shape[2:],
        out.shape,
        a["stride"],
        a["dilation"],
        a["pads"],
        shared_padding=a.get("padding_mode", "zeros") == "zeros",
    )


def _depthwise_plan(ctx, node, g, dtype):
    """(channel range per thread, (images, channels) per im2col block), as make() and the
    scratch sizing both need them. A block takes images (folded into its GEMV columns)
    until its GEMVs are DEPTHWISE_FOLD_COLUMNS wide, then channels up to
    DEPTHWISE_BLOCK_BYTES of columns."""
    elements = g.n * g.c * g.length * len(g.taps)
    split = ctx.worth_splitting(elements) and elements >= DEPTHWISE_SPLIT_MIN_ELEMENTS
    threads = node_threads(ctx, node) if split else 1
    parts = parallel.ranges(g.c, threads)
    per_channel = max(1, len(g.taps) * g.length * np.dtype(dtype).itemsize)
    images = min(g.n, DEPTHWISE_FOLD_COLUMNS // g.length) if 4 * g.length <= DEPTHWISE_FOLD_COLUMNS else 1
    block = max(1, min(max(hi - lo for lo, hi in parts), DEPTHWISE_BLOCK_BYTES // (per_channel * images)))
    return parts, (images, block)


def _depthwise_scratch(g, parts, block, dtype, x_shape, mode):
    """(the padded input's arrays: the flat buffer or phase_buffer's; then the wide output
    (channel-major when images are folded; none when flat and not folded) and one block
    of im2col columns per thread), as (shape, dtype) pairs."""
    images, channels = block
    cols = ((len(parts), images * channels, len(g.taps), g.length), dtype)
    wide = [((g.c, g.n, g.length), dtype)] if images > 1 else []
    if isinstance(g, _Flat):
        return [((g.n, g.c, g.per_channel), dtype)], wide + [cols]
    return phase_scratch(g, x_shape, dtype, mode), (wide or [((g.n, g.c, 1, g.length), dtype)]) + [cols]


class _Flat:
    """Geometry of the "flat" depthwise path: stride 1, zero padding, at most 3 taps wide
    without dilation along the rows, output rows as wide as the input's (so a tap's
    window is one contiguous slice of a channel's flattened input), C-contiguous input
    and output. Each channel's input is stored flattened at `base` in a zeroed buffer of
    `per_channel` elements: tap (ky, kx) reads the slice at `taps[ky * kw + kx]`, and
    output (y, x) is column y * W + x. A tap that reaches past a row's end reads the
    neighbouring row instead of padding: `wrapped` lists, per kx, the columns x in
    [lo, hi) whose values must be zeroed after each im2col copy.
    Against the phase path it skips the copy into padded rows and the copy out of the
    wide output, both strided with short rows: faster on every 3x3 depthwise shape
    measured, on one thread and on two (level on 232x7x7 over two), and in models faster
    on MobileNetV2 and EfficientNet-B0, level within noise on MobileNetV3-small and
    ShuffleNetV2. 5x5 kernels lost in a prototype: four of five taps need zeroing there,
    so they keep the phase path (docs/performance.md, "Kernel measurements")."""

    def __init__(self, x_shape, kernel, out_shape, dilation, pads):
        self.n, self.c, height, self.width = x_shape
        kh, kw = self.k = tuple(kernel)
        pt, pl = pads[0], pads[1]
        self.length = out_shape[2] * self.width
        self.base = pt * self.width + pl
        self.taps = [ky * dilation[0] * self.width + kx for ky in range(kh) for kx in range(kw)]
        self.per_channel = max(self.base + height * self.width, max(self.taps) + self.length)
        # all taps as one grid, in Phases.grids' format: (buffer offset, buffer step per
        # tap dim, first tap, tap step, taps per dim)
        self.grids = [(0, (dilation[0] * self.width, 1), (0, 0), (1, 1), (kh, kw))]
        self.wrapped = []
        for kx in range(kw):
            shift = kx - pl
            self.wrapped.append((0, -shift) if shift < 0 else (self.width - shift, self.width) if shift > 0 else None)

    @staticmethod
    def applies(x, w, out, a):
        pads, nd = a["pads"], x.ndim - 2
        return (
            nd == 2
            and tuple(a["stride"]) == (1, 1)
            and a.get("padding_mode", "zeros") == "zeros"
            and w.shape[3] <= 3
            and a["dilation"][1] == 1
            and out.shape[3] == x.shape[3]
            and pads[1] + pads[3] == w.shape[3] - 1
            and x.flags.c_contiguous
            and out.flags.c_contiguous
        )


def _depthwise_geometry(x, w, out, a):
    """_Flat where it applies, else the stride phases."""
    if _Flat.applies(x, w, out, a):
        return _Flat(x.shape, w.shape[2:], out.shape, a["dilation"], a["pads"])
    return _phases(x, w, out, a)


def _depthwise(ctx, node, x, w, b, out):
    a = node.attrs
    mode = a.get("padding_mode", "zeros")
    g = _depthwise_geometry(x, w, out, a)
    parts, block = _depthwise_plan(ctx, node, g, out.dtype)
    images, channels = block
    # weights as (C, 1, taps) GEMV rows: a view of the mmap for contiguous weights
    weights = w.reshape(g.c, 1, -1)
    # scratch: the padded input first (as _depthwise_scratch lists it), then the rest
    buf, fill = _flat_buffer(ctx, x, g) if isinstance(g, _Flat) else phase_buffer(ctx, x, g, mode)
    *wide, cols = (
        ctx.scratch_array(shape, dtype)
        for shape, dtype in _depthwise_scratch(g, parts, block, out.dtype, x.shape, mode)[1]
    )
    bias = (lambda ch: None) if b is None else (lambda ch: b[ch])
    if images > 1:
        # (C, N, length): each channel's images side by side, the GEMVs' columns
        target = wide[0]
        if isinstance(g, _Flat):  # the output is the whole of each channel's columns
            dst, valid_t = view_as(out, (g.n, g.c, g.length)), target.swapaxes(0, 1)
        else:
            valid = (slice(None), slice(None)) + tuple(slice(0, o) for o in g.out_spatial)
            dst, valid_t = out, view_as(target, (g.c, g.n) + g.wide)[valid].swapaxes(0, 1)
        finish = lambda ch: chain(_add_bias(target[ch].swapaxes(0, 1), bias(ch)), copy_rows(dst[:, ch], valid_t[:, ch]))
    elif isinstance(g, _Flat):
        # the GEMVs write the output itself
        target = view_as(out, (g.n, g.c, 1, g.length))
        finish = lambda ch: _add_bias(out[:, ch], bias(ch))
    else:
        target = wide[0]
        valid = (slice(None), slice(None), slice(None)) + tuple(slice(0, o) for o in g.out_spatial[1:])
        wide_valid = view_as(target, (g.n, g.c) + g.wide)[valid]
        finish = lambda ch: _copy_out(target[:, ch], wide_valid[:, ch], out[:, ch], bias(ch))
    steps = []
    for (lo, hi), part_cols in zip(parts, cols):
        ch = slice(lo, hi)
        blocks = [
            (i0, min(g.n, i0 + images), c0, min(hi, c0 + channels))
            for i0 in range(0, g.n, images)
            for c0 in range(lo, hi, channels)
        ]
        gemv = _im2col_gemv(buf, g, weights, part_cols, target, blocks, images > 1)
        steps.append((chain(fill(ch), gemv, finish(ch)), out[:, ch]))
    return split_activated(ctx, node, out, steps)


def _flat_buffer(ctx, x, g):
    """(buffer, fill(channel slice) -> callable): the flat path's padded input in scratch,
    each channel of x flattened at g.base, and for each channel slice the callable that
    zeroes the positions before and after it (stale from other nodes) and copies it in."""
    buf = ctx.scratch_array((g.n, g.c, g.per_channel), x.dtype)
    x_flat = view_as(x, (g.n, g.c, -1))
    inner = buf[:, :, g.base : g.base + x_flat.shape[2]]
    stale = np.ones(g.per_channel, bool)
    stale[g.base : g.base + x_flat.shape[2]] = False
    families = runs_of(stale)
    return buf, lambda ch: chain(
        restore_stale(buf[:, ch], families, 0), lambda d=inner[:, ch], s=x_flat[:, ch]: np.copyto(d, s)
    )


def _im2col_gemv(buf, g, weights, cols, target, blocks, folded):
    """Per block of (images, channels): the block's im2col columns, one strided copy per
    tap grid (on the flat path, the columns that read across a row's end then zeroed),
    then one GEMV (1, taps) @ (taps, columns) per channel, all in one batched GEMM into
    `target`. `folded`: the columns are (C, taps, N x length), the images side by side
    in each channel's GEMV, and target is (C, N, length); else the blocks are of one
    image, the columns (C, taps, length) and target (N, C, 1, length) (the wide output,
    or on the flat path the output)."""
    item = buf.itemsize
    work = []
    for i0, i1, c0, c1 in blocks:
        n_im, n_ch = i1 - i0, c1 - c0
        block = cols[: n_im * n_ch]
        if folded:
            tail, tail_strides = (n_im, g.length), (buf.strides[0], item)
            gemv_cols = view_as(block, (n_ch, len(g.taps), n_im * g.length))
            gemv_out = view_as(target[c0:c1, i0:i1], (n_ch, 1, n_im * g.length))
        else:  # one image
            tail, tail_strides = (g.length,), (item,)
            gemv_cols, gemv_out = block, target[i0, c0:c1]
        block_k = view_as(block, (n_ch,) + g.k + tail)
        zeros = _wrapped_columns(view_as(block, (n_ch,) + g.k + (n_im * g.length,)), g) if isinstance(g, _Flat) else ()
        copies = []
        for offset, steps, first, tap_step, counts in g.grids:
            src = np.lib.stride_tricks.as_strided(
                buf[i0, c0:c1, offset:],
                (n_ch,) + counts + tail,
                (buf.strides[1],) + tuple(s * item for s in steps) + tail_strides,
                writeable=False,
            )
            taps = tuple(slice(f, f + (n - 1) * t + 1, t) for f, t, n in zip(first, tap_step, counts))
            copies.append(copy_rows(block_k[(slice(None),) + taps], src))
        work.append((tuple(copies), zeros, blas.matmul(weights[c0:c1], gemv_cols, gemv_out)))

    def run():
        for copies, zeros, multiply in work:
            for copy in copies:
                copy()
            for z in zeros:
                z.fill(0)
            multiply()

    return run


def _copy_out(wide, wide_valid, out, b):
    """Callable adding the bias (if any) to the wide output in place, then copying its
    valid part (`wide_valid`, a view of it) out row by row (copy_rows). Adding over whole
    wide rows and copying after beat one np.add from the strided valid part into out on
    the bench models' shapes (docs/performance.md, "Kernel measurements")."""
    copy = copy_rows(out, wide_valid)
    return copy if b is None else chain(_add_bias(wide, b), copy)


def _add_bias(out, b):
    """Callable adding the per-channel bias b to out (N, C, ...) in place (None without
    one)."""
    if b is None:
        return None
    bview = b.reshape((-1,) + (1,) * (out.ndim - 2))
    return lambda: np.add(out, bview, out=out)


def _wrapped_columns(rows, g):
    """Views of the im2col columns `rows` (C, kh, kw, columns: a multiple of the row width) that read across a row's end
    and must be zero. Two spans of one width (3 wide, padding 1 each side) are one strided
    view: each fill() has a fixed cost, a sizeable share of a small part's time
    (ShuffleNetV2's 116x14x14 on two threads; docs/performance.md, "Kernel
    measurements")."""
    n_ch, kh, _, length = rows.shape
    spans = [(kx, lo, hi) for kx, span in enumerate(g.wrapped) if span for lo, hi in [span]]
    if len(spans) == 2 and spans[0][2] - spans[0][1] == spans[1][2] - spans[1][1]:
        (k0, lo0, hi0), (k1, lo1, _) = spans
        item = rows.itemsize
        step = (k1 - k0) * rows.strides[2] + (lo1 - lo0) * item
        return (
            np.lib.stride_tricks.as_strided(
                rows[:, :, k0, lo0:],
                (n_ch, kh, 2, length // g.width, hi0 - lo0),
                rows.strides[:2] + (step, g.width * item, item),
            ),
        )
    return tuple(view_as(rows[:, :, kx], (n_ch, kh, -1, g.width))[..., lo:hi] for kx, lo, hi in spans)
