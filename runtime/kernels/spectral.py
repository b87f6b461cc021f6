"""Complex tensors and discrete Fourier transforms (numpy.fft, cast to torch's dtypes).

`complex`          (real, imag) -> complex (broadcast), complex64 from float32.
`real`, `imag`     complex -> its real / imaginary part (a float copy).
`view_as_real`     complex (...) -> float (..., 2);  `view_as_complex` the reverse.
`fft`              attrs kind ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft"), axes (sorted
                   as torch lists them), lengths (the signal length per axis, 0 = the input's:
                   for irfft and hfft the last axis's default is 2 * (m - 1)), norm
                   ("backward", "forward", "ortho"). hfft and ihfft are irfft and rfft of the
                   conjugate with the dual normalization, as torch defines them.
`stft`             attrs n_fft, hop_length, win_length, center, pad_mode, normalized,
                   onesided; inputs signal (B?, T) and window (win_length,) or absent.
`istft`            attrs n_fft, hop_length, win_length, center, normalized, onesided,
                   length (0 = the natural one); inputs spectrum (B?, F, frames) and window.
                   A real inverse reads the first n_fft // 2 + 1 bins only, as torch does.

Dtypes: complex64 unless an input is float64/complex128 (then complex128); real outputs of
complex inputs are the matching float dtype.
"""

import numpy as np

from pmx.runtime.errors import PmxInputError
from pmx.runtime.kernels.attr_specs import (
    FLAG,
    NON_NEGATIVE,
    POSITIVE,
    distinct_axes,
    integer,
    ints,
    length_of,
    one_of,
    optional,
)
from pmx.runtime.kernels.registry import register, rows_off_axis

COMPLEX_OF = {
    np.dtype("float32"): np.dtype("complex64"),
    np.dtype("float64"): np.dtype("complex128"),
    np.dtype("float16"): np.dtype("complex64"),
    np.dtype("complex64"): np.dtype("complex64"),
    np.dtype("complex128"): np.dtype("complex128"),
}
REAL_OF = {np.dtype("complex64"): np.dtype("float32"), np.dtype("complex128"): np.dtype("float64")}
DUAL_NORM = {"backward": "forward", "forward": "backward", "ortho": "ortho"}


def complex_of(dtype):
    return COMPLEX_OF.get(np.dtype(dtype), np.dtype("complex64"))


def real_of(dtype):
    dtype = np.dtype(dtype)
    return REAL_OF.get(dtype, dtype if dtype.kind == "f" else np.dtype("float32"))


# --- complex <-> real ------------------------------------------------------------------


def complex_infer(node, shapes, dtypes):
    return [(tuple(np.broadcast_shapes(tuple(shapes[0]), tuple(shapes[1]))), complex_of(dtypes[0]))]


@register("complex", infer=complex_infer, rows=True)
def make_complex(node, inputs, outputs, ctx):
    re, im, out = inputs[0], inputs[1], outputs[0]

    def run():
        out.real[...] = re
        out.imag[...] = im

    return run


def part_infer(node, shapes, dtypes):
    return [(tuple(shapes[0]), real_of(dtypes[0]))]


def _part(take):
    def make(node, inputs, outputs, ctx):
        x, out = inputs[0], outputs[0]
        return lambda: np.copyto(out, take(x), casting="unsafe")

    return make


register("real", infer=part_infer, rows=True)(_part(np.real))
register("imag", infer=part_infer, rows=True)(_part(np.imag))


def view_as_real_infer(node, shapes, dtypes):
    return [(tuple(shapes[0]) + (2,), real_of(dtypes[0]))]


@register("view_as_real", infer=view_as_real_infer, rows=True)
def make_view_as_real(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]

    def run():
        out[..., 0] = x.real
        out[..., 1] = x.imag

    return run


def view_as_complex_infer(node, shapes, dtypes):
    x = tuple(shapes[0])
    if not x or x[-1] != 2:
        raise ValueError(f"view_as_complex needs a last dim of size 2, got {x}")
    return [(x[:-1], complex_of(dtypes[0]))]


@register("view_as_complex", infer=view_as_complex_infer, rows=True)
def make_view_as_complex(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]

    def run():
        out.real[...] = x[..., 0]
        out.imag[...] = x[..., 1]

    return run


# --- fft ---------------------------------------------------------------------------------


def fft_lengths(kind, shape, axes, lengths):
    """The signal length per axis (0 in `lengths` resolved from the input shape)."""
    resolved = []
    for i, (a, n) in enumerate(zip(axes, lengths)):
        if n <= 0:
            m = shape[a]
            n = 2 * (m - 1) if kind in ("irfft", "hfft") and i == len(axes) - 1 else m
        resolved.append(n)
    return tuple(resolved)


