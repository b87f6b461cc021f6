"""Composite functions written as trees of primitives both backends share (desugar): erf
and erfc to float32 accuracy, SiLU as one divide, pnnx's binary max/min as maximum and
minimum. Neither backend needs kernels of its own for them; the erfc fit's coefficients
are also read by the numpy backend's GELU table (gelu.py).
"""

import math

# erfc(a), a >= 0: t * exp(-a^2 + P(t)), t = 1 / (1 + a/2) (Numerical Recipes' erfcc,
# Chebyshev fit, relative error < 1.2e-7 for every a); P's coefficients, constant first.
_ERFC_P = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)
# erf(z) = 2/sqrt(pi) * z * S(z^2) for |z| < 0.5 (Taylor to z^11), where 1 - erfc loses
# relative accuracy
_ERF_TAYLOR = (1.0, -1 / 3, 1 / 10, -1 / 42, 1 / 216, -1 / 1320)


def _c(v):
    return ("#", v)


def _horner(coeffs, t):
    poly = _c(coeffs[-1])
    for a in reversed(coeffs[:-1]):
        poly = ("add", ("mul", poly, t), _c(a))
    return poly


def _erfc_abs(a):
    t = ("reciprocal", ("add", _c(1.0), ("mul", _c(0.5), a)))
    return ("mul", t, ("exp", ("sub", _horner(_ERFC_P, t), ("mul", a, a))))


# Branches are blended arithmetically, not with where(): numpy's masked copies cost
# ~4 ns per element on a sign that changes at random (GELU's input), ~20x an add; a
# 0/1 mask from a saturated scale costs two cheap passes. 2^100 saturates every float32
# difference that matters here (the smallest nonzero |z| - 0.5 is 2^-25).
_SATURATE = 2.0**100


def _mask_negative(z):
    """1 where z < 0, else 0 (a fraction only for -2^-100 < z < 0, where both branches
    it selects between agree to float32 anyway); NaN stays NaN."""
    return ("minimum", ("maximum", ("mul", z, _c(-_SATURATE)), _c(0.0)), _c(1.0))


def _blend(mask, if_zero, if_one):
    """if_zero + mask * (if_one - if_zero): the branch the 0/1 mask selects (both finite)."""
    return ("add", if_zero, ("mul", mask, ("sub", if_one, if_zero)))


def _erf(z):
    a = ("abs", z)
    zc = ("minimum", ("maximum", z, _c(-0.5)), _c(0.5))  # the Taylor branch's range: stays finite
    small = ("mul", ("mul", _c(2 / math.sqrt(math.pi)), zc), _horner(_ERF_TAYLOR, ("mul", zc, zc)))
    sign = ("sub", _c(1.0), ("mul", _mask_negative(z), _c(2.0)))
    large = ("mul", sign, ("sub", _c(1.0), _erfc_abs(a)))
    beyond_half = (
        "minimum",
        ("maximum", ("add", ("mul", ("sub", a, _c(0.5)), _c(_SATURATE)), _c(1.0)), _c(0.0)),
        _c(1.0),
    )
    return _blend(beyond_half, small, large)


def _erfc(z):
    e = _erfc_abs(("abs", z))
    return _blend(_mask_negative(z), e, ("sub", _c(2.0), e))


def desugar(tree):
    """Rewrite spellings to the primitive set (erf and erfc to float32 accuracy, relative
    error < 4e-7 everywhere: a Taylor series near 0, erfc's Chebyshev fit elsewhere; pnnx's
    binary max/min are elementwise maximum/minimum), and SiLU, x * sigmoid(x), to
    x / (1 + exp(-x)): four numpy passes instead of five (the reciprocal and the multiply
    become one divide; EfficientNet has one after every conv). For x << 0, exp(-x)
    overflows to inf and x / inf is -0."""
    if tree[0] in ("@", "#"):
        return tree
    name, args = tree[0], [desugar(a) for a in tree[1:]]
    if name == "mul":
        a, b = args
        x = a if b == ("sigmoid", a) else b if a == ("sigmoid", b) else None
        if x is not None:
            return ("div", x, ("add", ("exp", ("neg", x)), _c(1.0)))
    if name == "max":
        name = "maximum"
    elif name == "min":
        name = "minimum"
    elif name == "erf":
        return _erf(args[0])
    elif name == "erfc":
        return _erfc(args[0])
    return (name, *args)
