"""Property tests of the CNN kernels (conv, pooling, adaptive pooling, linear, batch norm),
called directly through run_kernel and compared with torch.nn.functional.

Tolerance: max|pmx - torch| / max|torch| <= 1e-5. Inputs mix signs and exact zeros, so
max-pooling ties, relu-like epilogues and padding values are all exercised.
"""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TORCH_PAD_MODE, bind_context, kernel_pool, rel_error, run_kernel, signed_input
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

TOL = 1e-5
# PMX_KERNEL_EXAMPLES=1000 for a long soak run
FAST = settings(max_examples=int(os.environ.get("PMX_KERNEL_EXAMPLES", "30")), deadline=None)


def _np(t):
    return t.detach().numpy() if isinstance(t, torch.Tensor) else t


def assert_close(got, want, pre_activation=None):
    """Max-normalized error; with a fused activation the scale is the accumulator's
    (pre-activation) magnitude: relu can leave one tiny output whose float32 rounding,
    relative to itself, says nothing about the kernel."""
    want = _np(want)
    assert got.shape == want.shape, f"shape {got.shape} != torch {want.shape}"
    # a max-pool window lying wholly in the padding is -inf in torch too
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite])
    err = rel_error(got[finite], want[finite])
    if pre_activation is not None and want[finite].size:
        pre = np.abs(_np(pre_activation)).max()
        err *= max(np.abs(want[finite]).max(), 1e-12) / max(pre, 1e-12)
    assert err <= TOL, f"max|pmx - torch| / max|torch| = {err:.3g} > {TOL}"


# --- convolution ----------------------------------------------------------------------------


