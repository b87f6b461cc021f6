"""The numpy functions the grammar's table (functions.py) names that numpy lacks as
ufuncs: sigmoid, rsqrt, floor_divide, where and lgamma, with the ufunc signature f(*args,
out=). The numpy backend runs them, and the dtype rules evaluate them on samples, so they
sit below both.
"""

import math

import numpy as np


def _sigmoid(x, out):
    np.negative(x, out=out)
    np.exp(out, out=out)
    np.add(out, 1, out=out)
    np.reciprocal(out, out=out)


def _rsqrt(x, out):
    np.sqrt(x, out=out)
    np.reciprocal(out, out=out)


def _floor_divide(a, b, out):
    if out.dtype.kind in "iu":  # integer floor division rounds toward -inf, as torch's
        np.floor_divide(a, b, out=out, casting="unsafe")
        return
    np.true_divide(a, b, out=out)
    np.floor(out, out=out)


def _where(c, a, b, out):
    np.copyto(out, b, casting="unsafe")
    np.copyto(out, a, where=c, casting="unsafe")


# Lanczos' approximation of the gamma function, g = 7 with 9 coefficients (the widely
# published set): relative error about 1e-15 in float64 for x >= 0.5.
_LANCZOS_G = 7.0
_LANCZOS = (
    0.99999999999980993,
    676.5203681218851,
    -1259.1392167224028,
    771.32342877765313,
    -176.61502916214059,
    12.507343278686905,
    -0.13857109526572012,
    9.9843695780195716e-6,
    1.5056327351493116e-7,
)
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _lgamma(x, out=None):
    """log|Gamma(x)| as torch.lgamma: Lanczos' series in float64 for x >= 0.5, the
    reflection log(pi / |sin(pi x)|) - lgamma(1 - x) below (sin's argument reduced to
    [-0.5, 0.5] first, exact for float32 x), +inf at the poles 0, -1, -2, ... and at
    +-inf. Error ~1e-14, absolute below 1 and relative above, far below float32's
    rounding; numpy has no lgamma, and math.lgamma per element measured slower
    (docs/performance.md, "Kernel measurements"). Its float64 temporaries are allocated
    per call: lgamma is rare in models."""
    x = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):
        reflect = x < 0.5
        z = np.where(reflect, -x, x - 1.0)  # for the reflected, 1 - x = z + 1
        series, tmp = np.full_like(z, _LANCZOS[0]), np.empty_like(z)
        for i, c in enumerate(_LANCZOS[1:], 1):
            np.add(z, i, out=tmp)
            np.divide(c, tmp, out=tmp)
            series += tmp
        np.add(z, _LANCZOS_G + 0.5, out=tmp)  # t
        z += 0.5
        z *= np.log(tmp)
        z -= tmp
        np.log(series, out=series)
        z += series
        z += _HALF_LOG_2PI  # lgamma(z + 1)
        if reflect.any():
            np.round(x, out=tmp)
            np.subtract(x, tmp, out=tmp)
            tmp *= np.pi
            np.sin(tmp, out=tmp)
            np.abs(tmp, out=tmp)
            np.divide(np.pi, tmp, out=tmp)
            np.log(tmp, out=tmp)
            tmp -= z
            np.copyto(z, tmp, where=reflect)
        z[np.isinf(x)] = np.inf
    if out is None:
        return z
    np.copyto(out, z, casting="unsafe")
    return out
