"""Complex tensors and spectral ops: torch.complex / real / imag / view_as_real /
view_as_complex keep their names; every torch.fft.* spelling becomes one `fft` op with
explicit axes and signal lengths (torch's n / s / dim defaults resolved here, once);
torch.stft / torch.istft become stft / istft with their defaults resolved;
torchaudio's spectrogram / inverse_spectrogram become those plus pad, reshape, slice and
elementwise steps.
"""

from pmx.compiler.canon import data_input, fail, in_shape, make, param, rule
from pmx.runtime import expr as E

NORMS = ("backward", "forward", "ortho")


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


@rule("torch.complex")
def complex_(node, ctx):
    re = node.named_input("real")
    im = node.named_input("imag")
    if re is None or im is None:
        re, im = data_input(node, "real", 0), data_input(node, "imag", 1)
    if re.dtype != im.dtype or re.dtype not in ("float32", "float64"):
        fail(node, f"real ({re.dtype}) and imag ({im.dtype}) must both be float32 or both float64")
    return [make(node, "complex", [re, im])]


def _unary(op):
    def fn(node, ctx):
        return [make(node, op, [data_input(node)])]

    return fn


rule("torch.real", "Tensor.real")(_unary("real"))
rule("torch.imag", "Tensor.imag")(_unary("imag"))
rule("torch.view_as_real")(_unary("view_as_real"))
rule("torch.view_as_complex")(_unary("view_as_complex"))


def _norm(node):
    norm = param(node, "norm", None)
    norm = "backward" if norm is None else norm
    if norm not in NORMS:
        fail(node, f"norm={norm!r}: expected one of {', '.join(NORMS)}")
    return norm


def _axis(node, d, rank):
    if not _int(d) or not -rank <= d < rank:
        fail(node, f"dim={d!r} out of range for an input of rank {rank}")
    return d % rank


def _fft_rule(kind, ndims):
    """ndims 1 (n, dim), 2 (s, dim=(-2, -1)) or None (n-d: s, dim)."""

    def fn(node, ctx):
        x = data_input(node)
        rank = len(in_shape(node, x))
        if ndims == 1:
            n = param(node, "n", None)
            axes = (_axis(node, param(node, "dim", -1), rank),)
            if n is not None and (not _int(n) or n < 1):
                fail(node, f"n={n!r} must be a positive int")
            lengths = (n or 0,)
        else:
            s = param(node, "s", None)
            dim = param(node, "dim", (-2, -1) if ndims == 2 else None)
            if _int(dim):
                dim = (dim,)
            if s is not None and (not isinstance(s, tuple) or not all(_int(v) and (v > 0 or v == -1) for v in s)):
                fail(node, f"s={s!r}: expected a tuple of positive ints (-1 keeps a dim's size)")
            if dim is None:
                axes = tuple(range(rank)) if s is None else tuple(range(rank - len(s), rank))
            elif isinstance(dim, tuple):
                axes = tuple(_axis(node, d, rank) for d in dim)
            else:
                fail(node, f"dim={dim!r}: expected an int, a tuple of ints or None")
            if len(set(axes)) != len(axes) or (s is not None and len(s) != len(axes)) or not axes:
                fail(node, f"s={s!r} and dim={dim!r} do not name distinct dims of a rank-{rank} input one to one")
            lengths = tuple(max(v, 0) for v in s) if s is not None else (0,) * len(axes)
        if kind in ("rfft", "ihfft") and x.dtype.startswith("complex"):
            fail(node, f"torch.fft.{kind} needs a real input, got {x.dtype}")
        attrs = dict(kind=kind, axes=axes, lengths=lengths, norm=_norm(node))
        return [make(node, "fft", [x], attrs)]

    return fn


for _kind in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft"):
    rule(f"torch.fft.{_kind}")(_fft_rule(_kind, 1))
    rule(f"torch.fft.{_kind}2")(_fft_rule(_kind, 2))
    rule(f"torch.fft.{_kind}n")(_fft_rule(_kind, None))


def _window(node, n_fft, win_length):
    w = node.named_input("window")
    if w is None:
        return None
    shape = in_shape(node, w)
    if tuple(shape) != (win_length,):
        fail(node, f"window of shape {shape}: expected ({win_length},) (win_length)")
    return w


