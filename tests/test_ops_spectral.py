"""Complex tensors, torch.fft.*, stft and istft against torch: property tests over one-op
.pnnx.param models (canonical rule, shape rule and kernel together), and end-to-end
pnnx exports."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers import rel_error
from hypothesis import given
from hypothesis import strategies as st
from paramgraph import generator, run_one_op, sizes

from pmx.runtime.errors import PmxCompileError

TOL = 1e-5


def check(got, want, tol=TOL):
    want = want.detach().resolve_conj().numpy()
    assert got.shape == want.shape, f"shape {got.shape} != torch {want.shape}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != torch {want.dtype}"
    err = rel_error(got, want)
    assert err <= tol, f"max-normalized error {err:.3g} > {tol}"


def text(v):
    """A parameter value as pnnx writes it."""
    if isinstance(v, tuple):
        return "(" + ",".join(map(str, v)) + ")"
    return str(v)


def draw_input(data, g, complex_ok, min_size):
    shape = sizes(data, min_size, 6, data.draw(st.integers(1, 3)))
    if complex_ok and data.draw(st.booleans(), label="complex input"):
        return torch.randn(*shape, dtype=torch.complex64, generator=g)
    return torch.randn(*shape, generator=g)


@given(st.data())
def test_fft(data):
    kind = data.draw(st.sampled_from(["fft", "ifft", "rfft", "irfft", "hfft", "ihfft"]))
    form = data.draw(st.sampled_from(["", "2", "n"]))
    g = generator(data)
    # irfft and hfft default to 2 * (m - 1) samples: every dim of 2 or more keeps that positive
    x = draw_input(data, g, complex_ok=kind not in ("rfft", "ihfft"), min_size=2 if kind in ("irfft", "hfft") else 1)
    if form == "2" and x.dim() < 2:
        x = torch.stack([x, 2 * x])
    rank = x.dim()
    norm = data.draw(st.sampled_from([None, "backward", "forward", "ortho"]))
    if form == "":
        dim = data.draw(st.integers(-rank, rank - 1))
        n = data.draw(st.one_of(st.none(), st.integers(1, 7)))
        params = dict(dim=dim, n=n, norm=norm)
        want = getattr(torch.fft, kind)(x, n=n, dim=dim, norm=norm)
    else:
        k = 2 if form == "2" else data.draw(st.integers(1, rank))
        dim = tuple(data.draw(st.permutations(range(rank)))[:k])
        if form == "n" and data.draw(st.booleans()):
            dim = None  # all dims, or the last len(s)
        if dim is None and data.draw(st.booleans()):
            k = rank
        s = data.draw(
            st.one_of(st.none(), st.lists(st.sampled_from([-1, 1, 2, 3, 5]), min_size=k, max_size=k).map(tuple))
        )
        params = dict(dim=dim, s=s, norm=norm)
        want = getattr(torch.fft, kind + form)(x, s=s, dim=dim, norm=norm)
    param_text = " ".join(f"{k}={text(v)}" for k, v in params.items())
    (got,) = run_one_op(f"torch.fft.{kind}{form}", param_text, [x.numpy()], [want.resolve_conj().numpy()], ["input"])
    check(got, want)


@given(st.data())
def test_complex_parts(data):
    g = generator(data)
    shape = sizes(data, 1, 5, data.draw(st.integers(0, 3)))
    re, im = torch.randn(tuple(shape), generator=g), torch.randn(tuple(shape), generator=g)
    c = torch.complex(re, im)
    (got,) = run_one_op("torch.complex", "", [re.numpy(), im.numpy()], [c.numpy()], ["real", "imag"])
    check(got, c)
    for op, fn in (("torch.real", torch.real), ("torch.imag", torch.imag), ("torch.view_as_real", torch.view_as_real)):
        want = fn(c)
        (got,) = run_one_op(op, "", [c.numpy()], [want.numpy()], ["input"])
        check(got, want)
    pairs = torch.randn(*shape, 2, generator=g)
    want = torch.view_as_complex(pairs)
    (got,) = run_one_op("torch.view_as_complex", "", [pairs.numpy()], [want.numpy()], ["input"])
    check(got, want)


WINDOWS = {"none": None, "hann": torch.hann_window, "hamming": torch.hamming_window}


@given(st.data())
def test_stft(data):
    g = generator(data)
    n_fft = data.draw(st.sampled_from([4, 8, 15, 16]))
    win = data.draw(st.one_of(st.none(), st.integers(2, n_fft)))
    hop = data.draw(st.one_of(st.none(), st.integers(1, n_fft)))
    center = data.draw(st.booleans())
    pad_mode = data.draw(st.sampled_from(["reflect", "constant", "replicate", "circular"]))
    normalized = data.draw(st.booleans())
    onesided = data.draw(st.sampled_from([None, True, False]))
    lead = data.draw(st.sampled_from([(), (1,), (3,)]))
    x = torch.randn(*lead, data.draw(st.integers(n_fft + 1, 3 * n_fft)), generator=g)
    window_kind = data.draw(st.sampled_from(list(WINDOWS)))
    window = WINDOWS[window_kind](win if win is not None else n_fft) if window_kind != "none" else None
    want = torch.stft(
        x,
        n_fft,
        hop_length=hop,
        win_length=win,
        window=window,
        center=center,
        pad_mode=pad_mode,
        normalized=normalized,
        onesided=onesided,
        return_complex=True,
    )
    params = (
        f"center={center} hop_length={hop} n_fft={n_fft} normalized={normalized} onesided={onesided} "
        f"pad_mode={pad_mode} return_complex=True win_length={win}"
    )
    inputs, labels = [x.numpy()], ["input"]
    if window is None:
        params += " window=None"
    else:
        inputs.append(window.numpy())
        labels.append("window")
    (got,) = run_one_op("torch.stft", params, inputs, [want.numpy()], labels)
    check(got, want)


@given(st.data())
def test_istft(data):
    g = generator(data)
    n_fft = data.draw(st.sampled_from([8, 12, 16]))
    win = data.draw(st.one_of(st.none(), st.integers(n_fft // 2 + 1, n_fft)))
    hop = data.draw(st.integers(1, max(1, (win or n_fft) // 4)))
    center = data.draw(st.booleans())
    if not center:
        win = None  # a window shorter than n_fft leaves the first samples uncovered: torch refuses (NOLA)
    normalized = data.draw(st.booleans())
    onesided = data.draw(st.sampled_from([True, False]))
    lead = data.draw(st.sampled_from([(), (2,)]))
    signal = torch.randn(*lead, data.draw(st.integers(2 * n_fft, 4 * n_fft)), generator=g)
    window = torch.hann_window(win if win is not None else n_fft, periodic=True) + 0.1
    spec = torch.stft(
        signal,
        n_fft,
        hop_length=hop,
        win_length=win,
        window=window,
        center=center,
        normalized=normalized,
        onesided=onesided,
        return_complex=True,
    )
    length = data.draw(st.one_of(st.none(), st.integers(n_fft, signal.shape[-1])))
    if not center and length is not None:
        length = None  # torch reads beyond the last frame's envelope otherwise (NOLA fails)
    want = torch.istft(
        spec,
        n_fft,
        hop_length=hop,
        win_length=win,
        window=window,
        center=center,
        normalized=normalized,
        onesided=onesided,
        length=length,
        return_complex=False,
    )
    params = (
        f"center={center} hop_length={hop} length={length} n_fft={n_fft} normalized={normalized} "
        f"onesided={onesided} return_complex=False win_length={win}"
    )
    (got,) = run_one_op("torch.istft", params, [spec.numpy(), window.numpy()], [want.numpy()], ["input", "window"])
    check(got, want, tol=1e-4)


@pytest.mark.parametrize("return_complex", [False, True])
def test_istft_of_a_two_sided_spectrum_whose_bins_do_not_mirror(return_complex):
    """A real inverse reads only the first n_fft // 2 + 1 bins (torch's irfft), a complex one
    all of them."""
    g = torch.Generator().manual_seed(3)
    spec = torch.randn(2, 16, 9, dtype=torch.complex64, generator=g)
    window = torch.hamming_window(16)
    want = torch.istft(spec, 16, hop_length=4, window=window, onesided=False, return_complex=return_complex)
    params = (
        f"center=True hop_length=4 length=None n_fft=16 normalized=False onesided=False "
        f"return_complex={return_complex} win_length=16"
    )
    (got,) = run_one_op("torch.istft", params, [spec.numpy(), window.numpy()], [want.numpy()], ["input", "window"])
    check(got, want, tol=1e-4)


def test_rfft_refuses_complex_input():
    x = np.zeros((2, 4), np.complex64)
    with pytest.raises(PmxCompileError, match="real input"):
        run_one_op("torch.fft.rfft", "dim=-1 n=None norm=None", [x], [np.zeros((2, 3), np.complex64)], ["input"])


def test_fft_refuses_unknown_norm():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(PmxCompileError, match="norm"):
        run_one_op("torch.fft.fft", "dim=-1 n=None norm=half", [x], [np.zeros((2, 4), np.complex64)], ["input"])


class SpectralFilter(nn.Module):
    """A global filter layer (GFNet-style): rfft2, a complex weight, irfft2, plus the
    complex helpers around it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6, 4, 2) * 0.1)

    def forward(self, x, y):
        f = torch.fft.rfft2(x, dim=(2, 3), norm="ortho")
        f = f * torch.view_as_complex(self.weight)
        out = torch.fft.irfft2(f, s=(6, 6), dim=(2, 3), norm="ortho")
        c = torch.complex(x, y)
        spec = torch.fft.fftn(c, dim=(1, 3))
        h = torch.fft.hfft(spec, n=8, norm="forward")
        ih = torch.fft.ihfft2(y)
        return out, torch.view_as_real(spec), torch.real(ih) + torch.imag(ih), h, spec.abs()


