"""Exact GELU by a normal-CDF table: the numpy backend's one special step, used in place
of the generic program when an expression is GELU over one float32 input (ViT's and
ConvNeXt's MLPs). Its gathers and float64 tail do not fit the generic program of ufunc
steps (numpy_backend.py), hence a module of its own.
"""

import functools
import math

import numpy as np

from pmx.runtime.expr.special import _ERFC_P


def _special_numpy_step(tree, inputs, out):
    """The table form of exact GELU (ViT's MLPs: the generic erfc form is ~30 ufunc
    passes plus an exp per element) when `tree` is GELU over one float32 input of out's
    shape, else None. Its gathers and float64 tail have no place in the generic program
    of ufunc steps, hence a step of its own."""
    x = _gelu_operand(tree, inputs)
    if x is None or out.dtype != np.float32 or x.dtype != np.float32 or x.shape != out.shape:
        return None
    return _gelu_table_step(x, out)


def _gelu_operand(tree, inputs):
    """The input array when tree is GELU as canonicalization writes it,
    mul(mul(@i,0.5),erfc(mul(@i,-1/sqrt(2)))), else None."""
    if tree[0] != "mul":
        return None
    a, b = tree[1], tree[2]
    if not (
        a[0] == "mul"
        and a[1][0] == "@"
        and a[2] == ("#", 0.5)
        and b[0] == "erfc"
        and b[1][0] == "mul"
        and b[1][1] == a[1]
        and b[1][2][0] == "#"
        and isinstance(b[1][2][1], float)
        and abs(b[1][2][1] + math.sqrt(0.5)) < 1e-12
    ):
        return None
    x = inputs[a[1][1]]
    return x if isinstance(x, np.ndarray) else None


# Exact GELU, x * Phi(x) (Phi the normal CDF), by a table: Phi at the multiples k * step
# of step = 2^-GELU_TABLE_BITS in [GELU_TABLE_LO, GELU_TABLE_HI), interpolated linearly
# from the exact offset of x in its step. Relative error <= ~2e-6 (the interpolation's
# h^2/8 * x^2 at x = -8, measured 2.0e-6), against ~6e-6 for the generic erfc form. x
# below the table (GELU(x) < 5e-15 in magnitude) takes erfc in float64 on those elements
# only; x above it has Phi = 1 to float32. ms for ViT-B/16's 197x3072 MLP tensor, one
# thread: generic 6.3, table 3.4 (two np.take gathers are ~1.5 of it; a complex64 table
# gathered once and read through .real/.imag took 4.1).
GELU_TABLE_LO, GELU_TABLE_HI, GELU_TABLE_BITS = -8.0, 6.0, 11


@functools.cache
def _gelu_tables():
    """(Phi at each step's left end, Phi's rise over the step), float32, row i for the
    step starting at GELU_TABLE_LO + i * step; built once per process (its cost:
    docs/performance.md, "Kernel measurements")."""
    step = 2.0**-GELU_TABLE_BITS
    xs = GELU_TABLE_LO + step * np.arange(int((GELU_TABLE_HI - GELU_TABLE_LO) / step) + 1)
    phi = 0.5 * _erfc_float64(-xs / math.sqrt(2))
    return phi[:-1].astype(np.float32), np.diff(phi).astype(np.float32)


def _erfc_float64(z):
    """erfc of a float64 array: the fit _erfc_abs writes as a tree (relative error
    < 1.2e-7), evaluated directly. The tail's size changes from run to run, and compiling
    the tree for each size was measured too costly per call (docs/performance.md, "Kernel
    measurements")."""
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = np.zeros_like(t)
    for c in reversed(_ERFC_P):
        poly = poly * t + c
    e = t * np.exp(poly - a * a)
    return np.where(z < 0, 2.0 - e, e)


def _gelu_table_step(x, out):
    """x is scaled to steps first (a power of two: exact), so the floor is the step's
    integer left end and the offset in the step is the difference, both exact, in three
    passes; the row is the left end less the table's first step, and int64 rows spare
    np.take a conversion of its own. The form before it offset x by GELU_TABLE_LO
    first, which rounds for |x| < 4, and took int32 rows: same accuracy (max relative
    error 1.97e-6 over [-13, 8], 1.39e-6 on N(0, 1.5^2) samples), and this form measured
    faster on ConvNeXt-tiny's first MLP and ViT-B/16's. Splitting the passes into blocks
    that stay in cache gained nothing (docs/performance.md, "Kernel measurements")."""
    phi_at, rise = _gelu_tables()
    inv_step = np.float32(2.0**GELU_TABLE_BITS)
    first = np.float32(GELU_TABLE_LO * inv_step)  # in steps, as the scaled x below
    last = np.float32(GELU_TABLE_HI * inv_step - 1)
    lo = np.float32(GELU_TABLE_LO)
    steps, left, phi = (np.empty_like(out) for _ in range(3))
    row = np.empty(out.shape, np.intp)
    below = np.empty(out.shape, bool)

    def run():
        np.multiply(x, inv_step, out=steps)
        np.clip(steps, first, last, out=steps)  # NaN stays NaN, and its row is clipped by take
        np.floor(steps, out=left)
        np.subtract(steps, left, out=steps)  # x's offset in its step, in steps
        np.subtract(left, first, out=left)
        with np.errstate(invalid="ignore"):  # NaN to int
            np.copyto(row, left, casting="unsafe")
        np.take(phi_at, row, out=phi, mode="clip")
        np.take(rise, row, out=left, mode="clip")
        np.multiply(steps, left, out=steps)
        np.add(phi, steps, out=phi)
        np.less(x, lo, out=below)
        # index arrays (x and out may be strided views), read before out (maybe x) is written
        tail = np.unravel_index(np.flatnonzero(below), below.shape) if below.any() else None
        tail_x = x[tail].astype(np.float64) if tail is not None else None
        np.multiply(x, phi, out=out)
        if tail is not None:
            out[tail] = 0.5 * tail_x * _erfc_float64(-tail_x / math.sqrt(2))

    return run