def _frame_params(node):
    n_fft = param(node, "n_fft")
    if not _int(n_fft) or n_fft < 1:
        fail(node, f"n_fft={n_fft!r} must be a positive int")
    hop = param(node, "hop_length", None)
    hop = n_fft // 4 if hop is None else hop
    win = param(node, "win_length", None)
    win = n_fft if win is None else win
    if not _int(hop) or hop < 1:
        fail(node, f"hop_length={hop!r} must be a positive int")
    if not _int(win) or not 0 < win <= n_fft:
        fail(node, f"win_length={win!r} must be an int in [1, n_fft={n_fft}]")
    return n_fft, hop, win


@rule("torch.stft", "Tensor.stft")
def stft(node, ctx):
    x = data_input(node)
    shape = in_shape(node, x)
    if len(shape) not in (1, 2):
        fail(node, f"input of shape {shape}: expected (T,) or (B, T)")
    n_fft, hop, win = _frame_params(node)
    window = _window(node, n_fft, win)
    onesided = param(node, "onesided", None)
    is_complex = x.dtype.startswith("complex") or (window is not None and window.dtype.startswith("complex"))
    if onesided is None:
        onesided = not is_complex
    if onesided and is_complex:
        fail(node, "onesided=True needs a real input and window")
    pad_mode = param(node, "pad_mode", "reflect")
    if pad_mode not in ("reflect", "constant", "replicate", "circular"):
        fail(node, f"pad_mode={pad_mode!r}: expected reflect, constant, replicate or circular")
    center = bool(param(node, "center", True))
    if center and pad_mode == "reflect" and shape[-1] <= n_fft // 2:
        fail(node, f"reflect padding of {n_fft // 2} needs more than {n_fft // 2} samples, got {shape[-1]}")
    if param(node, "return_complex", True) is not True:
        fail(node, "return_complex=False is not supported (torch deprecates it): export with return_complex=True")
    attrs = dict(
        n_fft=n_fft,
        hop_length=hop,
        win_length=win,
        center=center,
        pad_mode=pad_mode,
        normalized=bool(param(node, "normalized", False)),
        onesided=bool(onesided),
    )
    return [make(node, "stft", [x] + ([window] if window is not None else []), attrs)]


@rule("torch.istft", "Tensor.istft")
def istft(node, ctx):
    x = data_input(node)
    shape = in_shape(node, x)
    if len(shape) not in (2, 3) or not x.dtype.startswith("complex"):
        fail(node, f"input of shape {shape} ({x.dtype}): expected a complex (F, frames) or (B, F, frames)")
    n_fft, hop, win = _frame_params(node)
    window = _window(node, n_fft, win)
    onesided = param(node, "onesided", None)
    if onesided is None:
        onesided = shape[-2] != n_fft
    bins = n_fft // 2 + 1 if onesided else n_fft
    if shape[-2] != bins:
        fail(node, f"input has {shape[-2]} frequency bins: expected {bins} for n_fft={n_fft}, onesided={onesided}")
    return_complex = bool(param(node, "return_complex", False))
    if return_complex and onesided:
        fail(node, "return_complex=True needs onesided=False")
    length = param(node, "length", None)
    if length is not None and (not _int(length) or length < 1):
        fail(node, f"length={length!r} must be a positive int")
    attrs = dict(
        n_fft=n_fft,
        hop_length=hop,
        win_length=win,
        center=bool(param(node, "center", True)),
        normalized=bool(param(node, "normalized", False)),
        onesided=bool(onesided),
        return_complex=return_complex,
        length=length or 0,
    )
    return [make(node, "istft", [x] + ([window] if window is not None else []), attrs)]


# --- torchaudio.functional.spectrogram / inverse_spectrogram ----------------------------


def _spec_norms(node):
    """torchaudio's `normalized` as (frame_length_norm, window_norm): True means "window"."""
    normalized = param(node, "normalized", False)
    if isinstance(normalized, bool):
        return False, normalized
    if normalized in ("frame_length", "window"):
        return normalized == "frame_length", normalized == "window"
    fail(node, f"normalized={normalized!r}: expected False, True, 'window' or 'frame_length'")


def _audio_params(node):
    n_fft, hop, win = _frame_params(node)
    window = _window(node, n_fft, win)
    if window is None:
        fail(node, "missing the window tensor ($window)")
    pad = param(node, "pad", 0)
    if not _int(pad) or pad < 0:
        fail(node, f"pad={pad!r} must be a non-negative int")
    return n_fft, hop, win, window, pad


