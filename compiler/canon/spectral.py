"""Complex tensors and spectral ops: torch.complex / real / imag / view_as_real /
view_as_complex keep their names; every torch.fft.* spelling becomes one `fft` op with
explicit axes and signal lengths (torch's n / s / dim defaults resolved here, once);
torch.stft / torch.istft become stft / istft with their defaults resolved.
"""

from pmx.compiler.canon import data_input, fail, in_shape, make, param, rule

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
    attrs = dict(n_fft=n_fft, hop_length=hop, win_length=win, center=center, pad_mode=pad_mode,
                 normalized=bool(param(node, "normalized", False)), onesided=bool(onesided))
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
    attrs = dict(n_fft=n_fft, hop_length=hop, win_length=win, center=bool(param(node, "center", True)),
                 normalized=bool(param(node, "normalized", False)), onesided=bool(onesided),
                 return_complex=return_complex, length=length or 0)
    return [make(node, "istft", [x] + ([window] if window is not None else []), attrs)]
