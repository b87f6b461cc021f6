"""A batch is one computation: a kernel run on a batch of N images equals the N runs of
the same kernel on one image each (within 1e-5 of the largest value), and torch.

Kernels take a batch in other ways than one image (conv folds small maps' images into
its GEMM columns, a 1x1 conv runs one batched GEMM, a depthwise conv folds images into
its GEMV columns, each thread may take whole images), so every lowering is drawn here
with batches of 1-9, on one thread and on two, and with the fold's and Winograd's
chunk budgets shrunk so a batch runs as several chunks with a shorter last one.
"""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TORCH_PAD_MODE, kernel_pool, rel_error, run_kernel, signed_input
from hypothesis import given, settings
from hypothesis import strategies as st

TOL = 1e-5
FEW = settings(max_examples=20, deadline=None)


def assert_batch_equivalent(run, x, want):
    """run(x) for the batch against run(x[i:i+1]) for each image, and against torch's
    `want` (the activation's input scale is not needed: the tests use none or relu)."""
    batch = run(x)
    assert batch.shape == want.shape, f"shape {batch.shape} != torch {want.shape}"
    singles = np.concatenate([run(x[i : i + 1]) for i in range(x.shape[0])])
    finite = np.isfinite(want)
    np.testing.assert_array_equal(batch[~finite], want[~finite])
    np.testing.assert_array_equal(singles[~finite], want[~finite])
    err = rel_error(batch[finite], singles[finite])
    assert err <= TOL, f"batch against its images one by one: {err:.3g} > {TOL}"
    err = rel_error(batch[finite], want[finite])
    assert err <= TOL, f"batch against torch: {err:.3g} > {TOL}"


@contextlib.contextmanager
def budgets(small):
    """With `small`, the fold's and Winograd's per-chunk budgets a few images' worth, so
    batches run in several chunks (the last one shorter)."""
    from pmx.runtime.kernels import conv, winograd

    saved = conv.FOLD_COLUMNS_BYTES, winograd.CHUNK_SCRATCH_BYTES, conv.DEPTHWISE_BLOCK_BYTES
    if small:
        conv.FOLD_COLUMNS_BYTES, winograd.CHUNK_SCRATCH_BYTES, conv.DEPTHWISE_BLOCK_BYTES = 4096, 16384, 4096
    try:
        yield
    finally:
        conv.FOLD_COLUMNS_BYTES, winograd.CHUNK_SCRATCH_BYTES, conv.DEPTHWISE_BLOCK_BYTES = saved


@st.composite
def conv_case(draw):
    kind = draw(st.sampled_from(["gemm", "gemm", "pointwise", "depthwise", "depthwise", "grouped", "conv1d"]))
    nd = 1 if kind == "conv1d" else 2
    wide = draw(st.booleans())  # channels enough for the GEMMs to split over two threads
    if kind == "depthwise":
        groups = draw(st.integers(2, 40 if wide else 8))
        cin, cout = groups, groups
    elif kind == "grouped":
        groups = draw(st.sampled_from([2, 3]))
        cin, cout = groups * draw(st.integers(1, 6)), groups * draw(st.integers(1, 6))
    else:
        groups = 1
        cin, cout = draw(st.integers(1, 48 if wide else 6)), draw(st.integers(1, 64 if wide else 6))
    if kind == "pointwise":
        k, stride, dilation, pads, mode = (1,) * nd, (1,) * nd, (1,) * nd, (0,) * (2 * nd), "zeros"
    else:
        k = tuple(draw(st.integers(1, 5)) for _ in range(nd))
        stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
        dilation = tuple(draw(st.sampled_from([1, 1, 2])) for _ in range(nd))
        mode = draw(st.sampled_from(["zeros", "zeros", "zeros", "reflect", "replicate", "circular"]))
        pads = tuple(draw(st.integers(0, 2)) for _ in range(2 * nd))
    size = tuple(2 * draw(st.integers(0, 8)) + 1 for _ in range(nd))  # odd: 1-17
    size = tuple(
        max(s, dilation[i] * (k[i] - 1) + 1 - pads[i] - pads[nd + i], pads[i] + 1, pads[nd + i] + 1)
        for i, s in enumerate(size)
    )
    return dict(
        kind=kind,
        nd=nd,
        groups=groups,
        cin=cin,
        cout=cout,
        k=k,
        stride=stride,
        dilation=dilation,
        mode=mode,
        pads=pads,
        size=size,
        batch=draw(st.integers(1, 9)),
        bias=draw(st.booleans()),
        act=draw(st.sampled_from(["", "maximum(@0,0)"])),
        threads=draw(st.sampled_from([1, 2])),
        small=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=50, deadline=None)
