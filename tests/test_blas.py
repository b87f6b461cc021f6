"""runtime/blas.py: sgemm with beta = 1 called directly, and common.product, which uses it
to add a conv's or linear layer's bias (the oracle is numpy's float64 matmul); and the
blocked transpose, whose oracle is numpy's own transposed copy, bit for bit."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pmx.runtime import blas
from pmx.runtime.kernels import common


def _matrix(rng, shape, transposed, wider):
    """A float32 matrix of `shape` as BLAS may meet it: a transposed view, and/or a
    slice of a wider array (leading dimension past the row length)."""
    rows, cols = shape[::-1] if transposed else shape
    m = rng.standard_normal((rows, cols + wider)).astype(np.float32)[:, :cols]
    return m.T if transposed else m


def test_numpys_blas_has_sgemm_and_omatcopy_entry_points():
    """Without them every layer silently keeps matmul + add and every transpose numpy's
    strided copy; numpy's wheels (OpenBLAS) ship both."""
    assert blas._entry_point("sgemm") is not None
    assert blas._entry_point("somatcopy") is not None and blas._entry_point("domatcopy") is not None


@given(st.integers(2, 40), st.integers(2, 40), st.integers(2, 40), st.booleans(), st.booleans(),
       st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_sgemm_accumulate_adds_the_product(m, n, k, trans_a, trans_b, wider, wider_out, seed):
    rng = np.random.default_rng(seed)
    a = _matrix(rng, (m, k), trans_a, wider)
    b = _matrix(rng, (k, n), trans_b, wider)
    out_wide = rng.standard_normal((m, n + wider_out)).astype(np.float32)
    out, past_the_end = out_wide[:, :n], out_wide[:, n:].copy()
    before = out.copy()
    accumulate = blas.sgemm_accumulate(a, b, out)
    assert accumulate is not None
    for run in range(2):  # it adds on every call
        accumulate()
        want = before.astype(np.float64) + (run + 1) * (a.astype(np.float64) @ b.astype(np.float64))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out_wide[:, n:], past_the_end)


def test_sgemm_accumulate_declines_what_blas_cannot_take():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal((6, 5)).astype(np.float32)
    out = np.zeros((8, 5), np.float32)
    assert blas.sgemm_accumulate(a, b, out) is not None
    wide = np.zeros((8, 10), np.float32)
    declined = {
        "float64": (a.astype(np.float64), b.astype(np.float64), out.astype(np.float64)),
        "a vector product": (a[:1], b, out[:1]),
        "out with a column stride": (a, b, wide[:, ::2]),
        "out overlapping b": (np.zeros((6, 6), np.float32), wide[:6, :5], wide[:6, 1:6]),
        "a batch": (a[None], b[None], out[None]),
        "an operand strided both ways": (rng.standard_normal((16, 12)).astype(np.float32)[::2, ::2], b, out),
    }
    for why, operands in declined.items():
        assert blas.sgemm_accumulate(*operands) is None, why


def test_product_adds_the_bias_with_and_without_blas(monkeypatch):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((32, 24)).astype(np.float32)
    b = rng.standard_normal((24, 40)).astype(np.float32)
    want_plain = a.astype(np.float64) @ b.astype(np.float64)
    for enabled in (True, False):
        monkeypatch.setattr(blas, "ENABLED", enabled)
        for bias in (rng.standard_normal((32, 1)).astype(np.float32), rng.standard_normal(40).astype(np.float32), None):
            out = np.full((32, 40), np.nan, np.float32)
            common.product(a, b, out, bias)()
            want = want_plain if bias is None else want_plain + bias
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def _special_values(rng, shape, dtype):
    """Random values with NaN, +-inf, -0.0 and subnormals sprinkled in."""
    x = rng.standard_normal(shape).astype(dtype)
    tiny = np.finfo(dtype).smallest_subnormal
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, tiny, -3 * tiny, np.finfo(dtype).max], dtype)
    x.flat[rng.integers(0, x.size, x.size // 3)] = rng.choice(specials, x.size // 3)
    return x


@given(st.integers(1, 40), st.integers(1, 40), st.sampled_from([np.float32, np.float64]),
       st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_transposed_copy_is_numpys_transpose_bit_for_bit(rows, cols, dtype, wider, wider_out, seed):
    rng = np.random.default_rng(seed)
    src = _special_values(rng, (rows, cols + wider), dtype)[:, :cols]
    out_wide = rng.standard_normal((cols, rows + wider_out)).astype(dtype)
    out, past_the_end = out_wide[:, :rows], out_wide[:, rows:].copy()
    copy = blas.transposed_copy(src, out)
    assert copy is not None
    copy()
    want = src.T
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(f"u{out.itemsize}"), want[~nan].view(f"u{out.itemsize}"))
    np.testing.assert_array_equal(out_wide[:, rows:], past_the_end)


def test_transposed_copy_declines_what_blas_cannot_take():
    rng = np.random.default_rng(0)
    src = rng.standard_normal((6, 5)).astype(np.float32)
    out = np.zeros((5, 6), np.float32)
    assert blas.transposed_copy(src, out) is not None
    square = rng.standard_normal((6, 6)).astype(np.float32)
    declined = {
        "int32": (src.view(np.int32), out.view(np.int32)),
        "float16": (src.astype(np.float16), out.astype(np.float16)),
        "dtypes differ": (src, out.astype(np.float64)),
        "big-endian": (src.astype(">f4"), out.astype(">f4")),
        "shapes not transposed": (src, np.zeros((6, 5), np.float32)),
        "a batch": (src[None], out[None]),
        "rows strided": (rng.standard_normal((6, 10)).astype(np.float32)[:, ::2], out),
        "out with a column stride": (src, np.zeros((5, 12), np.float32)[:, ::2]),
        "in place": (square, square),
        "empty": (src[:0], out[:, :0]),
    }
    for why, operands in declined.items():
        assert blas.transposed_copy(*operands) is None, why
