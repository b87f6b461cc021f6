"""Property tests: recurrent, resize, pad, conv_transpose kernels, plus Conv1d/2d padding
modes and 1-d pools, each against torch (max-normalized relative error <= 1e-5)."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import rel_error, run_kernel
from hypothesis import given, reject, settings
from hypothesis import strategies as st

TOL = 1e-5


def check(got, want, tol=TOL):
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
    assert got.shape == want.shape, f"shape {got.shape} != torch {want.shape}"
    err = rel_error(got, want)
    assert err <= tol, f"max-normalized error {err:.3g} > {tol}"


def generator(data):
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))


def int_list(data, lo, hi, n):
    return data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))


def run_split(data, op, inputs, attrs, expr=""):
    """run_kernel on 1-3 threads (drawn) with every split forced: conv_transpose splits
    its output channels, resize its leading dims, pixel_shuffle its channels."""
    from unittest import mock

    from pmx.runtime import parallel

    threads = data.draw(st.sampled_from([1, 2, 3]), label="threads")
    with mock.patch.object(parallel, "SPLIT_MIN_ELEMENTS", 1):
        return run_kernel(op, inputs, attrs, expr=expr, threads=threads)[0]


# --- resize --------------------------------------------------------------------------

TORCH_MODE = {("linear", 1): "linear", ("linear", 2): "bilinear", ("linear", 3): "trilinear", ("cubic", 2): "bicubic"}
SCALES = [0.5, 0.7, 1.0, 1.25, 1.5, 1.7, 2.0, 2.5, 3.0, 1 / 3]


@settings(max_examples=120)
@given(st.data())
def test_resize(data):
    mode = data.draw(st.sampled_from(["nearest", "nearest_exact", "linear", "cubic"]))
    nd = 2 if mode == "cubic" else data.draw(st.integers(1, 3))
    torch_mode = TORCH_MODE.get((mode, nd), mode.replace("_", "-"))
    small = 6 if nd == 3 else 9
    spatial = int_list(data, 1, small, nd)
    batch, channels = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    x = torch.randn(batch, channels, *spatial, generator=generator(data))
    align = data.draw(st.booleans()) if mode in ("linear", "cubic") else None
    if data.draw(st.booleans(), label="by scale"):
        scales = data.draw(st.lists(st.sampled_from(SCALES), min_size=nd, max_size=nd))
        if any(int(n * s) < 1 for n, s in zip(spatial, scales)):
            scales = [max(s, 1.0) for s in scales]
        recompute = data.draw(st.booleans())
        y = F.interpolate(
            x, scale_factor=scales, mode=torch_mode, align_corners=align, recompute_scale_factor=recompute
        )
        coord_scales = (0.0,) * nd if recompute else tuple(float(s) for s in scales)
    else:
        size = int_list(data, 1, 2 * small, nd)
        y = F.interpolate(x, size=size, mode=torch_mode, align_corners=align)
        coord_scales = (0.0,) * nd
    attrs = dict(mode=mode, align_corners=bool(align), sizes=tuple(y.shape[2:]), scales=coord_scales)
    with _product_max_input(data):
        check(run_split(data, "resize", [x.numpy()], attrs), y)


def _product_max_input(data):
    """Linear and cubic axes up to RESIZE_PRODUCT_MAX_INPUT long interpolate by matrix
    product, longer ones by gathers: drawn so that both, and a mix, run on small inputs."""
    from unittest import mock

    from pmx.runtime.kernels import resample

    limit = data.draw(st.sampled_from([0, 4, resample.RESIZE_PRODUCT_MAX_INPUT]), label="product max input")
    return mock.patch.object(resample, "RESIZE_PRODUCT_MAX_INPUT", limit)


@settings(max_examples=60)
@given(st.data())
def test_resize_non_finite_inputs_stay_local(data):
    """A NaN or infinity in the input reaches the outputs whose taps read it, as in
    torch, not every output of its row (as a matrix product's 0 * inf would make it):
    runs with one take the gathers. Where torch is finite, pmx is finite and close."""
    mode = data.draw(st.sampled_from(["linear", "cubic"]))
    spatial, size = int_list(data, 1, 7, 2), int_list(data, 1, 15, 2)
    align = data.draw(st.booleans())
    x = torch.randn(1, 2, *spatial, generator=generator(data)).numpy()
    x.flat[data.draw(st.integers(0, x.size - 1))] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    y = F.interpolate(
        torch.from_numpy(x), size=size, mode="bilinear" if mode == "linear" else "bicubic", align_corners=align
    ).numpy()
    attrs = dict(mode=mode, align_corners=align, sizes=tuple(size), scales=(0.0, 0.0))
    with _product_max_input(data):
        got = run_split(data, "resize", [x], attrs)
    finite = np.isfinite(y)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    check(got[finite], y[finite])


def test_resize_nearest_integer_factors_exact():
    x = torch.randn(2, 3, 4, 5)
    for s in (2, 3):
        y = F.interpolate(x, scale_factor=s, mode="nearest")
        attrs = dict(mode="nearest", align_corners=False, sizes=tuple(y.shape[2:]), scales=(float(s),) * 2)
        np.testing.assert_array_equal(run_kernel("resize", [x.numpy()], attrs)[0], y.numpy())


def test_resize_shape_rule_follows_scale_factor():
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get

    node = KernelNode(
        "resize", dict(mode="linear", align_corners=False, sizes=(10, 7), scales=(2.0, 0.0), scale_factor=(2.0, 0.0))
    )
    [(shape, _)] = get("resize").infer(node, [(3, 4, 9, 30)], [np.dtype("float32")])
    assert shape == (3, 4, 18, 7)


# --- pad -----------------------------------------------------------------------------


@settings(max_examples=120)
@given(st.data())
def test_pad(data):
    mode = data.draw(st.sampled_from(["constant", "reflect", "replicate", "circular"]))
    if mode == "constant":
        rank = data.draw(st.integers(1, 4))
        nd = data.draw(st.integers(1, rank))
    else:  # torch pads 1..3 trailing dims of a batched input
        rank = data.draw(st.integers(3, 5))
        nd = data.draw(st.integers(1, min(3, rank - 2)))
    shape = int_list(data, 1, 6, rank)
    x = torch.randn(*shape, generator=generator(data))
    pad = int_list(data, -2, 4, 2 * nd)
    value = data.draw(st.sampled_from([0.0, 1.5, -2.0]))
    try:
        y = F.pad(x, pad, mode=mode, value=value if mode == "constant" else None)
    except (RuntimeError, ValueError, NotImplementedError):
        reject()  # torch refuses it; the compiler never sees such a model
    if y.numel() == 0:
        reject()
    begins = tuple(pad[2 * (nd - 1 - i)] for i in range(nd))
    ends = tuple(pad[2 * (nd - 1 - i) + 1] for i in range(nd))
    kept = [n + min(b, 0) + min(e, 0) for n, b, e in zip(shape[-nd:], begins, ends)]
    if mode == "circular" and any(max(b, e) > k or k <= 0 for b, e, k in zip(begins, ends, kept)):
        reject()  # torch reads past a too-short (cropped) dim; the compiler refuses these
    got = run_kernel("pad", [x.numpy()], dict(pads=begins + ends, mode=mode, value=value))[0]
    np.testing.assert_array_equal(got, y.numpy())


# --- conv_transpose --------------------------------------------------------------------


@settings(max_examples=100)
@given(st.data())
def test_conv_transpose(data):
    nd = data.draw(st.sampled_from([1, 2, 2, 3]))
    groups = data.draw(st.integers(1, 3))
    cin = groups * data.draw(st.integers(1, 3))
    cout_g = data.draw(st.integers(1, 3))
    k = int_list(data, 1, 4 if nd < 3 else 3, nd)
    stride, dilation = int_list(data, 1, 3, nd), int_list(data, 1, 2, nd)
    padding = int_list(data, 0, 3, nd)
    output_padding = [data.draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation)]
    spatial = int_list(data, 1, 6 if nd < 3 else 3, nd)
    g = generator(data)
    x = torch.randn(data.draw(st.integers(1, 4)), cin, *spatial, generator=g)
    w = torch.randn(cin, cout_g, *k, generator=g)
    b = torch.randn(cout_g * groups, generator=g) if data.draw(st.booleans()) else None
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd]
    try:
        y = fn(x, w, b, stride=stride, padding=padding, output_padding=output_padding, groups=groups, dilation=dilation)
    except RuntimeError:
        reject()  # output would be empty
    attrs = dict(
        stride=tuple(stride),
        pads=tuple(padding) * 2,
        output_padding=tuple(output_padding),
        dilation=tuple(dilation),
        groups=groups,
    )
    inputs = [x.numpy(), w.numpy()] + ([b.numpy()] if b is not None else [])
    relu = data.draw(st.booleans(), label="relu")
    got = run_split(data, "conv_transpose", inputs, attrs, expr="maximum(@0,0)" if relu else "")
    check(got, F.relu(y) if relu else y)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [(2, 2), (3, 1)])
def test_conv_transpose_tiling_taps(k, bias):
    """kernel == stride: every output pixel gets exactly one tap (the written path)."""
    x, w = torch.randn(2, 6, 4, 5), torch.randn(6, 2, *k)
    b = torch.randn(6) if bias else None
    attrs = dict(stride=k, pads=(0, 0, 0, 0), output_padding=(0, 0), dilation=(1, 1), groups=3)
    inputs = [x.numpy(), w.numpy()] + ([b.numpy()] if bias else [])
    out = run_kernel("conv_transpose", inputs, attrs)[0]
    check(out, F.conv_transpose2d(x, w, b, stride=k, groups=3))


def test_conv_transpose_fused_activation():
    x, w, b = torch.randn(2, 4, 5, 5), torch.randn(4, 3, 3, 3), torch.randn(3)
    attrs = dict(stride=(2, 2), pads=(1, 1, 1, 1), output_padding=(1, 1), dilation=(1, 1), groups=1)
    got = run_kernel("conv_transpose", [x.numpy(), w.numpy(), b.numpy()], attrs, expr="max(@0, 0)")
    check(got[0], F.relu(F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1)))


# --- recurrent ---------------------------------------------------------------------------


def _recurrent_case(data, dtype):
    """(cell, kernel inputs in `dtype`, attrs, torch float64 outputs)."""
    cell = data.draw(st.sampled_from(["lstm", "gru", "rnn"]))
    nonlinearity = data.draw(st.sampled_from(["tanh", "relu"])) if cell == "rnn" else "tanh"
    hidden, inp = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 5))
    layers = data.draw(st.integers(1, 3))
    bi, batch_first, bias = (data.draw(st.booleans()) for _ in range(3))
    proj = data.draw(st.integers(0, hidden - 1)) if cell == "lstm" and hidden > 1 else 0
    kw = dict(num_layers=layers, bidirectional=bi, batch_first=batch_first, bias=bias)
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1), label="weights seed"))
    if cell == "lstm":
        m = nn.LSTM(inp, hidden, proj_size=proj, **kw)
    elif cell == "gru":
        m = nn.GRU(inp, hidden, **kw)
    else:
        m = nn.RNN(inp, hidden, nonlinearity=nonlinearity, **kw)
    m = m.double()  # float32 weights widened exactly: the float64 reference is exact math
    steps, batch = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 4))
    batched = data.draw(st.integers(0, 4), label="batched unless 0") > 0
    dirs, hout = 2 if bi else 1, proj or hidden
    g = generator(data)
    if batched:
        x = torch.randn(*((batch, steps, inp) if batch_first else (steps, batch, inp)), generator=g)
    else:
        x = torch.randn(steps, inp, generator=g)
    lead = (layers * dirs, batch) if batched else (layers * dirs,)
    h0, c0 = torch.randn(*lead, hout, generator=g), torch.randn(*lead, hidden, generator=g)
    states = ([h0, c0] if cell == "lstm" else [h0]) if data.draw(st.booleans()) else []
    with torch.no_grad():
        args = [s.double() for s in states]
        if not args:
            y, hs = m(x.double())
        else:
            y, hs = m(x.double(), tuple(args) if cell == "lstm" else args[0])
    want = [y] + (list(hs) if cell == "lstm" else [hs])
    inputs = [x] + states
    for layer in range(layers):
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            names = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if bias else [])
            names += ["weight_hr"] if proj else []
            inputs += [getattr(m, n + sfx).detach() for n in names]
    inputs = [t.numpy().astype(dtype) for t in inputs]
    attrs = dict(
        hidden_size=hidden,
        num_layers=layers,
        bidirectional=bi,
        batch_first=batch_first,
        has_bias=bias,
        has_state=bool(states),
        proj_size=proj,
        nonlinearity=nonlinearity,
    )
    return cell, inputs, attrs, want


@settings(max_examples=80)
@given(st.data())
def test_recurrent(data):
    """float32 and float64 kernels against torch in float64 on the same (float32-exact)
    weights and inputs. ReLU recurrences run in float64 only: in float32 they cancel
    catastrophically near the kink, and torch's own float32 result is as far off."""
    dtype = np.float64 if data.draw(st.booleans(), label="float64") else np.float32
    cell, inputs, attrs, want = _recurrent_case(data, dtype)
    if cell == "rnn" and attrs["nonlinearity"] == "relu":
        inputs = [a.astype(np.float64) for a in inputs]
    got = run_kernel(cell, inputs, attrs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        check(g, w)


# --- conv padding modes and 1-d pools (kernels owned by the conv/pool family) -----------


@settings(max_examples=80)
@given(st.data())
def test_conv_padding_modes(data):
    nd = data.draw(st.integers(1, 2))
    mode = data.draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    groups = data.draw(st.integers(1, 2))
    cin, cout = groups * data.draw(st.integers(1, 3)), groups * data.draw(st.integers(1, 3))
    spatial = int_list(data, 2, 8, nd)
    k, stride = int_list(data, 1, 3, nd), int_list(data, 1, 2, nd)
    dilation = int_list(data, 1, 2, nd)
    padding = [data.draw(st.integers(0, n - 1)) for n in spatial]
    g = generator(data)
    x = torch.randn(data.draw(st.integers(1, 4)), cin, *spatial, generator=g)
    w = torch.randn(cout, cin // groups, *k, generator=g)
    b = torch.randn(cout, generator=g)
    torch_pad = [p for p in reversed(padding) for _ in range(2)]
    xp = F.pad(x, torch_pad) if mode == "zeros" else F.pad(x, torch_pad, mode=mode)
    conv = F.conv1d if nd == 1 else F.conv2d
    try:
        y = conv(xp, w, b, stride=stride, dilation=dilation, groups=groups)
    except RuntimeError:
        reject()  # kernel larger than the padded input
    attrs = dict(
        stride=tuple(stride), pads=tuple(padding) * 2, dilation=tuple(dilation), groups=groups, padding_mode=mode
    )
    check(run_kernel("conv", [x.numpy(), w.numpy(), b.numpy()], attrs)[0], y)


@settings(max_examples=80)
@given(st.data())
def test_pool1d(data):
    kind = data.draw(st.sampled_from(["max", "avg", "adaptive"]))
    n = data.draw(st.integers(1, 12))
    batch, channels = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    x = torch.randn(batch, channels, n, generator=generator(data))
    if kind == "adaptive":
        size = data.draw(st.integers(1, n + 3))
        got = run_kernel("adaptive_avg_pool", [x.numpy()], dict(output_size=(size,)))[0]
        check(got, F.adaptive_avg_pool1d(x, size))
        return
    k = data.draw(st.integers(1, min(n, 4)))
    stride = data.draw(st.integers(1, 3))
    pad = data.draw(st.integers(0, k // 2))
    ceil = data.draw(st.booleans())
    attrs = dict(kernel=(k,), stride=(stride,), pads=(pad, pad), ceil_mode=ceil)
    try:
        if kind == "max":
            attrs["dilation"] = (data.draw(st.integers(1, 2)),)
            y = F.max_pool1d(x, k, stride, pad, dilation=attrs["dilation"][0], ceil_mode=ceil)
        else:
            cip = data.draw(st.booleans())
            attrs.update(dilation=(1,), count_include_pad=cip, divisor_override=0)
            y = F.avg_pool1d(x, k, stride, pad, ceil_mode=ceil, count_include_pad=cip)
    except RuntimeError:
        reject()  # empty output
    check(run_kernel(f"{kind}_pool", [x.numpy()], attrs)[0], y)


# --- compile-time refusals ----------------------------------------------------------------

REFUSED = [
    (
        "F.upsample up 1 1 0 1 mode=bilinear antialias=True align_corners=False "
        "scale_factor=(2.0,2.0) #0=(1,2,3,4)f32 #1=(1,2,6,8)f32",
        "antialias",
    ),
    ("F.upsample up 1 1 0 1 mode=bicubic align_corners=False size=(6) #0=(1,2,3)f32 #1=(1,2,6)f32", "bicubic"),
    ("F.pad p 1 1 0 1 mode=reflect pad=(3,3) value=None #0=(1,2,3)f32 #1=(1,2,9)f32", "reflect padding"),
    ("F.pad p 1 1 0 1 mode=symmetric pad=(1,1) value=None #0=(1,2,3)f32 #1=(1,2,5)f32", "symmetric"),
    ("F.pad p 1 1 0 1 mode=circular pad=(1,-1) value=None #0=(1,2,1)f32 #1=(1,2,1)f32", "crops"),
    ("F.pixel_shuffle s 1 1 0 1 upscale_factor=2 #0=(1,6,3,3)f32 #1=(1,1,6,6)f32", "divisible"),
]


@pytest.mark.parametrize("line, message", REFUSED)
def test_compile_refuses(tmp_path, line, message):
    from pmx.compiler.driver import compile_model
    from pmx.runtime.errors import PmxCompileError

    input_spec = line.split("#0=")[1].split()[0]
    lines = ["7767517", "3 2", f"pnnx.Input in 0 1 0 #0={input_spec}", line, "pnnx.Output out 1 0 1"]
    param = tmp_path / "m.pnnx.param"
    param.write_text("\n".join(lines) + "\n")
    (tmp_path / "m.pnnx.bin").write_bytes(b"")
    with pytest.raises(PmxCompileError, match=message) as e:
        compile_model(str(param), str(tmp_path / "m.pnnx.bin"), str(tmp_path / "m.pmx"))
    assert "line 4" in str(e.value)


# --- pixel shuffle -------------------------------------------------------------------------


@settings(max_examples=40)
@given(st.data())
def test_pixel_shuffle(data):
    r = data.draw(st.integers(1, 3))
    inverse = data.draw(st.booleans())
    lead = tuple(int_list(data, 1, 3, data.draw(st.integers(0, 2))))
    c = data.draw(st.integers(1, 3))
    h, w = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    if inverse:
        x = torch.randn(*lead, c, h * r, w * r, generator=generator(data))
        y = F.pixel_unshuffle(x, r)
    else:
        x = torch.randn(*lead, c * r * r, h, w, generator=generator(data))
        y = F.pixel_shuffle(x, r)
    got = run_split(data, "pixel_shuffle", [x.numpy()], dict(factor=r, inverse=inverse))
    np.testing.assert_array_equal(got, y.numpy())