def fft_infer(node, shapes, dtypes):
    a = node.attrs
    kind, axes = a["kind"], tuple(a["axes"])
    shape = list(shapes[0])
    lengths = fft_lengths(kind, shape, axes, tuple(a["lengths"]))
    if min(lengths, default=1) < 1:
        raise ValueError(f"{kind}: invalid signal lengths {lengths} for input {tuple(shapes[0])}")
    if kind in ("rfft", "ihfft") and np.dtype(dtypes[0]).kind == "c":
        raise ValueError(f"{kind} needs a real input, got {np.dtype(dtypes[0]).name}")
    for ax, n in zip(axes, lengths):
        shape[ax] = n
    if kind in ("rfft", "ihfft"):
        shape[axes[-1]] = lengths[-1] // 2 + 1
    dtype = real_of(dtypes[0]) if kind in ("irfft", "hfft") else complex_of(dtypes[0])
    return [(tuple(shape), dtype)]


def _transform(kind, lengths, axes, norm):
    if kind == "fft":
        return lambda x: np.fft.fftn(x, lengths, axes, norm)
    if kind == "ifft":
        return lambda x: np.fft.ifftn(x, lengths, axes, norm)
    if kind == "rfft":
        return lambda x: np.fft.rfftn(x, lengths, axes, norm)
    if kind == "irfft":
        return lambda x: np.fft.irfftn(x, lengths, axes, norm)
    if kind == "hfft":
        return lambda x: np.fft.irfftn(np.conj(x), lengths, axes, DUAL_NORM[norm])
    if kind == "ihfft":
        return lambda x: np.conj(np.fft.rfftn(x, lengths, axes, DUAL_NORM[norm]))
    raise ValueError(f"unknown fft kind {kind!r}")