@pytest.mark.slow  # exports through pnnx
def test_e2e_spectral_filter(check_model):
    torch.manual_seed(0)
    check_model("spectral_filter", SpectralFilter(), (torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)))


class Vocoder(nn.Module):
    def forward(self, x):
        spec = torch.stft(x, n_fft=32, hop_length=8, window=torch.hann_window(32), center=True, return_complex=True)
        mag = spec.abs()
        spec = spec * torch.sigmoid(mag)
        return mag, torch.istft(spec, n_fft=32, hop_length=8, window=torch.hann_window(32), center=True, length=250)


@pytest.mark.slow  # exports through pnnx
def test_e2e_stft_istft(check_model):
    torch.manual_seed(1)
    check_model("spectral_vocoder", Vocoder(), (torch.randn(2, 256),))


class ComplexArithmetic(nn.Module):
    """Complex literals in pnnx expressions ("%e+%ej") and elementwise ops on complex tensors."""

    def forward(self, x, c):
        a = x - 4j
        b = x * (1.2 - 0.9j - (x + 3))
        d = c * c + a / (c - 2.5j)
        return a, b, d, d.abs()


@pytest.mark.slow  # exports through pnnx
def test_e2e_complex_arithmetic(check_model):
    torch.manual_seed(2)
    check_model(
        "spectral_complex_arith", ComplexArithmetic(), (torch.randn(3, 5), torch.randn(3, 5, dtype=torch.complex64))
    )