def _unit_window(node, ctx, window):
    """window / sqrt(sum(window^2)) as nodes (folded when the window is a weight).

    torchaudio divides the spectrum by the window's L2 norm ("window" normalization) and the
    inverse multiplies it back before istft; stft is linear in the window and istft inversely
    so, so scaling the window does both without arithmetic on complex tensors."""
    w = window
    squares = ctx.temp(node, tuple(w.shape), w.dtype, "wsq")
    total = ctx.temp(node, (1,), w.dtype, "wsum")
    unit = ctx.temp(node, tuple(w.shape), w.dtype, "wunit")
    nodes = [
        make(
            node, "elementwise", [w], outputs=[squares], expr=E.call("mul", E.at(0), E.at(0)), name=f"{node.name}.wsq"
        ),
        make(node, "reduce_sum", [squares], dict(axes=(0,), keepdim=True), outputs=[total], name=f"{node.name}.wsum"),
        make(
            node,
            "elementwise",
            [w, total],
            outputs=[unit],
            expr=E.call("div", E.at(0), E.call("sqrt", E.at(1))),
            name=f"{node.name}.wunit",
        ),
    ]
    return nodes, unit


def _complex_dtype(dtype):
    return "complex128" if dtype in ("float64", "complex128") else "complex64"


def _batched(node, ctx, nodes, x, keep):
    """x with its leading dims (all but the last `keep`) merged into one, as torchaudio packs
    a batch of any rank for torch.stft / istft, which take at most one batch dim."""
    shape = tuple(x.shape)
    if len(shape) <= keep + 1:
        return x
    n = 1
    for d in shape[:-keep]:
        n *= d
    flat = ctx.temp(node, (n,) + shape[-keep:], x.dtype, "flat")
    nodes.append(make(node, "reshape", [x], dict(shape=flat.shape), outputs=[flat], name=f"{node.name}.flat"))
    return flat


def _unbatched(node, ctx, nodes, y, lead):
    if len(lead) <= 1:
        return y
    keep = tuple(y.shape[1:])
    out = ctx.temp(node, tuple(lead) + keep, y.dtype, "unflat")
    nodes.append(make(node, "reshape", [y], dict(shape=out.shape), outputs=[out], name=f"{node.name}.unflat"))
    return out


def _finish(node, nodes, last):
    """The last step writes the node's own output (its recorded shape must agree)."""
    want = node.outputs[0].shape
    if want is not None and None not in want and tuple(want) != tuple(last.shape):
        fail(node, f"computed output shape {tuple(last.shape)} differs from the recorded {tuple(want)}")
    nodes[-1].outputs = list(node.outputs)
    return nodes