@st.composite
def conv_case(draw):
    nd = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    depthwise = draw(st.booleans())
    if depthwise:
        groups = draw(st.integers(1, 6))
        cin, cout = groups, groups * draw(st.sampled_from([1, 1, 2]))
    else:
        cin = groups * draw(st.integers(1, 3))
        cout = groups * draw(st.integers(1, 3))
    k = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
    size = tuple(draw(st.integers(1, 9 if nd == 2 else 14)) for _ in range(nd))
    # torch's reflect needs pad < size, circular pad <= size
    limit = [s - 1 if mode == "reflect" else s if mode == "circular" else 4 for s in size]
    begins = tuple(draw(st.integers(0, max(0, min(3, lim)))) for lim in limit)
    ends = tuple(draw(st.integers(0, max(0, min(3, lim)))) for lim in limit)
    # the dilated kernel must fit the padded input
    for i in range(nd):
        if size[i] + begins[i] + ends[i] < dilation[i] * (k[i] - 1) + 1:
            size = size[:i] + (dilation[i] * (k[i] - 1) + 1,) + size[i + 1 :]
    batch = draw(st.integers(1, 4))
    bias = draw(st.booleans())
    act = draw(st.sampled_from(["", "", "maximum(@0,0)", "mul(@0,sigmoid(@0))"]))
    # a folded squeeze-and-excitation gate: one scale per image and channel, or per channel
    scale = draw(st.sampled_from([None, None, "per image", "shared"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(
        nd=nd,
        groups=groups,
        cin=cin,
        cout=cout,
        k=k,
        stride=stride,
        dilation=dilation,
        mode=mode,
        size=size,
        pads=begins + ends,
        batch=batch,
        bias=bias,
        act=act,
        scale=scale,
        seed=seed,
    )


def torch_conv(x, w, b, c):
    nd = c["nd"]
    begins, ends = c["pads"][:nd], c["pads"][nd:]
    # F.pad takes (last dim begin, last dim end, previous dim begin, ...)
    pad = []
    for i in reversed(range(nd)):
        pad += [begins[i], ends[i]]
    mode = TORCH_PAD_MODE[c["mode"]]
    xt = F.pad(torch.from_numpy(x), pad, mode=mode)
    conv = F.conv1d if nd == 1 else F.conv2d
    y = conv(
        xt, torch.from_numpy(w), None if b is None else torch.from_numpy(b), c["stride"], 0, c["dilation"], c["groups"]
    )
    return activation(y, c["act"]), y


def activation(y, expr):
    return F.relu(y) if expr == "maximum(@0,0)" else F.silu(y) if expr else y


def _valid_case(c):
    nd = c["nd"]
    for i in range(nd):
        if c["mode"] == "reflect" and max(c["pads"][i], c["pads"][nd + i]) >= c["size"][i]:
            return False
        if c["mode"] == "circular" and max(c["pads"][i], c["pads"][nd + i]) > c["size"][i]:
            return False
    return True


def _conv_operands(c):
    """A drawn case's operands as run_kernel takes them (x, weight, bias?, input scale?),
    its attributes, and torch's output with its pre-activation."""
    seed = c["seed"]
    x = signed_input((c["batch"], c["cin"]) + c["size"], seed)
    w = signed_input((c["cout"], c["cin"] // c["groups"]) + c["k"], seed + 1)
    b = signed_input((c["cout"],), seed + 2) if c["bias"] else None
    attrs = dict(stride=c["stride"], pads=c["pads"], dilation=c["dilation"], groups=c["groups"], padding_mode=c["mode"])
    scale = None
    if c["scale"]:
        scale = signed_input((c["batch"] if c["scale"] == "per image" else 1, c["cin"]) + (1,) * c["nd"], seed + 3)
    want, pre = torch_conv(x if scale is None else x * scale, w, b, c)
    inputs = [x, w] + ([b] if b is not None else []) + ([] if scale is None else [None] * (b is None) + [scale])
    return inputs, attrs, want, pre


@FAST
@given(conv_case())
def test_conv_matches_torch(c):
    assume(_valid_case(c))
    inputs, attrs, want, pre = _conv_operands(c)
    is_dw = c["groups"] == c["cin"] == c["cout"] and c["groups"] > 1
    for variant in ["gemm", "depthwise"] if is_dw else ["gemm", ""]:
        (got,) = run_kernel("conv", inputs, attrs, expr=c["act"], variant=variant)
        assert_close(got, want, pre)


@FAST
@given(conv_case(), st.sampled_from([1, 200, 5000]))
def test_conv_in_tiles_of_output_rows_matches_torch(c, tile_bytes):
    """The im2col GEMM a few output rows at a time (IM2COL_TILE_BYTES made small: one row
    per tile, a few, a last tile shorter than the others), as large maps run."""
    from unittest import mock

    from pmx.runtime.kernels import conv

    assume(_valid_case(c))
    inputs, attrs, want, pre = _conv_operands(c)
    with mock.patch.object(conv, "IM2COL_TILE_BYTES", tile_bytes):
        (got,) = run_kernel("conv", inputs, attrs, expr=c["act"], variant="gemm")
    assert_close(got, want, pre)


@FAST
@given(conv_case(), st.sampled_from([1, 2]))
def test_conv_image_by_image_matches_torch(c, threads):
    """A batch whose images are larger than CONV_IMAGE_BYTES runs one image after another
    over the same scratch (the bound made 0 here, so every batch goes that way), for
    every lowering, padding mode and input scale, on one thread and split over two."""
    from unittest import mock

    from pmx.runtime.kernels import conv

    assume(_valid_case(c) and c["batch"] > 1)
    inputs, attrs, want, pre = _conv_operands(c)
    is_dw = c["groups"] == c["cin"] == c["cout"] and c["groups"] > 1
    with mock.patch.object(conv, "CONV_IMAGE_BYTES", 0):
        for variant in ["gemm", "depthwise"] if is_dw else ["gemm", ""]:
            (got,) = run_kernel("conv", inputs, attrs, expr=c["act"], variant=variant, threads=threads)
            assert_close(got, want, pre)


def test_conv_pointwise_and_1x1_strided():
    """The 1x1 stride-1 fast path (no im2col) and a 1x1 stride-2 conv."""
    x = signed_input((2, 6, 5, 7), 0)
    w = signed_input((4, 6, 1, 1), 1)
    for stride in (1, 2):
        attrs = dict(stride=(stride, stride), pads=(0, 0, 0, 0), dilation=(1, 1), groups=1, padding_mode="zeros")
        (got,) = run_kernel("conv", [x, w], attrs)
        assert_close(got, F.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=stride))


@pytest.mark.parametrize("batch,gate_images", [(1, 1), (3, 3), (3, 1)])
def test_conv_input_scale_matches_torch(batch, gate_images, two_threads):
    """conv's optional input_scale (inputs[3]) on every lowering: scaled (Cout, Cin)
    weights for a 1x1 conv with one group, big enough to split its GEMM over the threads,
    with and without bias and activation; the input multiplied first for a 3x3, a grouped
    1x1, a depthwise conv and a 1x1 conv over a single position (the GEMV path)."""
    cases = [  # (cin, cout, size, k, groups, variant)
        (64, 48, (28, 28), 1, 1, "gemm"),
        (64, 48, (28, 28), 1, 1, "gemm_1t"),
        (8, 6, (5, 4), 1, 1, ""),
        (8, 6, (1, 1), 1, 1, ""),
        (8, 6, (5, 5), 3, 1, "gemm"),
        (8, 6, (5, 5), 1, 2, "gemm"),
        (8, 8, (9, 9), 3, 8, "depthwise"),
    ]
    for j, (cin, cout, size, k, groups, variant) in enumerate(cases):
        x = signed_input((batch, cin) + size, j)
        w = signed_input((cout, cin // groups, k, k), j + 1)
        scale = signed_input((gate_images, cin, 1, 1), j + 2)
        attrs = dict(stride=(1, 1), pads=(k // 2,) * 4, dilation=(1, 1), groups=groups, padding_mode="zeros")
        for b, expr in ((None, ""), (signed_input((cout,), j + 3), "maximum(@0,0)")):
            pre = F.conv2d(
                torch.from_numpy(x * scale),
                torch.from_numpy(w),
                None if b is None else torch.from_numpy(b),
                padding=k // 2,
                groups=groups,
            )
            (got,) = run_kernel("conv", [x, w, b, scale], attrs, expr=expr, variant=variant, threads=two_threads)
            assert_close(got, activation(pre, expr), pre)
            assert np.array_equal(scale, signed_input(scale.shape, j + 2)), "the gate was written to"


def test_conv_input_scale_may_be_a_strided_view():
    """A gate read through a view (every other channel of a wider tensor) scales the
    weights without a copy at bind time, which would freeze its first values."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get

    x, w = signed_input((2, 8, 5, 5), 0), signed_input((6, 8, 1, 1), 1)
    wide = signed_input((2, 16, 1, 1), 2)
    gate, out = wide[:, ::2], np.full((2, 6, 5, 5), np.nan, np.float32)
    attrs = dict(stride=(1, 1), pads=(0, 0, 0, 0), dilation=(1, 1), groups=1, padding_mode="zeros")
    run = get("conv").make(KernelNode("conv", attrs, "", "gemm"), [x, w, None, gate], [out], bind_context())
    for seed in (3, 4):  # new gate values between runs must be used
        wide[...] = signed_input(wide.shape, seed)
        run()
        assert_close(out, F.conv2d(torch.from_numpy(x * gate), torch.from_numpy(w)))


def test_conv_input_scale_of_the_wrong_shape_names_it():
    x, w = signed_input((2, 4, 3, 3), 0), signed_input((5, 4, 1, 1), 1)
    attrs = dict(stride=(1, 1), pads=(0, 0, 0, 0), dilation=(1, 1), groups=1, padding_mode="zeros")
    for bad in (
        signed_input((2, 5, 1, 1), 2),
        signed_input((2, 4, 3, 1), 2),
        signed_input((3, 4, 1, 1), 2),
        signed_input((2, 4, 1, 1), 2).astype(np.float64),
    ):
        with pytest.raises(ValueError, match=r"input scale .* does not scale the channels of input"):
            run_kernel("conv", [x, w, None, bad], attrs)


def test_conv_input_scale_of_the_wrong_shape_in_a_file_names_the_node(tmp_path):
    """The conv shape rule checks the scale, so the loader refuses the file before any
    kernel binds: a damaged file (PmxFormatError) naming the node and the scale."""
    from pmx.compiler.ir import Graph, Node, Value
    from pmx.compiler.passes.order import order
    from pmx.compiler.passes.plan_memory import plan_memory
    from pmx.compiler.plan import PassContext
    from pmx.compiler.write import write
    from pmx.runtime import InferenceSession
    from pmx.runtime.errors import PmxFormatError

    g = Graph("t")
    x, gate, y = Value("x", (1, 4, 3, 3)), Value("gate", (1, 5, 1, 1)), Value("y", (1, 6, 3, 3))
    w = Value("w", (6, 4, 1, 1), data=signed_input((6, 4, 1, 1), 0))
    g.inputs, g.outputs = [x, gate], [y]
    g.add_node(
        Node(
            "conv",
            "gated_conv",
            [x, w, None, gate],
            [y],
            attrs=dict(stride=(1, 1), pads=(0, 0, 0, 0), dilation=(1, 1), groups=1, padding_mode="zeros"),
        )
    )
    ctx = PassContext()
    order(g, ctx)
    plan_memory(g, ctx)
    write(g, ctx.plan(g), ctx.options, str(tmp_path / "bad.pmx"), check_loads=False)  # a forged file
    with pytest.raises(
        PmxFormatError,
        match=r"node 0 \(conv 'gated_conv'\): .*ValueError: input scale "
        r"\(1, 5, 1, 1\) float32 does not scale the channels of input "
        r"\(1, 4, 3, 3\) float32: expected \(1, 4, 1, 1\)",
    ):
        InferenceSession(str(tmp_path / "bad.pmx"))


@pytest.fixture
def two_threads():
    """Kernels split work over the threads only above a size threshold and when more than
    one thread is configured: force two, whatever this machine has (a pool of two for
    run_kernel's threads)."""
    return kernel_pool(2)


@pytest.mark.parametrize(
    "kind", ["depthwise_s1", "depthwise_s2_dilated", "depthwise_reflect_s2", "gemm_3x3", "gemm_3x3_small_map"]
)
def test_conv_large_enough_to_split(kind, two_threads):
    """Shapes past parallel.SPLIT_MIN_ELEMENTS, so the channel-split depthwise parts and the
    split im2col copy run on two threads (the property test's shapes are too small). The
    3x3 GEMM runs as bands of output rows on a 48x48 map, and on a 14x14 map as banded
    im2col copies followed by a GEMM split by output channels."""
    from pmx.runtime import parallel
    from pmx.runtime.kernels import conv

    c, batch = 64, 2
    size = 14 if kind == "gemm_3x3_small_map" else 48
    stride, dilation, mode, groups = {
        "depthwise_s1": (1, 1, "zeros", c),
        "depthwise_s2_dilated": (2, 2, "zeros", c),
        "depthwise_reflect_s2": (2, 1, "reflect", c),
        "gemm_3x3": (1, 1, "zeros", 1),
        "gemm_3x3_small_map": (1, 1, "zeros", 1),
    }[kind]
    if groups == 1:
        assert c * c * 9 * size * size >= conv.gemm_split_minimum(False)
        assert conv._split_by_channels(2, groups, c, size * size) == (kind == "gemm_3x3_small_map")
    else:
        assert parallel.worth_splitting(batch * c * (size // stride) ** 2, two_threads.threads)
    x = signed_input((batch, c, size, size), 0)
    w = signed_input((c, c // groups, 3, 3), 1)
    b = signed_input((c,), 2)
    pads = (dilation, dilation, dilation, dilation)
    attrs = dict(stride=(stride, stride), pads=pads, dilation=(dilation, dilation), groups=groups, padding_mode=mode)
    xt = F.pad(torch.from_numpy(x), (dilation,) * 4, mode="constant" if mode == "zeros" else mode)
    want = F.conv2d(xt, torch.from_numpy(w), torch.from_numpy(b), stride, 0, dilation, groups)
    for variant in ("depthwise", "gemm") if groups > 1 else ("gemm",):
        (got,) = run_kernel("conv", [x, w, b], attrs, expr="maximum(@0,0)", variant=variant, threads=two_threads)
        assert_close(got, F.relu(want), want)


@st.composite
def flat_depthwise_case(draw):
    """Depthwise convs the flat lowering takes (stride 1, zero padding, at most 3 taps
    wide, output rows as wide as the input's): every split of the row padding, so taps
    wrap past either row end; any height, vertical padding and dilation."""
    kw = draw(st.integers(1, 3))
    left = draw(st.integers(0, kw - 1))
    kh, dh = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    top, bottom = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    height = max(draw(st.integers(1, 10)), dh * (kh - 1) + 1 - top - bottom)
    return dict(
        batch=draw(st.integers(1, 3)),
        c=draw(st.integers(1, 12)),
        size=(height, draw(st.integers(1, 10))),
        k=(kh, kw),
        dilation=(dh, 1),
        pads=(top, left, bottom, kw - 1 - left),
        block=draw(st.integers(1, 5)),
        bias=draw(st.booleans()),
        act=draw(st.sampled_from(["", "maximum(@0,0)"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@FAST
@given(flat_depthwise_case())
def test_flat_depthwise_matches_torch(c):
    """The flat lowering zeroes the columns a tap reads across a row's end; blocks of a
    few channels, so the zeroed views of every block are exercised. Two runs with
    different inputs, as an InferenceSession makes: the columns are scratch, dirty from the run
    before, so the zeroing must happen on every run."""
    from helpers import KernelNode

    from pmx.runtime.kernels import conv
    from pmx.runtime.kernels.registry import get

    w = signed_input((c["c"], 1) + c["k"], c["seed"] + 1)
    b = signed_input((c["c"],), c["seed"] + 2) if c["bias"] else None
    attrs = dict(stride=(1, 1), pads=c["pads"], dilation=c["dilation"], groups=c["c"], padding_mode="zeros")
    top, left, bottom, right = c["pads"]

    def torch_conv(x):
        xt = F.pad(torch.from_numpy(x), (left, right, top, bottom))
        return F.conv2d(
            xt, torch.from_numpy(w), None if b is None else torch.from_numpy(b), 1, 0, c["dilation"], c["c"]
        )

    x = signed_input((c["batch"], c["c"]) + c["size"], c["seed"])
    out = np.full(tuple(torch_conv(x).shape), np.nan, np.float32)
    g = conv._depthwise_geometry(x, w, out, attrs)
    assert isinstance(g, conv._Flat)
    before = conv.DEPTHWISE_BLOCK_BYTES
    conv.DEPTHWISE_BLOCK_BYTES = c["block"] * len(g.taps) * g.length * x.itemsize
    try:
        run = get("conv").make(
            KernelNode("conv", attrs, c["act"], "depthwise"),
            [x, w] + ([b] if b is not None else []),
            [out],
            bind_context(),
        )
    finally:
        conv.DEPTHWISE_BLOCK_BYTES = before
    for seed in (c["seed"], c["seed"] + 3):
        x[...] = signed_input(x.shape, seed) + 1  # all nonzero: a missed zero shows
        run()
        pre = torch_conv(x)
        assert_close(out, activation(pre, c["act"]), pre)


def test_depthwise_conv3d_matches_torch():
    """The phase-split depthwise lowering is written for any number of spatial dims."""
    x = signed_input((2, 5, 7, 8, 9), 0)
    w = signed_input((5, 1, 3, 2, 3), 1)
    attrs = dict(stride=(2, 1, 2), pads=(1, 0, 2, 1, 1, 0), dilation=(1, 2, 1), groups=5, padding_mode="zeros")
    xt = F.pad(torch.from_numpy(x), (2, 0, 0, 1, 1, 1))
    want = F.conv3d(xt, torch.from_numpy(w), None, (2, 1, 2), 0, (1, 2, 1), 5)
    (got,) = run_kernel("conv", [x, w], attrs, variant="depthwise")
    assert_close(got, want)


@st.composite
def depthwise_block_case(draw):
    """Depthwise convs with the im2col block shrunk to a few channels, so a channel range
    runs as several blocks (a last one shorter) and every block reads its own slice."""
    nd = draw(st.sampled_from([1, 2, 2]))
    c = draw(st.integers(2, 9))
    k = tuple(draw(st.integers(1, 5)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    pads = tuple(draw(st.integers(0, 2)) for _ in range(2 * nd))
    size = tuple(
        max(draw(st.integers(1, 12)), dilation[i] * (k[i] - 1) + 1 - pads[i] - pads[nd + i]) for i in range(nd)
    )
    return dict(
        nd=nd,
        c=c,
        k=k,
        stride=stride,
        dilation=dilation,
        pads=pads,
        size=size,
        batch=draw(st.integers(1, 3)),
        block=draw(st.integers(1, 4)),
        bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@FAST
@given(depthwise_block_case())
def test_depthwise_channel_blocks_match_torch(c):
    from pmx.runtime.kernels import conv

    nd = c["nd"]
    x = signed_input((c["batch"], c["c"]) + c["size"], c["seed"])
    w = signed_input((c["c"], 1) + c["k"], c["seed"] + 1)
    b = signed_input((c["c"],), c["seed"] + 2) if c["bias"] else None
    attrs = dict(stride=c["stride"], pads=c["pads"], dilation=c["dilation"], groups=c["c"], padding_mode="zeros")
    out_spatial = tuple(
        conv.conv_out_size(c["size"][i], c["k"][i], c["stride"][i], c["dilation"][i], c["pads"][i], c["pads"][nd + i])
        for i in range(nd)
    )
    g = conv._depthwise_geometry(x, w, np.empty((c["batch"], c["c"]) + out_spatial, np.float32), attrs)
    before = conv.DEPTHWISE_BLOCK_BYTES
    conv.DEPTHWISE_BLOCK_BYTES = c["block"] * len(g.taps) * g.length * x.itemsize
    try:
        (got,) = run_kernel("conv", [x, w] + ([b] if b is not None else []), attrs, variant="depthwise_1t")
    finally:
        conv.DEPTHWISE_BLOCK_BYTES = before
    pad = []
    for i in reversed(range(nd)):
        pad += [c["pads"][i], c["pads"][nd + i]]
    xt = F.pad(torch.from_numpy(x), pad)
    fn = F.conv1d if nd == 1 else F.conv2d
    bt = None if b is None else torch.from_numpy(b)
    want = fn(xt, torch.from_numpy(w), bt, c["stride"], 0, c["dilation"], c["c"])
    assert_close(got, want)


@pytest.mark.parametrize(
    "case",
    [
        ("depthwise", 16, 16, 96, 3, 1),  # flat lowering
        ("depthwise", 16, 16, 96, 3, 2),  # stride phases
        ("gemm", 3, 16, 224, 3, 2),  # im2col bands (a stem conv)
        ("gemm", 16, 24, 112, 1, 1),  # pointwise
    ],
)
def test_conv_on_a_batch_of_large_images_matches_torch(case, two_threads):
    """Images past CONV_IMAGE_BYTES at the bound as it ships: the batch runs image by
    image, for each way a conv lowers, on one thread and split over two."""
    from pmx.runtime.kernels import conv

    variant, c_in, c_out, size, k, stride = case
    groups = c_in if variant == "depthwise" else 1
    x = signed_input((2, c_in, size, size), 0)
    w, b = signed_input((c_out, c_in // groups, k, k), 1), signed_input((c_out,), 2)
    pad = k // 2
    attrs = dict(stride=(stride, stride), pads=(pad,) * 4, dilation=(1, 1), groups=groups, padding_mode="zeros")
    want = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), stride, pad, 1, groups)
    assert conv._image_by_image(x, want.numpy())
    for threads in (1, two_threads):
        (got,) = run_kernel("conv", [x, w, b], attrs, "maximum(@0,0)", variant, threads)
        assert_close(got, F.relu(want), want)


@FAST
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 40),
    st.integers(1, 40),
    st.booleans(),
    st.sampled_from(["", "maximum(@0,0)", "mul(@0,sigmoid(@0))"]),
    st.integers(0, 2**32 - 1),
)
def test_conv_1x1_on_one_position_matches_torch(nd, batch, cin, cout, bias, act, seed):
    """Squeeze-and-excitation convs (1x1 kernel, one position): the np.dot path, for one
    image and for a batch, in 1-d, 2-d and 3-d."""
    x = signed_input((batch, cin) + (1,) * nd, seed)
    w = signed_input((cout, cin) + (1,) * nd, seed + 1)
    b = signed_input((cout,), seed + 2) if bias else None
    attrs = dict(stride=(1,) * nd, pads=(0,) * (2 * nd), dilation=(1,) * nd, groups=1, padding_mode="zeros")
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    pre = fn(torch.from_numpy(x), torch.from_numpy(w), None if b is None else torch.from_numpy(b))
    for variant in ("gemm", "gemm_1t"):
        (got,) = run_kernel("conv", [x, w] + ([b] if bias else []), attrs, expr=act, variant=variant)
        assert_close(got, activation(pre, act), pre)


def test_conv_1x1_on_one_position_into_a_concat_slice():
    """A batch's output that is a channel slice of a concat buffer is not C-contiguous:
    the product must land in the slice, the neighbouring channels untouched."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get

    x = signed_input((3, 6, 1, 1), 0)
    w = signed_input((4, 6, 1, 1), 1)
    b = signed_input((4,), 2)
    attrs = dict(stride=(1, 1), pads=(0,) * 4, dilation=(1, 1), groups=1, padding_mode="zeros")
    concat = np.full((3, 10, 1, 1), 7.0, np.float32)
    out = concat[:, 3:7]
    assert not out.flags.c_contiguous
    get("conv").make(KernelNode("conv", attrs, variant="gemm"), [x, w, b], [out], bind_context())()
    assert_close(out, F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b)))
    assert (concat[:, :3] == 7).all() and (concat[:, 7:] == 7).all()


# --- strided copies ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["phase", "transposed", "rows", "window"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@FAST
@given(data=st.data())
def test_row_and_pair_copies_equal_numpy(kind, dtype, data):
    """copy_rows (rows as void items) and copy_strided (every other item read as the low
    half of a pair) against np.copyto: row-strided and every-other-item sources, transposed
    and window views given their owner, float32/float16/float64 (no pair type: rows), and
    sources whose last pair would read past their owner (copy_strided must not)."""
    from numpy.lib.stride_tricks import as_strided

    from pmx.runtime.kernels.common import copy_rows, copy_strided

    shape = tuple(data.draw(st.integers(1, 7)) for _ in range(4))
    owner = signed_input(shape, data.draw(st.integers(0, 2**32 - 1))).astype(dtype)
    a, b = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    if kind == "phase":  # ends at the owner's last item when a, b = 1 and the sizes are even
        src = owner[:, :, a::2, b::2]
    elif kind == "transposed":
        src = owner[:, :, a::2, b::2].transpose(1, 0, 2, 3)
    elif kind == "rows":
        src = owner[:, :, :, b:]
    else:  # a stride-2 im2col window of one image: (C, kh, kw, out rows, out cols)
        k, s = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
        c, h, w = owner.shape[1:]
        assume(h >= k and w >= k)
        st_ = owner[0].strides
        src = as_strided(
            owner[0],
            (c, k, k, (h - k) // s + 1, (w - k) // 2 + 1),
            st_[:2] + (st_[2], s * st_[1], 2 * st_[2]),
            writeable=False,
        )
    for copy in (copy_rows, copy_strided):
        dst = np.full(src.shape, np.nan, dtype)
        copy(dst, src, owner)() if copy is copy_strided else copy(dst, src)()
        np.testing.assert_array_equal(dst, src)


# --- pooling --------------------------------------------------------------------------------


@st.composite
def pool_case(draw, kind):
    nd = 2
    k = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd)) if kind == "max" else (1, 1)
    pad = tuple(draw(st.integers(0, kk // 2)) for kk in k)
    size = tuple(draw(st.integers(1, 10)) for _ in range(nd))
    size = tuple(max(s, d * (kk - 1) + 1 - 2 * p) for s, d, kk, p in zip(size, dilation, k, pad))
    return dict(
        k=k,
        stride=stride,
        dilation=dilation,
        pad=pad,
        size=size,
        ceil_mode=draw(st.booleans()),
        count_include_pad=draw(st.booleans()),
        divisor=draw(st.sampled_from([0, 0, 0, 1, 3, 7])),
        batch=draw(st.integers(1, 3)),
        channels=draw(st.integers(1, 4)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _pool_attrs(c, kind):
    a = dict(
        kernel=c["k"], stride=c["stride"], pads=c["pad"] + c["pad"], dilation=c["dilation"], ceil_mode=c["ceil_mode"]
    )
    if kind == "avg":
        a.update(count_include_pad=c["count_include_pad"], divisor_override=c["divisor"])
    return a


@FAST
@given(pool_case("max"))
def test_max_pool_matches_torch(c):
    x = signed_input((c["batch"], c["channels"]) + c["size"], c["seed"])
    want = F.max_pool2d(torch.from_numpy(x), c["k"], c["stride"], c["pad"], c["dilation"], ceil_mode=c["ceil_mode"])
    (got,) = run_kernel("max_pool", [x], _pool_attrs(c, "max"))
    assert_close(got, want)


@FAST
@given(st.integers(2, 3), st.data())
def test_stride_one_max_pool_matches_torch(nd, data):
    """Stride-1 max pools run separably (row maxima, then their maxima): 2-d and 3-d, any
    kernel from 1 to 5 per axis, dilation, padding, ceil mode, batches; some inputs carry
    NaN and -inf, which torch's max propagates too. Maxima are exact, so the comparison
    is exact."""
    k = tuple(data.draw(st.integers(1, 5)) for _ in range(nd))
    dilation = tuple(data.draw(st.integers(1, 2)) for _ in range(nd))
    pad = tuple(data.draw(st.integers(0, kk // 2)) for kk in k)
    size = tuple(max(data.draw(st.integers(1, 9)), d * (kk - 1) + 1 - 2 * p) for kk, d, p in zip(k, dilation, pad))
    ceil_mode = data.draw(st.booleans())
    batch, channels = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 5))
    x = signed_input((batch, channels) + size, data.draw(st.integers(0, 2**32 - 1)))
    if data.draw(st.booleans()):
        x.flat[data.draw(st.integers(0, x.size - 1))] = np.nan
        x.flat[data.draw(st.integers(0, x.size - 1))] = -np.inf
    pool = F.max_pool2d if nd == 2 else F.max_pool3d
    want = pool(torch.from_numpy(x), k, 1, pad, dilation, ceil_mode=ceil_mode).numpy()
    a = dict(kernel=k, stride=(1,) * nd, pads=pad + pad, dilation=dilation, ceil_mode=ceil_mode)
    (got,) = run_kernel("max_pool", [x], a)
    np.testing.assert_array_equal(got, want)


@FAST
@given(st.data())
def test_width_stride_two_max_pool_matches_torch(data):
    """2-d max pools with stride 2 along the width split the columns by casting pairs of
    items (pool._ColumnPairs; odd widths through a copy one column wider): any row
    stride, kernel, dilation, padding, ceil mode, float32 and float16, NaN and -inf, and
    channels split over two threads (parts of one channel up), each part's flat ranges
    crossing channel boundaries. Maxima are exact, so the comparison is exact."""
    from unittest import mock

    from pmx.runtime import parallel
    from pmx.runtime.kernels.pool import _ColumnPairs

    k = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4)))
    stride = (data.draw(st.integers(1, 3)), 2)
    dilation = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)))
    pad = tuple(data.draw(st.integers(0, kk // 2)) for kk in k)
    height = max(data.draw(st.integers(1, 9)), dilation[0] * (k[0] - 1) + 1 - 2 * pad[0])
    width = max(data.draw(st.integers(1, 12)), dilation[1] * (k[1] - 1) + 1 - 2 * pad[1])
    dtype = data.draw(st.sampled_from([np.float32, np.float16]))
    x = signed_input(
        (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)), height, width),
        data.draw(st.integers(0, 2**32 - 1)),
    ).astype(dtype)
    if data.draw(st.booleans()):
        x.flat[data.draw(st.integers(0, x.size - 1))] = np.nan
        x.flat[data.draw(st.integers(0, x.size - 1))] = -np.inf
    ceil_mode = data.draw(st.booleans())
    want = F.max_pool2d(torch.from_numpy(x.astype(np.float32)), k, stride, pad, dilation, ceil_mode=ceil_mode)
    want = want.numpy().astype(dtype)
    assume(want.shape[-1] <= (width + 1) // 2)  # wider outputs keep the phase path
    a = dict(kernel=k, stride=stride, pads=pad + pad, dilation=dilation, ceil_mode=ceil_mode)
    assert _ColumnPairs.of(x, want, a) is not None
    with mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1):
        (got,) = run_kernel("max_pool", [x], a, threads=data.draw(st.sampled_from([1, 2])))
    np.testing.assert_array_equal(got, want)


@FAST
@given(st.data())
def test_width_stride_two_avg_pool_matches_torch(data):
    """2-d average pools with stride 2 along the width sum through the max pool's column
    pairs (pool._ColumnPairs with np.add; odd widths through a copy one column wider
    whose last column is zero): any row stride, kernel, padding, ceil mode,
    count_include_pad and divisor override, float32 and float16, NaN and infinities, and
    channels split over two threads with each part's flat ranges crossing channels.
    float16 sums round once per tap, so it is held to that against torch's float32."""
    from unittest import mock

    from pmx.runtime import parallel
    from pmx.runtime.kernels.pool import _ColumnPairs

    k = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4)))
    stride = (data.draw(st.integers(1, 3)), 2)
    pad = tuple(data.draw(st.integers(0, kk // 2)) for kk in k)
    height = max(data.draw(st.integers(1, 9)), k[0] - 2 * pad[0])
    width = max(data.draw(st.integers(1, 12)), k[1] - 2 * pad[1])
    dtype = data.draw(st.sampled_from([np.float32, np.float16]))
    x = signed_input(
        (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)), height, width),
        data.draw(st.integers(0, 2**32 - 1)),
    ).astype(dtype)
    if data.draw(st.booleans()):
        x.flat[data.draw(st.integers(0, x.size - 1))] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    ceil_mode, include_pad = data.draw(st.booleans()), data.draw(st.booleans())
    divisor = data.draw(st.sampled_from([0, 0, 1, 3, 7]))
    want = F.avg_pool2d(
        torch.from_numpy(x.astype(np.float32)),
        k,
        stride,
        pad,
        ceil_mode=ceil_mode,
        count_include_pad=include_pad,
        divisor_override=divisor or None,
    ).numpy()
    assume(want.shape[-1] <= (width + 1) // 2)  # wider outputs keep the strided views
    a = dict(
        kernel=k,
        stride=stride,
        pads=pad + pad,
        dilation=(1, 1),
        ceil_mode=ceil_mode,
        count_include_pad=include_pad,
        divisor_override=divisor,
    )
    assert _ColumnPairs.of(x, want.astype(dtype), a) is not None
    with mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1):
        (got,) = run_kernel("avg_pool", [x], a, threads=data.draw(st.sampled_from([1, 2])))
    assert got.dtype == dtype
    if dtype == np.float32:
        assert_close(got, want)
        return
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    bound = (k[0] * k[1] + 1) * 2.0**-11 * max(float(np.abs(x[np.isfinite(x)]).max(initial=0)), 1.0)
    assert np.abs(got[finite].astype(np.float32) - want[finite]).max(initial=0) <= bound


@FAST
@given(pool_case("avg"), st.sampled_from([1, 2]))
def test_avg_pool_matches_torch(c, threads):
    """Any stride: sums over the phase-split input (pool._phase_pool, separable at stride
    1) or, at stride 2 along the width, column pairs, with the channels split over one or
    two threads."""
    from unittest import mock

    from pmx.runtime import parallel

    x = signed_input((c["batch"], c["channels"]) + c["size"], c["seed"])
    want = F.avg_pool2d(
        torch.from_numpy(x),
        c["k"],
        c["stride"],
        c["pad"],
        ceil_mode=c["ceil_mode"],
        count_include_pad=c["count_include_pad"],
        divisor_override=c["divisor"] or None,
    )
    with mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1):
        (got,) = run_kernel("avg_pool", [x], _pool_attrs(c, "avg"), threads=threads)
    assert_close(got, want)


@FAST
@given(st.data())
def test_same_size_stride_one_pools_match_torch(data):
    """Stride-1 pools whose output is as large as the input run on it as it is, with
    shifted flat slices and the border columns and rows computed again
    (pool._same_size_pool): kernels 1-5 per axis, max pools dilated too, pads split
    unevenly between the two ends (torch's oracle pads explicitly: -inf for maxima,
    zeros for averages counting the padding; symmetric ones not counting it), batches,
    NaN and -inf, and the channels split over one or two threads."""
    from unittest import mock

    from pmx.runtime import parallel
    from pmx.runtime.kernels.pool import _same_size_stride_one

    kind = data.draw(st.sampled_from(["max", "avg", "avg_exclude"]))
    k = (data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5)))
    dil = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))) if kind == "max" else (1, 1)
    if kind == "avg_exclude":
        k = tuple(kk | 1 for kk in k)  # odd: torch pads both ends alike
        begins = tuple((kk - 1) // 2 for kk in k)
    else:
        begins = tuple(data.draw(st.integers(0, d * (kk - 1))) for kk, d in zip(k, dil))
    ends = tuple(d * (kk - 1) - b for kk, d, b in zip(k, dil, begins))
    x = signed_input(
        (
            data.draw(st.integers(1, 3)),
            data.draw(st.integers(1, 6)),
            data.draw(st.integers(1, 9)),
            data.draw(st.integers(1, 9)),
        ),
        data.draw(st.integers(0, 2**32 - 1)),
    )
    if kind == "max" and data.draw(st.booleans()):
        x.flat[data.draw(st.integers(0, x.size - 1))] = np.nan
        x.flat[data.draw(st.integers(0, x.size - 1))] = -np.inf
    t = torch.from_numpy(x)
    padding = (begins[1], ends[1], begins[0], ends[0])
    if kind == "max":
        want = F.max_pool2d(F.pad(t, padding, value=-math.inf), k, 1, 0, dil)
    elif kind == "avg":
        want = F.avg_pool2d(F.pad(t, padding), k, 1, 0)
    else:
        want = F.avg_pool2d(t, k, 1, begins, count_include_pad=False)
    a = dict(
        kernel=k,
        stride=(1, 1),
        pads=begins + ends,
        dilation=dil,
        ceil_mode=False,
        count_include_pad=kind == "avg",
        divisor_override=0,
    )
    assert _same_size_stride_one(x, want.numpy(), a)
    with mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1):
        (got,) = run_kernel(
            "max_pool" if kind == "max" else "avg_pool", [x], a, threads=data.draw(st.sampled_from([1, 2]))
        )
    if kind == "max":
        np.testing.assert_array_equal(got, want.numpy())
    else:
        assert_close(got, want)


@pytest.mark.parametrize("kernel,stride", [(2, 1), (3, 3)])
def test_max_and_avg_pools_of_one_geometry_keep_their_own_padding(kernel, stride):
    """Pools on the phase path take their padded buffer from the shared scratch, whose
    border each run rewrites (common.restore_stale): the lowest value for a max pool,
    zero for an average pool, so one must not see the other's. Both bound with one
    context, over scratch full of float32 max (whatever an earlier node left), then run
    in turn, twice."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get, node_scratch_nbytes

    x = signed_input((1, 3, 9, 9), 3)
    a = dict(
        kernel=(kernel, kernel),
        stride=(stride, stride),
        pads=(1, 1, 1, 1),
        dilation=(1, 1),
        ceil_mode=False,
        count_include_pad=True,
        divisor_override=0,
    )
    out_shape = F.max_pool2d(torch.from_numpy(x), kernel, stride, 1).shape
    outs = {op: np.empty(out_shape, np.float32) for op in ("max_pool", "avg_pool")}
    nodes = {op: KernelNode(op, a) for op in outs}
    scratch = np.full(
        max(node_scratch_nbytes(nodes[op], [x], [outs[op]], bind_context()) for op in outs) // 4 + 16,
        np.finfo(np.float32).max,
        np.float32,
    )
    ctx = bind_context(None, scratch.view(np.uint8), {})
    runs = []
    for op in ("max_pool", "avg_pool"):
        runs.append(get(op).make(nodes[op], [x], [outs[op]], ctx.begin_node()))
    for _ in range(2):
        for run in runs:
            run()
    np.testing.assert_array_equal(outs["max_pool"], F.max_pool2d(torch.from_numpy(x), kernel, stride, 1).numpy())
    assert_close(outs["avg_pool"], F.avg_pool2d(torch.from_numpy(x), kernel, stride, 1))


@FAST
@given(st.data())
def test_unbatched_avg_pool_matches_torch(data):
    """A (C, H, W) input without a batch axis takes the strided-view sums."""
    k, s = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    pad = data.draw(st.integers(0, k // 2))
    h, w = data.draw(st.integers(k, 9)), data.draw(st.integers(k, 9))
    ceil_mode, include_pad = data.draw(st.booleans()), data.draw(st.booleans())
    x = signed_input((4, h, w), data.draw(st.integers(0, 2**32 - 1)))
    a = dict(
        kernel=(k, k),
        stride=(s, s),
        pads=(pad,) * 4,
        dilation=(1, 1),
        ceil_mode=ceil_mode,
        count_include_pad=include_pad,
        divisor_override=0,
    )
    (got,) = run_kernel("avg_pool", [x], a)
    assert_close(got, F.avg_pool2d(torch.from_numpy(x), k, s, pad, ceil_mode=ceil_mode, count_include_pad=include_pad))


@FAST
@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 3), st.booleans(), st.integers(0, 2**32 - 1))
def test_pool_1d_matches_torch(n, k, s, ceil_mode, seed):
    x = signed_input((2, 3, n + k), seed)
    a = dict(kernel=(k,), stride=(s,), pads=(k // 2, k // 2), dilation=(1,), ceil_mode=ceil_mode)
    (got,) = run_kernel("max_pool", [x], a)
    assert_close(got, F.max_pool1d(torch.from_numpy(x), k, s, k // 2, ceil_mode=ceil_mode))
    a.update(count_include_pad=False, divisor_override=0)
    (got,) = run_kernel("avg_pool", [x], a)
    assert_close(got, F.avg_pool1d(torch.from_numpy(x), k, s, k // 2, ceil_mode=ceil_mode, count_include_pad=False))


@FAST
@given(
    st.integers(1, 12),
    st.integers(1, 12),
    st.integers(1, 14),
    st.integers(1, 14),
    st.integers(1, 3),
    st.integers(0, 2**32 - 1),
)
def test_adaptive_pools_match_torch(h, w, oh, ow, batch, seed):
    x = signed_input((batch, 3, h, w), seed)
    xt = torch.from_numpy(x)
    (got,) = run_kernel("adaptive_avg_pool", [x], dict(output_size=(oh, ow)))
    assert_close(got, F.adaptive_avg_pool2d(xt, (oh, ow)))
    (got,) = run_kernel("adaptive_max_pool", [x], dict(output_size=(oh, ow)))
    assert_close(got, F.adaptive_max_pool2d(xt, (oh, ow)))


@pytest.mark.parametrize(
    "size,out", [((7, 7), (3, 5)), ((7, 7), (1, 1)), ((8, 6), (4, 3)), ((5, 9), (5, 2)), ((3, 4), (6, 8))]
)
def test_adaptive_pool_corners(size, out):
    """Global pooling, exact divisions (the reshape path) and upsampling-like bins."""
    x = signed_input((1, 2) + size, 7)
    xt = torch.from_numpy(x)
    (got,) = run_kernel("adaptive_avg_pool", [x], dict(output_size=out))
    assert_close(got, F.adaptive_avg_pool2d(xt, out))
    (got,) = run_kernel("adaptive_max_pool", [x], dict(output_size=out))
    assert_close(got, F.adaptive_max_pool2d(xt, out))


@FAST
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 5),
    st.lists(st.integers(1, 60), min_size=3, max_size=3),
    st.sampled_from([np.float32, np.float64]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
# a mean that cancels: [-0.718, 0.505, 0.209] (a GEMV with weights 1/3 was off by 1.1e-5)
@example(nd=1, batch=1, channels=1, sizes=[3, 1, 1], dtype=np.float32, strided=False, seed=501715)
def test_global_pools_match_torch(nd, batch, channels, sizes, dtype, strided, seed):
    """Adaptive pooling to one value per channel (squeeze-and-excitation, classifier
    heads): the GEMV / maximum.reduce path over a contiguous input, and the general
    reduction over a strided one. Means against float64 torch within TOL * mean|x| per
    channel: a mean that cancels is only as exact as that (float32 torch itself was
    7.5e-10 off -4.05e-5 on 270 signed values, pmx 9e-11: 1.6e-5 relative to the mean,
    over TOL, although pmx was the closer of the two). Maxima exactly."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get

    size = tuple(sizes[:nd]) if nd < 3 else tuple(s % 9 + 1 for s in sizes)
    x = signed_input((batch, channels) + size, seed).astype(dtype)
    src = x
    if strided:  # every other channel of a wider tensor
        wide = np.zeros((batch, 2 * channels) + size, dtype)
        wide[:, ::2] = x
        src = wide[:, ::2]
    xt = torch.from_numpy(x)
    avg = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)[nd - 1]
    mx = (F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d)[nd - 1]
    for op, ref in (("adaptive_avg_pool", avg), ("adaptive_max_pool", mx)):
        out = np.full((batch, channels) + (1,) * nd, np.nan, dtype)
        get(op).make(KernelNode(op, dict(output_size=(1,) * nd)), [src], [out], bind_context())()
        want = ref(xt.double(), (1,) * nd).numpy()
        if op == "adaptive_max_pool":
            np.testing.assert_array_equal(out, want.astype(dtype))
            continue
        bound = TOL * F.adaptive_avg_pool3d(xt.double().abs().reshape(batch, channels, 1, 1, -1), 1).numpy()
        assert np.all(np.abs(out - want) <= bound.reshape(want.shape)), np.abs(out - want).max()


@FAST
@given(
    st.sampled_from(["reduce_mean", "reduce_sum", "reduce_max", "reduce_min"]),
    st.integers(1, 3),
    st.integers(1, 40),
    st.integers(1, 40),
    st.sampled_from([np.float32, np.float64, np.int32]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_trailing_reductions_match_torch(op, batch, channels, side, dtype, keep, seed):
    """x.mean([2, 3]) and friends (ShuffleNet's head): reductions over the trailing axes
    of a contiguous tensor run as one GEMV / ufunc.reduce over its (rows, positions) view."""
    # torch.mean refuses integers; integer sums go to int64 (not this path)
    assume(not (dtype == np.int32 and op in ("reduce_mean", "reduce_sum")))
    x = signed_input((batch, channels, side, side + 1), seed)
    x = (x * 100).astype(dtype) if dtype == np.int32 else x.astype(dtype)
    fn = {"reduce_mean": torch.mean, "reduce_sum": torch.sum, "reduce_max": torch.amax, "reduce_min": torch.amin}[op]
    for axes in ((2, 3), (3,), (1, 2, 3)):
        (got,) = run_kernel(op, [x], dict(axes=axes, keepdim=keep))
        want = fn(torch.from_numpy(x).double() if dtype != np.int32 else torch.from_numpy(x), axes, keepdim=keep)
        want = want.numpy().astype(dtype)
        assert got.shape == want.shape and got.dtype == want.dtype
        if op == "reduce_sum":  # a sum is only as exact as eps * sum|x|
            scale = np.abs(x.astype(np.float64)).sum(axis=axes).max()
            assert np.abs(got.astype(np.float64) - want).max() <= TOL * scale
        else:
            assert_close(got, want)


@pytest.mark.parametrize("size", [(112, 112), (96, 128), (1, 4099), (2, 4099), (64, 64)])
def test_long_row_means_and_sums_match_torch(size):
    """Rows longer than one GEMV takes (ROWS_GEMV_MAX_LENGTH): cut into equal chunks
    (112x112 = 4 x 3136, 96x128 = 3 x 4096) whose sums are then added; lengths no chunk
    of 64 or more divides (4099 is prime, 8198 = 2 x 4099) take np.mean's float64 path.
    Float32 sums are only as exact as eps * sum|x|, so that is the bound."""
    from pmx.runtime.kernels.reduce import _chunked_sum

    x = signed_input((2, 3) + size, 11) + 0.25  # a bias, so a dropped chunk shows
    x2 = x.reshape(6, -1)
    assert (_chunked_sum(x2, np.empty(6, np.float32)) is None) == (size[1] == 4099)
    for op, fn in (("reduce_mean", torch.mean), ("reduce_sum", torch.sum)):
        (got,) = run_kernel(op, [x], dict(axes=(2, 3), keepdim=False))
        want = fn(torch.from_numpy(x).double(), (2, 3)).numpy()
        bound = 1e-6 * np.abs(x2.astype(np.float64)).sum(axis=1).reshape(2, 3)
        if op == "reduce_mean":
            bound /= x2.shape[1]
        assert np.all(np.abs(got - want) <= bound), (op, np.abs(got - want).max(), bound.min())
    (got,) = run_kernel("adaptive_avg_pool", [x], dict(output_size=(1, 1)))
    assert_close(got, F.adaptive_avg_pool2d(torch.from_numpy(x).double(), (1, 1)).numpy())


# --- linear and batch norm ------------------------------------------------------------------


@FAST
@given(
    st.lists(st.integers(1, 4), min_size=0, max_size=2),
    st.integers(1, 33),
    st.integers(1, 17),
    st.booleans(),
    st.sampled_from(["", "maximum(@0,0)"]),
    st.integers(0, 2**32 - 1),
)
def test_linear_matches_torch(lead, fin, fout, bias, act, seed):
    x = signed_input(tuple(lead) + (fin,), seed)
    w = signed_input((fout, fin), seed + 1)
    b = signed_input((fout,), seed + 2) if bias else None
    pre = F.linear(torch.from_numpy(x), torch.from_numpy(w), None if b is None else torch.from_numpy(b))
    (got,) = run_kernel("linear", [x, w] + ([b] if bias else []), expr=act)
    assert_close(got, activation(pre, act), pre)


@FAST
@given(
    st.integers(1, 3),
    st.integers(1, 8),
    st.lists(st.integers(1, 6), min_size=0, max_size=2),
    st.floats(1e-5, 1e-2),
    st.integers(0, 2**32 - 1),
)
def test_batch_norm_matches_torch(n, c, spatial, eps, seed):
    rng = np.random.default_rng(seed)
    x = signed_input((n, c) + tuple(spatial), seed)
    mean = rng.normal(0, 0.5, c).astype(np.float32)
    var = rng.uniform(0.1, 2, c).astype(np.float32)
    gamma = rng.normal(0, 1, c).astype(np.float32)
    beta = rng.normal(0, 1, c).astype(np.float32)
    # the scale/shift folding done by compiler/canon/norm.py
    scale = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + eps)
    shift = beta - mean.astype(np.float64) * scale
    (got,) = run_kernel("batch_norm", [x, scale.astype(np.float32), shift.astype(np.float32)])
    t = [torch.from_numpy(a) for a in (x, mean, var, gamma, beta)]
    assert_close(got, F.batch_norm(t[0], t[1], t[2], t[3], t[4], training=False, eps=eps))


def test_conv3d_gemm_split_in_row_bands(two_threads):
    """A 3-d conv big enough to run as bands of output rows on two threads (each band
    builds its own im2col columns along the first spatial axis)."""
    x = signed_input((1, 8, 12, 20, 20), 0)
    w = signed_input((16, 8, 3, 3, 3), 1)
    attrs = dict(stride=(1, 1, 1), pads=(1, 1, 1, 1, 1, 1), dilation=(1, 1, 1), groups=1, padding_mode="zeros")
    (got,) = run_kernel("conv", [x, w], attrs, variant="gemm", threads=two_threads)
    assert_close(got, F.conv3d(torch.from_numpy(x), torch.from_numpy(w), padding=1))


@pytest.mark.parametrize("case", ["split_2d_ceil", "split_3d", "unbatched_2d", "int32_dilated"])
def test_max_pool_phase_paths(case, two_threads):
    """The phase-split max pool beyond the property test's small float shapes: big enough
    to split channels over two threads (2-d with ceil_mode, 3-d), an unbatched input (no
    channel axis: strided views), and integers (the padding is the dtype's minimum)."""
    from pmx.runtime import parallel

    if case == "split_2d_ceil":
        x, k, s, p, d, ceil = signed_input((2, 64, 45, 45), 0), (3, 3), (2, 2), (1, 1), (1, 1), True
        assert parallel.worth_splitting(2 * 64 * 23 * 23 * 9, two_threads.threads)
        want = F.max_pool2d(torch.from_numpy(x), k, s, p, d, ceil_mode=ceil)
    elif case == "split_3d":
        x, k, s, p, d, ceil = signed_input((1, 32, 12, 20, 20), 1), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), False
        want = F.max_pool3d(torch.from_numpy(x), k, s, p, d)
    elif case == "unbatched_2d":
        x, k, s, p, d, ceil = signed_input((5, 9, 8), 2), (3, 2), (2, 1), (1, 1), (1, 1), True
        want = F.max_pool2d(torch.from_numpy(x), k, s, p, d, ceil_mode=ceil)
    else:
        x = (signed_input((2, 3, 11, 10), 3) * 1000).astype(np.int32) - 2000
        k, s, p, d, ceil = (3, 3), (2, 1), (1, 1), (2, 2), False
        want = F.max_pool2d(torch.from_numpy(x).double(), k, s, p, d).numpy().astype(np.int32)
    attrs = dict(kernel=k, stride=s, pads=p + p, dilation=d, ceil_mode=ceil)
    (got,) = run_kernel("max_pool", [x], attrs, threads=two_threads)
    np.testing.assert_array_equal(got, _np(want))


# (input spatial, kernel, stride, dilation, pads): stride 1 along the rows and zero-type
# padding, off the flat depthwise path; asymmetric row pads both ways, pads beyond what
# the kernel reaches (rows then as long as the output's), a dilated row, 1-d and 3-d.
SHARED_PADDING_CASES = [
    ((6, 7), (3, 3), (1, 1), (1, 1), (1, 1, 1, 0)),
    ((6, 7), (3, 3), (1, 1), (1, 1), (0, 2, 2, 1)),
    ((7, 7), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2)),
    ((5, 9), (3, 5), (2, 1), (1, 1), (1, 3, 0, 1)),
    ((4, 6), (1, 2), (1, 1), (1, 1), (0, 3, 1, 3)),
    ((5, 8), (2, 3), (1, 1), (1, 2), (1, 0, 0, 3)),
    ((9,), (5,), (1,), (1,), (3, 1)),
    ((4, 5, 6), (3, 3, 3), (1, 2, 1), (1, 1, 1), (1, 0, 1, 1, 2, 0)),
]


@FAST
@given(st.lists(st.booleans(), min_size=1, max_size=60), st.integers(1, 3), st.booleans())
def test_stale_border_families_cover_exactly_the_marked_positions(mask, slots, strided):
    """runs_of turns a slot's mask into (start, period, count, length) families, and
    restore_stale writes its value at every family position of every slot: on the
    family path nothing else changes; where one fill of the whole slots is cheaper (the
    cost model picks), the copy that follows overwrites the rest anyway. Slots may be a
    strided view (a channel slice of a batched buffer)."""
    from unittest import mock

    from pmx.runtime.kernels import common

    mask = np.array(mask)
    families = common.runs_of(mask)
    covered = np.zeros(mask.size, int)
    for start, period, count, length in families:
        for k in range(count):
            covered[start + k * period : start + k * period + length] += 1
    np.testing.assert_array_equal(covered, mask.astype(int))
    assert all(length > 0 and count > 0 for _, _, count, length in families)

    base = np.arange(2 * slots * mask.size, dtype=np.float32).reshape(2, slots, mask.size)
    view = base[:, ::2] if strided else base
    for force_whole in (False, True):
        buf = base.copy()
        target = buf[:, ::2] if strided else buf
        with mock.patch.object(common, "RESTORE_NS_PER_ITEM", 1e9 if not force_whole else 0.0):
            run = common.restore_stale(target, families, -7)
        if run is None:
            assert not mask.any()
            continue
        run()
        assert (target[..., mask] == -7).all()
        if not force_whole:
            np.testing.assert_array_equal(target[..., ~mask], view[..., ~mask])
        if strided:  # the slots between the view's stay as they were
            np.testing.assert_array_equal(buf[:, 1::2], base[:, 1::2])


@pytest.mark.parametrize("size, k, stride, dilation, pads", SHARED_PADDING_CASES)
def test_phase_rows_share_padding(size, k, stride, dilation, pads):
    """With stride 1 along the rows and zero (or lowest-value) padding, consecutive rows of
    the phase layout share their padding columns (common.Phases, shared_padding): each row
    holds the input row plus max(left, right) padding, or the output's width if that is
    more. Depthwise convs (zeros) and max pools (lowest value) against torch, with the
    padding written out by F.pad; a reflect-padded conv keeps full rows."""
    from pmx.runtime.kernels import conv, pool
    from pmx.runtime.kernels.common import Phases

    nd = len(size)
    x = signed_input((2, 3) + size, 7)
    w = signed_input((3, 1) + k, 8)
    pad = []
    for i in reversed(range(nd)):
        pad += [pads[i], pads[nd + i]]
    attrs = dict(stride=stride, pads=pads, dilation=dilation, groups=3, padding_mode="zeros")
    (got,) = run_kernel("conv", [x, w], attrs, variant="depthwise")
    xt = torch.from_numpy(x)
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    want = fn(F.pad(xt, pad), torch.from_numpy(w), None, stride, 0, dilation, 3)
    assert_close(got, want)
    g = conv._depthwise_geometry(x, w, got, attrs)
    row = max(size[-1] + max(pads[nd - 1], pads[-1]), got.shape[-1])
    assert isinstance(g, Phases) and g.rows[-1] == row

    pool_attrs = dict(kernel=k, stride=stride, pads=pads, dilation=dilation, ceil_mode=False)
    (got,) = run_kernel("max_pool", [x], pool_attrs)
    max_pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
    want = max_pool(F.pad(xt, pad, value=-np.inf), k, stride, 0, dilation)
    np.testing.assert_array_equal(got, _np(want))
    assert pool._pool_phases(x, got, pool_attrs).rows[-1] == row

    if nd == 2 and max(pads) < min(size):
        reflect = dict(attrs, padding_mode="reflect")
        (got,) = run_kernel("conv", [x, w], reflect, variant="depthwise")
        want = F.conv2d(F.pad(xt, pad, mode="reflect"), torch.from_numpy(w), None, stride, 0, dilation, 3)
        assert_close(got, want)
        assert conv._depthwise_geometry(x, w, got, reflect).rows[-1] == size[-1] + pads[1] + pads[3]


@st.composite
def row_stride_one_case(draw):
    """Geometries with stride 1 along the rows, which the property tests above mostly
    send down the flat depthwise path or give symmetric pads: any pads up to 4 on each
    side, kernels up to 5 wide, dilation, and any stride along the other dims."""
    nd = draw(st.sampled_from([1, 2, 2, 3]))
    k = tuple(draw(st.integers(1, 5)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd - 1)) + (1,)
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    pads = tuple(draw(st.integers(0, 4)) for _ in range(2 * nd))
    size = tuple(max(draw(st.integers(1, 9)), dilation[i] * (k[i] - 1) + 1 - pads[i] - pads[nd + i]) for i in range(nd))
    return dict(
        nd=nd,
        c=draw(st.integers(1, 4)),
        k=k,
        stride=stride,
        dilation=dilation,
        pads=pads,
        size=size,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@FAST
@given(row_stride_one_case())
def test_row_stride_one_depthwise_and_max_pool_match_torch(c):
    nd = c["nd"]
    x = signed_input((2, c["c"]) + c["size"], c["seed"])
    w = signed_input((c["c"], 1) + c["k"], c["seed"] + 1)
    pad = []
    for i in reversed(range(nd)):
        pad += [c["pads"][i], c["pads"][nd + i]]
    xt = torch.from_numpy(x)
    attrs = dict(stride=c["stride"], pads=c["pads"], dilation=c["dilation"], groups=c["c"], padding_mode="zeros")
    (got,) = run_kernel("conv", [x, w], attrs, variant="depthwise")
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    assert_close(got, fn(F.pad(xt, pad), torch.from_numpy(w), None, c["stride"], 0, c["dilation"], c["c"]))
    pool = dict(kernel=c["k"], stride=c["stride"], pads=c["pads"], dilation=c["dilation"], ceil_mode=False)
    (got,) = run_kernel("max_pool", [x], pool)
    max_pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
    np.testing.assert_array_equal(
        got, _np(max_pool(F.pad(xt, pad, value=-np.inf), c["k"], c["stride"], 0, c["dilation"]))
    )


HARDSWISH = "mul(@0,div(minimum(maximum(add(@0,3),0),6),6))"


@pytest.mark.parametrize(
    "kind", ["pointwise", "gemm_3x3_small_map", "gemm_3x3_bands", "depthwise", "winograd", "linear"]
)
def test_cheap_activation_runs_after_split_parts(kind, two_threads):
    """Kernels split over two threads whose output is below the elementwise split size run
    a cheap activation once on the whole output after their parts
    (common.epilogue_after_parts): every lowering that splits, against torch. Hardswish
    shows an activation applied twice or not at all."""
    from helpers import KernelNode

    from pmx.runtime.kernels import common
    from pmx.runtime.kernels.winograd import transform_weights

    cin, cout, size, k, groups = {
        "pointwise": (96, 576, 7, 1, 1),
        "gemm_3x3_small_map": (64, 64, 14, 3, 1),
        "gemm_3x3_bands": (64, 8, 48, 3, 1),
        "depthwise": (576, 576, 7, 5, 576),
        "winograd": (128, 64, 28, 3, 1),
        "linear": (512, 1000, 49, 0, 1),
    }[kind]
    x = signed_input((49, cin) if kind == "linear" else (1, cin, size, size), 0)
    w = signed_input((cout, cin) if kind == "linear" else (cout, cin // groups, k, k), 1)
    b = signed_input((cout,), 2)
    pad = k // 2
    attrs = dict(stride=(1, 1), pads=(pad,) * 4, dilation=(1, 1), groups=groups, padding_mode="zeros")
    if kind == "linear":
        (got,) = run_kernel("linear", [x, w, b], {}, expr=HARDSWISH, threads=two_threads)
        want = F.linear(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b))
    elif kind == "winograd":
        (got,) = run_kernel(
            "conv_winograd",
            [x, transform_weights(w), b],
            {"pads": attrs["pads"]},
            expr=HARDSWISH,
            variant="winograd",
            threads=two_threads,
        )
        want = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), padding=pad)
    else:
        variant = "depthwise" if kind == "depthwise" else "gemm"
        (got,) = run_kernel("conv", [x, w, b], attrs, expr=HARDSWISH, variant=variant, threads=two_threads)
        want = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), 1, pad, 1, groups)
    assert common.epilogue_after_parts(bind_context(two_threads), KernelNode("conv", {}, HARDSWISH, ""), got)
    assert_close(got, F.hardswish(want), want)


def test_which_activations_run_after_split_parts():
    """Cheap arithmetic on a tensor an elementwise node would not split runs after the
    parts; SiLU (exp) and big tensors stay in them."""
    from helpers import KernelNode

    from pmx.runtime import parallel
    from pmx.runtime.kernels import common

    small = np.empty(parallel.SPLIT_MIN_ELEMENTS - 1, np.float32)
    big = np.empty(parallel.SPLIT_MIN_ELEMENTS, np.float32)
    ctx = bind_context(kernel_pool(2, splits_gemms=None))
    for expr, want in [
        (HARDSWISH, True),
        ("maximum(@0,0)", True),
        ("minimum(maximum(@0,0),6)", True),
        ("mul(@0,sigmoid(@0))", False),
        ("div(@0,sub(-1,exp(@0)))", False),
        ("tanh(@0)", False),
        ("", False),
    ]:
        node = KernelNode("conv", {}, expr, "")
        assert common.epilogue_after_parts(ctx, node, small) == want, expr
        assert not common.epilogue_after_parts(ctx, node, big), expr