@pytest.mark.parametrize(
    "text", ["mul(@0,1.200000e+00-9.000000e-01j)", "sub(@0,0.000000e+00+4.000000e+00j)", "add(@0,1.0e+00+-2.0e+00j)"]
)
def test_complex_literal_parses_and_round_trips(text):
    from pmx.runtime import expr as E

    tree = E.parse(text, 1)
    value = tree[2][1]
    assert isinstance(value, complex)
    assert E.parse(E.to_text(tree), 1) == tree
    x = np.arange(4, dtype=np.float32)
    assert E.result_dtype(tree, [x.dtype]) == np.complex64


def test_istft_refuses_a_window_whose_overlap_add_vanishes():
    """As torch does: with center=False a window shorter than n_fft leaves the first samples
    with a zero envelope."""
    from pmx.runtime.errors import PmxInputError

    spec = torch.stft(
        torch.randn(16), 8, hop_length=1, win_length=5, window=torch.ones(5), center=False, return_complex=True
    )
    with pytest.raises(RuntimeError):
        torch.istft(spec, 8, hop_length=1, win_length=5, window=torch.ones(5), center=False)
    params = (
        "center=False hop_length=1 length=None n_fft=8 normalized=False onesided=True return_complex=False win_length=5"
    )
    with pytest.raises(PmxInputError, match="overlap-add"):
        run_one_op(
            "torch.istft",
            params,
            [spec.numpy(), np.ones(5, np.float32)],
            [np.zeros(16, np.float32)],
            ["input", "window"],
        )