@given(conv_case())
def test_conv_batch_equals_its_images(c):
    nd = c["nd"]
    x = signed_input((c["batch"], c["cin"]) + c["size"], c["seed"])
    w = signed_input((c["cout"], c["cin"] // c["groups"]) + c["k"], c["seed"] + 1)
    b = signed_input((c["cout"],), c["seed"] + 2) if c["bias"] else None
    attrs = dict(stride=c["stride"], pads=c["pads"], dilation=c["dilation"], groups=c["groups"], padding_mode=c["mode"])
    pad = []
    for i in reversed(range(nd)):
        pad += [c["pads"][i], c["pads"][nd + i]]
    xt = F.pad(torch.from_numpy(x), pad, mode=TORCH_PAD_MODE[c["mode"]])
    conv = F.conv1d if nd == 1 else F.conv2d
    bt = None if b is None else torch.from_numpy(b)
    want = conv(xt, torch.from_numpy(w), bt, c["stride"], 0, c["dilation"], c["groups"])
    want = (F.relu(want) if c["act"] else want).numpy()
    pool = kernel_pool(c["threads"])
    variants = ["gemm", "depthwise"] if c["kind"] == "depthwise" else ["gemm"]
    with budgets(c["small"]):
        for variant in variants:

            def run(images, variant=variant):
                inputs = [images, w] + ([b] if b is not None else [])
                return run_kernel("conv", inputs, attrs, expr=c["act"], variant=variant, threads=pool)[0]

            assert_batch_equivalent(run, x, want)


@FEW
@given(
    st.integers(1, 9),
    st.integers(1, 24),
    st.integers(1, 24),
    st.tuples(st.integers(2, 8), st.integers(2, 8)),
    st.tuples(st.integers(0, 1), st.integers(0, 1), st.integers(0, 1), st.integers(0, 1)),
    st.booleans(),
    st.sampled_from([1, 2]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_winograd_batch_equals_its_images(n, cin, cout, half, pads, bias, threads, small, seed):
    from pmx.runtime.kernels.winograd import transform_weights

    size = (2 * half[0] + 1, 2 * half[1] + 1)
    x = signed_input((n, cin) + size, seed)
    w = signed_input((cout, cin, 3, 3), seed + 1)
    b = signed_input((cout,), seed + 2) if bias else None
    top, left, bottom, right = pads
    xt = F.pad(torch.from_numpy(x), (left, right, top, bottom))
    want = F.relu(F.conv2d(xt, torch.from_numpy(w), None if b is None else torch.from_numpy(b))).numpy()
    u = transform_weights(w)
    pool = kernel_pool(threads)
    with budgets(small):

        def run(images):
            inputs = [images, u] + ([b] if b is not None else [])
            return run_kernel("conv_winograd", inputs, {"pads": pads}, expr="maximum(@0,0)", threads=pool)[0]

        assert_batch_equivalent(run, x, want)


@FEW
@given(
    st.sampled_from(["max", "avg"]),
    st.integers(1, 9),
    st.integers(1, 6),
    st.tuples(st.integers(1, 3), st.integers(1, 3)),
    st.tuples(st.integers(1, 3), st.integers(1, 3)),
    st.tuples(st.integers(0, 8), st.integers(0, 8)),
    st.booleans(),
    st.sampled_from([1, 2]),
    st.integers(0, 2**32 - 1),
)
def test_pool_batch_equals_its_images(kind, n, channels, k, stride, half, ceil_mode, threads, seed):
    pad = tuple(kk // 2 for kk in k)
    size = tuple(max(2 * h + 1, kk) for h, kk in zip(half, k))
    x = signed_input((n, channels) + size, seed)
    attrs = dict(kernel=k, stride=stride, pads=pad + pad, dilation=(1, 1), ceil_mode=ceil_mode)
    if kind == "max":
        want = F.max_pool2d(torch.from_numpy(x), k, stride, pad, ceil_mode=ceil_mode).numpy()
    else:
        attrs.update(count_include_pad=True, divisor_override=0)
        want = F.avg_pool2d(torch.from_numpy(x), k, stride, pad, ceil_mode=ceil_mode).numpy()
    pool = kernel_pool(threads)
    assert_batch_equivalent(lambda images: run_kernel(f"{kind}_pool", [images], attrs, threads=pool)[0], x, want)


@FEW
@given(
    st.integers(1, 9),
    st.integers(1, 8),
    st.tuples(st.integers(0, 6), st.integers(0, 6)),
    st.sampled_from([1, 2]),
    st.integers(0, 2**32 - 1),
)
def test_batch_norm_batch_equals_its_images(n, c, half, threads, seed):
    rng = np.random.default_rng(seed)
    x = signed_input((n, c, 2 * half[0] + 1, 2 * half[1] + 1), seed)
    mean, gamma, beta = (rng.normal(0, 0.5, c).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.1, 2, c).astype(np.float32)
    eps = 1e-5
    scale = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + eps)
    shift = beta - mean.astype(np.float64) * scale
    t = [torch.from_numpy(a) for a in (x, mean, var, gamma, beta)]
    want = F.batch_norm(t[0], t[1], t[2], t[3], t[4], training=False, eps=eps).numpy()
    operands = [scale.astype(np.float32), shift.astype(np.float32)]
    pool = kernel_pool(threads)
    assert_batch_equivalent(lambda images: run_kernel("batch_norm", [images] + operands, threads=pool)[0], x, want)


@pytest.mark.parametrize(
    "cin,cout,size,k,stride,groups,batch",
    [
        (64, 64, 7, 3, 1, 1, 5),  # folded, whole images per thread, in chunks
        (48, 96, 13, 3, 2, 1, 3),  # folded after a stride
        (96, 64, 7, 1, 1, 1, 5),  # 1x1 folded
        (64, 48, 15, 1, 1, 1, 4),  # 1x1 as one batched GEMM split by images
        (16, 32, 29, 3, 1, 1, 3),  # per image, in bands of rows
        (96, 96, 7, 3, 1, 96, 7),  # depthwise, flat, images folded into the GEMVs
        (96, 96, 13, 5, 2, 96, 9),  # depthwise, phases, folded
        (32, 32, 17, 3, 1, 32, 3),  # depthwise, flat, per image
    ],
)
def test_conv_split_batch_equals_its_images(cin, cout, size, k, stride, groups, batch):
    """Shapes big enough that two threads split the work, with small budgets (chunks of
    a few images, blocks of a few channels) and without."""
    x = signed_input((batch, cin, size, size), cin + size)
    w = signed_input((cout, cin // groups, k, k), cout)
    b = signed_input((cout,), k)
    p = k // 2
    attrs = dict(stride=(stride, stride), pads=(p,) * 4, dilation=(1, 1), groups=groups, padding_mode="zeros")
    pre = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), stride, p, 1, groups)
    want = F.relu(pre).numpy()
    pool = kernel_pool(2)
    for small in (False, True):
        with budgets(small):
            for variant in ("gemm", "depthwise") if groups > 1 else ("gemm",):

                def run(images, variant=variant):
                    return run_kernel(
                        "conv", [images, w, b], attrs, expr="maximum(@0,0)", variant=variant, threads=pool
                    )[0]

                assert_batch_equivalent(run, x, want)
