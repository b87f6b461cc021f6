"""torchaudio's spectrogram and inverse_spectrogram as pnnx writes them
(torchaudio.functional.spectrogram / inverse_spectrogram, also for the Spectrogram and
InverseSpectrogram modules, the window stored as a pnnx.Attribute).

torchaudio is not a test dependency: the oracle is torchaudio's documented definition
written out below with torch.stft / torch.istft, and the .param text is written by hand in
pnnx's spelling."""

import pathlib
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from paramgraph import generator

from pmx.runtime.errors import PmxCompileError

SPELL = {torch.float32: "f32", torch.complex64: "c64"}
POWERS = [None, 1, 2, 2.0, 0.5, 1.5, 3.0]
NORMALIZED = [False, True, "window", "frame_length"]


# --- the oracle: torchaudio's definitions over torch.stft / torch.istft -----------------


def _norms(normalized):
    """(frame_length, window): True means "window", as torchaudio reads it."""
    return normalized == "frame_length", normalized is True or normalized == "window"


def ref_spectrogram(x, pad, window, n_fft, hop, win, power, normalized, center, pad_mode, onesided):
    if pad > 0:
        x = F.pad(x, (pad, pad), "constant")
    frame_norm, window_norm = _norms(normalized)
    lead = x.shape[:-1]
    spec = torch.stft(
        x.reshape(-1, x.shape[-1]),
        n_fft,
        hop_length=hop,
        win_length=win,
        window=window,
        center=center,
        pad_mode=pad_mode,
        normalized=frame_norm,
        onesided=onesided,
        return_complex=True,
    )
    spec = spec.reshape(lead + spec.shape[-2:])
    if window_norm:
        spec = spec / window.pow(2.0).sum().sqrt()
    if power is None:
        return spec
    return spec.abs() if power == 1 else spec.abs().pow(power)


def ref_inverse(spec, length, pad, window, n_fft, hop, win, normalized, center, onesided):
    frame_norm, window_norm = _norms(normalized)
    if window_norm:
        spec = spec * window.pow(2.0).sum().sqrt()
    lead = spec.shape[:-2]
    y = torch.istft(
        spec.reshape(-1, *spec.shape[-2:]),
        n_fft,
        hop_length=hop,
        win_length=win,
        window=window,
        center=center,
        normalized=frame_norm,
        onesided=onesided,
        length=None if length is None else length + 2 * pad,
        return_complex=False,
    )
    if length is not None and pad > 0:
        y = y[:, pad:-pad]
    return y.reshape(lead + y.shape[-1:])


# --- the .param pnnx writes -----------------------------------------------------------


def _operand(name, t):
    return f"#{name}=({','.join(map(str, t.shape))}){SPELL[t.dtype]}"


def _spell(v):
    """A parameter value as pnnx writes it (floats in %e, strings bare)."""
    return f"{v:e}" if isinstance(v, float) else str(v)


def run_audio_op(op, params, x, label, window, want, window_as_input=False):
    """Compile and run one torchaudio op over input x and window (a weight, or a second graph
    input); returns pmx's output."""
    from ziputil import write_bin

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    text = " ".join(f"{k}={_spell(v)}" for k, v in sorted(params.items()))
    lines = [f"pnnx.Input pnnx_input_0 0 1 0 {_operand('0', x)}"]
    if window_as_input:
        lines.append(f"pnnx.Input pnnx_input_1 0 1 1 {_operand('1', window)}")
    else:
        lines.append(f"pnnx.Attribute s0 0 1 1 @data=({window.shape[0]})f32 {_operand('1', window)}")
    lines.append(
        f"{op} {op}_7 2 1 0 1 2 {text} ${label}=0 $window=1 "
        f"{_operand('0', x)} {_operand('1', window)} {_operand('2', want)}"
    )
    lines.append("pnnx.Output pnnx_output_0 1 0 2")
    feeds = [x.numpy()] + ([window.numpy()] if window_as_input else [])
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        (d / "m.pnnx.param").write_text("\n".join(["7767517", f"{len(lines)} 3", *lines]) + "\n")
        write_bin(d / "m.pnnx.bin", {} if window_as_input else {"s0.data": window.numpy()})
        compile_model(str(d / "m.pnnx.param"), str(d / "m.pnnx.bin"), str(d / "m.pmx"), verify=True)
        sess = InferenceSession(str(d / "m.pmx"), verify=True)
        (got,) = sess.run(None, {arg.name: a for arg, a in zip(sess.get_inputs(), feeds)})
    return got


def check(got, want, tol=1e-4):
    want = want.numpy()
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-6)
    assert float(np.abs(got - want).max(initial=0.0)) <= tol * scale