@rule("torchaudio.functional.spectrogram")
def spectrogram(node, ctx):
    """torchaudio.functional.spectrogram: zero pad, stft (frame_length normalization is
    torch.stft's normalized=True), window normalization, then |X| ** power (None: complex)."""
    x = data_input(node, "waveform")
    shape = tuple(in_shape(node, x))
    if not shape:
        fail(node, "waveform must have a time dim: expected (..., time)")
    n_fft, hop, win, window, pad = _audio_params(node)
    frame_norm, window_norm = _spec_norms(node)
    power = param(node, "power", None)
    if power is not None and (not isinstance(power, (int, float)) or isinstance(power, bool) or not power > 0):
        fail(node, f"power={power!r}: expected None or a number > 0")
    center = bool(param(node, "center", True))
    pad_mode = param(node, "pad_mode", "reflect")
    if pad_mode not in ("reflect", "constant", "replicate", "circular"):
        fail(node, f"pad_mode={pad_mode!r}: expected reflect, constant, replicate or circular")
    onesided = bool(param(node, "onesided", True))
    if onesided and (x.dtype.startswith("complex") or window.dtype.startswith("complex")):
        fail(node, "onesided=True needs a real waveform and window")
    t = shape[-1] + 2 * pad
    if center and pad_mode == "reflect" and t <= n_fft // 2:
        fail(node, f"reflect padding of {n_fft // 2} needs more than {n_fft // 2} samples, got {t}")
    n = t + (2 * (n_fft // 2) if center else 0)
    if n < n_fft:
        fail(node, f"{t} samples (after padding) are fewer than n_fft={n_fft}")
    nodes = []
    if pad:
        padded = ctx.temp(node, shape[:-1] + (t,), x.dtype, "pad")
        nodes.append(
            make(
                node,
                "pad",
                [x],
                dict(pads=(pad, pad), mode="constant", value=0.0),
                outputs=[padded],
                name=f"{node.name}.pad",
            )
        )
        x = padded
    if window_norm:
        more, window = _unit_window(node, ctx, window)
        nodes += more
    flat = _batched(node, ctx, nodes, x, 1)
    bins = n_fft // 2 + 1 if onesided else n_fft
    spec = ctx.temp(node, tuple(flat.shape[:-1]) + (bins, 1 + (n - n_fft) // hop), _complex_dtype(x.dtype), "stft")
    attrs = dict(
        n_fft=n_fft,
        hop_length=hop,
        win_length=win,
        center=center,
        pad_mode=pad_mode,
        normalized=frame_norm,
        onesided=onesided,
    )
    nodes.append(make(node, "stft", [flat, window], attrs, outputs=[spec], name=f"{node.name}.stft"))
    spec = _unbatched(node, ctx, nodes, spec, shape[:-1])
    if power is not None:
        expr = E.call("abs", E.at(0))
        if power != 1:
            expr = E.call("pow", expr, float(power))
        mag = ctx.temp(node, tuple(spec.shape), "float64" if spec.dtype == "complex128" else "float32", "power")
        nodes.append(make(node, "elementwise", [spec], outputs=[mag], expr=expr, name=f"{node.name}.power"))
        spec = mag
    return _finish(node, nodes, spec)


@rule("torchaudio.functional.inverse_spectrogram")
def inverse_spectrogram(node, ctx):
    """torchaudio.functional.inverse_spectrogram: window normalization undone, istft (of
    length + 2 * pad when length is given, then the pad cut off both ends)."""
    x = data_input(node, "spectrogram")
    shape = tuple(in_shape(node, x))
    if len(shape) < 2 or not x.dtype.startswith("complex"):
        fail(node, f"spectrogram of shape {shape} ({x.dtype}): expected a complex (..., freq, time)")
    n_fft, hop, win, window, pad = _audio_params(node)
    frame_norm, window_norm = _spec_norms(node)
    onesided = bool(param(node, "onesided", True))
    bins = n_fft // 2 + 1 if onesided else n_fft
    if shape[-2] != bins:
        fail(
            node, f"spectrogram has {shape[-2]} frequency bins: expected {bins} for n_fft={n_fft}, onesided={onesided}"
        )
    length = param(node, "length", None)
    if length is not None and (not _int(length) or length < 1):
        fail(node, f"length={length!r} must be None or a positive int")
    center = bool(param(node, "center", True))
    nodes = []
    if window_norm:
        more, window = _unit_window(node, ctx, window)
        nodes += more
    flat = _batched(node, ctx, nodes, x, 2)
    if length is None:
        n = n_fft + hop * (shape[-1] - 1) - (2 * (n_fft // 2) if center else 0)
    else:
        n = length + 2 * pad
    if n < 1:
        fail(node, f"the inverse has {n} samples: too few frames ({shape[-1]}) for n_fft={n_fft}")
    wave = ctx.temp(node, tuple(flat.shape[:-2]) + (n,), "float64" if x.dtype == "complex128" else "float32", "istft")
    attrs = dict(
        n_fft=n_fft,
        hop_length=hop,
        win_length=win,
        center=center,
        normalized=frame_norm,
        onesided=onesided,
        return_complex=False,
        length=0 if length is None else n,
    )
    nodes.append(make(node, "istft", [flat, window], attrs, outputs=[wave], name=f"{node.name}.istft"))
    if length is not None and pad > 0:
        cut = ctx.temp(node, tuple(wave.shape[:-1]) + (length,), wave.dtype, "unpad")
        rank = len(wave.shape)
        attrs = dict(axes=(rank - 1,), starts=(pad,), ends=(pad + length,), steps=(1,), squeeze=())
        nodes.append(make(node, "slice", [wave], attrs, outputs=[cut], name=f"{node.name}.unpad"))
        wave = cut
    wave = _unbatched(node, ctx, nodes, wave, shape[:-2])
    return _finish(node, nodes, wave)