# axes first: lengths holds one entry per axis
@register(
    "fft",
    infer=fft_infer,
    attrs=dict(
        kind=one_of("fft", "ifft", "rfft", "irfft", "hfft", "ihfft"),
        axes=distinct_axes(min_length=1),
        lengths=ints(length_of("axes"), lo=0),
        norm=optional(one_of("backward", "forward", "ortho")),
    ),
    rows=rows_off_axis("axes"),
)
def make_fft(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    a = node.attrs
    kind, axes = a["kind"], tuple(a["axes"])
    lengths = fft_lengths(kind, x.shape, axes, tuple(a["lengths"]))
    fn = _transform(kind, lengths, axes, a.get("norm", "backward"))
    if kind in ("rfft", "ihfft") and x.dtype.kind == "c":
        raise ValueError(f"{kind} needs a real input, got {x.dtype}")
    return lambda: np.copyto(out, fn(x), casting="unsafe")


# --- stft / istft ------------------------------------------------------------------------


# n_fft first: the window is at most as long
FRAMES_ATTRS = dict(
    n_fft=POSITIVE,
    hop_length=POSITIVE,
    win_length=integer(1, lambda attrs, ranks: attrs["n_fft"]),
    center=FLAG,
    normalized=FLAG,
)


def _check_window(node, shapes):
    """The optional window input (input 1) holds win_length samples."""
    if len(shapes) > 1 and tuple(shapes[1]) != (node.attrs["win_length"],):
        raise ValueError(f"window {tuple(shapes[1])} does not hold win_length={node.attrs['win_length']} samples")


def _frames(n, n_fft, hop):
    return 1 + (n - n_fft) // hop


def stft_infer(node, shapes, dtypes):
    a = node.attrs
    x = tuple(shapes[0])
    n_fft, hop = a["n_fft"], a["hop_length"]
    _check_window(node, shapes)
    n = x[-1] + (2 * (n_fft // 2) if a["center"] else 0)
    if n < n_fft:
        raise ValueError(f"stft: signal of {x[-1]} samples is shorter than n_fft={n_fft}")
    bins = n_fft // 2 + 1 if a["onesided"] else n_fft
    return [(x[:-1] + (bins, _frames(n, n_fft, hop)), complex_of(dtypes[0]))]


def _window(window, n_fft, win_length, dtype):
    """The window zero-padded to n_fft, centred (torch's rule for win_length < n_fft)."""
    w = np.ones(win_length, dtype) if window is None else np.asarray(window, dtype)
    full = np.zeros(n_fft, dtype)
    left = (n_fft - win_length) // 2
    full[left : left + win_length] = w
    return full


@register(
    "stft",
    infer=stft_infer,
    attrs=dict(FRAMES_ATTRS, onesided=FLAG, pad_mode=one_of("reflect", "constant", "replicate", "circular")),
)
def make_stft(node, inputs, outputs, ctx):
    a = node.attrs
    x, out = inputs[0], outputs[0]
    window = inputs[1] if len(inputs) > 1 else None
    n_fft, hop, center = a["n_fft"], a["hop_length"], bool(a["center"])
    onesided, normalized = bool(a["onesided"]), bool(a["normalized"])
    pad = n_fft // 2 if center else 0
    pad_mode = {"reflect": "reflect", "constant": "constant", "replicate": "edge", "circular": "wrap"}[a["pad_mode"]]
    real_dtype = real_of(x.dtype)
    frames = out.shape[-1]
    idx = (np.arange(frames) * hop)[:, None] + np.arange(n_fft)  # each frame's sample positions

    def run():
        w = _window(window, n_fft, a["win_length"], real_dtype)
        sig = x
        if pad:
            sig = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode=pad_mode)
        seg = sig[..., idx] * w  # (..., frames, n_fft)
        spec = np.fft.rfft(seg, axis=-1) if onesided and seg.dtype.kind != "c" else np.fft.fft(seg, axis=-1)
        if onesided and spec.shape[-1] != n_fft // 2 + 1:
            spec = spec[..., : n_fft // 2 + 1]
        if normalized:
            spec = spec / np.sqrt(n_fft)
        np.copyto(out, np.swapaxes(spec, -1, -2), casting="unsafe")

    return run


def istft_infer(node, shapes, dtypes):
    a = node.attrs
    x = tuple(shapes[0])
    n_fft, hop, frames = a["n_fft"], a["hop_length"], x[-1]
    _check_window(node, shapes)
    length = a.get("length", 0)
    if not length:
        length = n_fft + hop * (frames - 1) - (2 * (n_fft // 2) if a["center"] else 0)
    dtype = complex_of(dtypes[0]) if a.get("return_complex") else real_of(dtypes[0])
    return [(x[:-2] + (length,), dtype)]


# onesided: written by the compiler; a real inverse reads the first n_fft // 2 + 1 bins
# either way
@register(
    "istft",
    infer=istft_infer,
    attrs=dict(FRAMES_ATTRS, onesided=optional(FLAG), length=optional(NON_NEGATIVE), return_complex=optional(FLAG)),
)
def make_istft(node, inputs, outputs, ctx):
    a = node.attrs
    x, out = inputs[0], outputs[0]
    window = inputs[1] if len(inputs) > 1 else None
    n_fft, hop, center = a["n_fft"], a["hop_length"], bool(a["center"])
    normalized = bool(a["normalized"])
    return_complex = bool(a.get("return_complex"))
    frames = x.shape[-1]
    total = n_fft + hop * (frames - 1)
    start = n_fft // 2 if center else 0
    length = out.shape[-1]
    real_dtype = real_of(x.dtype)
    idx = (np.arange(frames) * hop)[:, None] + np.arange(n_fft)

    def run():
        w = _window(window, n_fft, a["win_length"], real_dtype).astype(np.float64)
        spec = np.swapaxes(x, -1, -2).astype(np.complex128)  # (..., frames, bins)
        if normalized:
            spec = spec * np.sqrt(n_fft)
        if return_complex:
            seg = np.fft.ifft(spec, n_fft, axis=-1)
        else:
            # torch reads a real inverse from the first n_fft // 2 + 1 bins only (irfft), also
            # of a two-sided spectrum, whose other bins need not be their conjugate mirror
            seg = np.fft.irfft(spec[..., : n_fft // 2 + 1], n_fft, axis=-1)
        seg = seg * w
        lead = seg.shape[:-2]
        acc = np.zeros(lead + (total,), seg.dtype)
        env = np.zeros(total, np.float64)
        for f in range(frames):
            acc[..., idx[f]] += seg[..., f, :]
            env[idx[f]] += w * w
        end = min(start + length, total)
        y = acc[..., start:end]
        e = env[start:end]
        if e.size and np.abs(e).min() < 1e-11:
            # torch refuses too: those samples cannot be recovered (the NOLA condition fails)
            raise PmxInputError(
                f"{node.name} (istft): the window's overlap-add is zero at some samples "
                f"(n_fft={n_fft}, hop_length={hop}, win_length={a['win_length']})"
            )
        y = y / e
        out[...] = 0
        np.copyto(out[..., : end - start], y, casting="unsafe")

    return run