def _window(kind, n):
    return {
        "hann": torch.hann_window,
        "hamming": torch.hamming_window,
        "blackman": lambda m: torch.blackman_window(m) + 0.05,
    }[kind](n)


def _spec_params(n_fft, hop, win, pad, **rest):
    return dict(n_fft=n_fft, hop_length=hop, win_length=win, pad=pad, **rest)


# --- spectrogram ----------------------------------------------------------------------


@given(st.data())
def test_spectrogram_matches_torchaudio_definition(data):
    g = generator(data)
    n_fft = data.draw(st.sampled_from([8, 12, 16, 32]), label="n_fft")
    win = data.draw(st.integers(n_fft // 2, n_fft), label="win_length")
    hop = data.draw(st.integers(1, n_fft // 2), label="hop")
    pad = data.draw(st.sampled_from([0, 0, 3]), label="pad")
    power = data.draw(st.sampled_from(POWERS), label="power")
    normalized = data.draw(st.sampled_from(NORMALIZED), label="normalized")
    center = data.draw(st.booleans(), label="center")
    pad_mode = data.draw(st.sampled_from(["reflect", "constant", "replicate", "circular"]), label="pad_mode")
    onesided = data.draw(st.booleans(), label="onesided")
    lead = data.draw(st.sampled_from([(), (1,), (3,), (2, 2)]), label="lead")
    window_as_input = data.draw(st.booleans(), label="window_as_input")
    x = torch.randn(*lead, data.draw(st.integers(n_fft, 4 * n_fft), label="T"), generator=g)
    window = _window(data.draw(st.sampled_from(["hann", "hamming", "blackman"]), label="window"), win)
    want = ref_spectrogram(x, pad, window, n_fft, hop, win, power, normalized, center, pad_mode, onesided)
    params = _spec_params(
        n_fft, hop, win, pad, power=power, normalized=normalized, center=center, pad_mode=pad_mode, onesided=onesided
    )
    got = run_audio_op("torchaudio.functional.spectrogram", params, x, "waveform", window, want, window_as_input)
    check(got, want)


def test_spectrogram_as_pnnx_exports_the_upstream_cases():
    """The four Spectrogram configurations of pnnx's own torchaudio test, on (3, 2560) and
    (1000,) waveforms (pad > 0 left on the op, as other pnnx versions keep it)."""
    torch.manual_seed(0)
    cases = [
        (64, 16, 44, 0, "hann", dict(center=True, normalized="window", power=1, onesided=True, pad_mode="reflect")),
        (128, 3, 128, 0, "hann", dict(center=False, normalized=False, power=None, onesided=True, pad_mode="reflect")),
        (
            512,
            128,
            256,
            0,
            "hamming",
            dict(center=True, normalized="frame_length", power=2, onesided=True, pad_mode="constant"),
        ),
        (
            512,
            128,
            512,
            32,
            "hamming",
            dict(center=True, normalized=False, power=2, onesided=False, pad_mode="reflect"),
        ),
    ]
    for x in (torch.rand(3, 2560), torch.rand(1000)):
        for n_fft, hop, win, pad, kind, rest in cases:
            window = _window(kind, win)
            want = ref_spectrogram(
                x,
                pad,
                window,
                n_fft,
                hop,
                win,
                rest["power"],
                rest["normalized"],
                rest["center"],
                rest["pad_mode"],
                rest["onesided"],
            )
            got = run_audio_op(
                "torchaudio.functional.spectrogram",
                _spec_params(n_fft, hop, win, pad, **rest),
                x,
                "waveform",
                window,
                want,
            )
            check(got, want)


# --- inverse_spectrogram ----------------------------------------------------------------


@given(st.data())
def test_inverse_spectrogram_matches_torchaudio_definition(data):
    g = generator(data)
    n_fft = data.draw(st.sampled_from([8, 12, 16, 32]), label="n_fft")
    center = data.draw(st.booleans(), label="center")
    # without centring, a window shorter than n_fft (or vanishing at its ends) leaves the
    # first samples uncovered: torch refuses (NOLA), so such cases do not exist to match
    win = data.draw(st.integers(n_fft // 2, n_fft), label="win_length") if center else n_fft
    kind = data.draw(st.sampled_from(["hann", "hamming", "blackman"] if center else ["hamming", "blackman"]))
    hop = data.draw(st.integers(1, max(1, win // 4)), label="hop")
    normalized = data.draw(st.sampled_from(NORMALIZED), label="normalized")
    onesided = data.draw(st.booleans(), label="onesided")
    lead = data.draw(st.sampled_from([(), (1,), (3,), (2, 2)]), label="lead")
    frames = data.draw(st.integers(2, 12), label="frames")
    pad = data.draw(st.sampled_from([0, 0, 2]), label="pad")
    natural = n_fft + hop * (frames - 1) - (2 * (n_fft // 2) if center else 0)
    top = natural - 2 * pad  # the most samples the frames cover once the pad is cut off
    length = data.draw(st.one_of(st.none(), st.integers(max(1, top - hop), top)), label="length") if top > 0 else None
    window_as_input = data.draw(st.booleans(), label="window_as_input")
    bins = n_fft // 2 + 1 if onesided else n_fft
    # a random spectrum, not one stft made: also two-sided ones whose bins do not mirror
    spec = torch.randn(*lead, bins, frames, dtype=torch.complex64, generator=g)
    window = _window(kind, win)
    want = ref_inverse(spec, length, pad, window, n_fft, hop, win, normalized, center, onesided)
    params = _spec_params(n_fft, hop, win, pad, length=length, normalized=normalized, center=center, onesided=onesided)
    got = run_audio_op(
        "torchaudio.functional.inverse_spectrogram", params, spec, "spectrogram", window, want, window_as_input
    )
    check(got, want)


def test_inverse_spectrogram_as_pnnx_exports_the_upstream_cases():
    torch.manual_seed(0)
    cases = [
        ((3, 33, 161), 64, 16, 44, "hann", dict(normalized="window", onesided=True)),
        ((1, 65, 77), 128, 3, 128, "hann", dict(normalized=False, onesided=True)),
        ((257, 8), 512, 128, 256, "hamming", dict(normalized="frame_length", onesided=True)),
        ((512, 4), 512, 128, 512, "hamming", dict(normalized=False, onesided=False)),
    ]
    for shape, n_fft, hop, win, kind, rest in cases:
        spec = torch.rand(*shape, dtype=torch.complex64)
        window = _window(kind, win)
        want = ref_inverse(spec, None, 0, window, n_fft, hop, win, rest["normalized"], True, rest["onesided"])
        params = _spec_params(n_fft, hop, win, 0, length=None, center=True, **rest)
        got = run_audio_op("torchaudio.functional.inverse_spectrogram", params, spec, "spectrogram", window, want)
        check(got, want)


def test_spectrogram_then_inverse_recovers_the_waveform():
    torch.manual_seed(1)
    x = torch.randn(2, 300)
    window = torch.hann_window(32)
    spec = ref_spectrogram(x, 4, window, 32, 8, 32, None, "window", True, "reflect", True)
    params = _spec_params(32, 8, 32, 4, length=300, normalized="window", center=True, onesided=True)
    got = run_audio_op("torchaudio.functional.inverse_spectrogram", params, spec, "spectrogram", window, x)
    check(got, x, tol=1e-5)


# --- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(normalized="energy"), r"normalized='energy'"),
        (dict(power=0), r"power=0"),
        (dict(pad=-1), r"pad=-1"),
        (dict(win_length=16), r"window of shape \(32,\): expected \(16,\)"),
    ],
)
def test_spectrogram_refuses_bad_parameters_naming_the_node(change, message):
    x, window = torch.randn(100), torch.hann_window(32)
    want = ref_spectrogram(x, 0, window, 32, 8, 32, 2, False, True, "reflect", True)
    params = _spec_params(32, 8, 32, 0, power=2, normalized=False, center=True, pad_mode="reflect", onesided=True)
    params.update(change)
    with pytest.raises(PmxCompileError, match=r"torchaudio\.functional\.spectrogram.*line 5.*" + message):
        run_audio_op("torchaudio.functional.spectrogram", params, x, "waveform", window, want)


def test_inverse_spectrogram_refuses_a_real_input_and_wrong_bins():
    window = torch.hann_window(16)
    params = _spec_params(16, 4, 16, 0, length=None, normalized=False, center=True, onesided=True)
    with pytest.raises(PmxCompileError, match=r"inverse_spectrogram.*expected a complex"):
        run_audio_op(
            "torchaudio.functional.inverse_spectrogram",
            params,
            torch.randn(9, 5),
            "spectrogram",
            window,
            torch.zeros(16),
        )
    with pytest.raises(PmxCompileError, match=r"inverse_spectrogram.*10 frequency bins: expected 9"):
        run_audio_op(
            "torchaudio.functional.inverse_spectrogram",
            params,
            torch.randn(10, 5, dtype=torch.complex64),
            "spectrogram",
            window,
            torch.zeros(16),
        )
