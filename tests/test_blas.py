"""runtime/blas.py: the BLAS pmx owns, its products and its blocked transpose.

Oracles: numpy's float64 matmul for products (computed without pmx's library), numpy's
own transposed copy, bit for bit, for the transpose. The library itself: pmx's own
OpenBLAS is loaded, held at one thread, and leaves numpy's BLAS as it was; without the
wheel pmx falls back to numpy's BLAS (in a fresh process, the wheel hidden)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pmx.runtime import blas
from pmx.runtime.kernels import common


def _matrix(rng, shape, transposed, wider, dtype=np.float32):
    """A matrix of `shape` as BLAS may meet it: a transposed view, and/or a slice of a
    wider array (leading dimension past the row length)."""
    rows, cols = shape[::-1] if transposed else shape
    m = rng.standard_normal((rows, cols + wider)).astype(dtype)[:, :cols]
    return m.T if transposed else m


def _exact(a, b):
    return np.matmul(a.astype(np.float64), b.astype(np.float64))


def test_pmx_owns_a_one_thread_openblas_beside_numpys():
    """The wheel is a dependency on this platform: pmx's library is its own file, not
    numpy's, held at one thread, with the entry points the kernels use."""
    lib = blas.library()
    assert lib is not None and lib.private
    assert "scipy_openblas32" in lib.path and "numpy" not in lib.path
    assert blas.threads() == 1
    for routine in ("sgemm", "dgemm", "sgemm_batch_strided", "somatcopy", "domatcopy"):
        assert blas._entry_point(routine) is not None, routine


@given(
    st.integers(0, 3),
    st.integers(1, 9),
    st.integers(0, 9),
    st.integers(1, 9),
    st.booleans(),
    st.booleans(),
    st.sampled_from([np.float32, np.float64]),
    st.integers(0, 2**32 - 1),
)
def test_matmul_matches_numpy_on_batches_views_and_broadcasts(batch_dims, m, k, n, trans_a, trans_b, dtype, seed):
    """Batch dims (one side broadcast, or a 1 against n), transposed and sliced
    operands, k = 0 and float64: each gives np.matmul's result, and every call again."""
    rng = np.random.default_rng(seed)
    batch = tuple(int(d) for d in rng.integers(1, 4, batch_dims))
    a_batch = tuple(1 if rng.random() < 0.3 else d for d in batch)[int(rng.integers(0, batch_dims + 1)) :]
    b_batch = tuple(1 if rng.random() < 0.3 else d for d in batch)[int(rng.integers(0, batch_dims + 1)) :]
    a = np.stack([_matrix(rng, (m, k), trans_a, int(rng.integers(0, 3)), dtype) for _ in range(int(np.prod(a_batch)))])
    b = np.stack([_matrix(rng, (k, n), trans_b, int(rng.integers(0, 3)), dtype) for _ in range(int(np.prod(b_batch)))])
    a, b = a.reshape(a_batch + (m, k)), b.reshape(b_batch + (k, n))
    if trans_a:
        a = np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)
    want = _exact(a, b)
    out = np.full(want.shape, np.nan, dtype)
    run = blas.matmul(a, b, out)
    for _ in range(2):
        run()
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_matmul_takes_vectors_strided_operands_and_overlap():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((7, 5)).astype(np.float32)
    v = rng.standard_normal(5).astype(np.float32)
    cases = {
        "matrix @ vector": (a, v, np.empty(7, np.float32)),
        "vector @ matrix": (rng.standard_normal(7).astype(np.float32), a, np.empty(5, np.float32)),
        "vector @ vector": (v, v, np.empty((), np.float32)),
        "strided both ways": (
            rng.standard_normal((14, 10)).astype(np.float32)[::2, ::2],
            a.T,
            np.empty((7, 7), np.float32),
        ),
        "negative strides": (a[::-1], a.T[:, ::-1], np.empty((7, 7), np.float32)),
        "out with a column stride": (a, a.T, np.empty((7, 14), np.float32)[:, ::2]),
    }
    for why, (x, y, out) in cases.items():
        blas.matmul(x, y, out)()
        np.testing.assert_allclose(out, _exact(x, y), rtol=1e-5, atol=1e-5, err_msg=why)
    square = rng.standard_normal((6, 6)).astype(np.float32)
    want = _exact(square, square)
    blas.matmul(square, square.copy(), square)()  # out is also an operand: it goes through a copy
    np.testing.assert_allclose(square, want, rtol=1e-5, atol=1e-5)


def test_matmul_of_integers_is_numpys():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    out = np.empty((3, 3), np.int64)
    blas.matmul(a, a.T, out)()
    np.testing.assert_array_equal(out, a @ a.T)


@given(
    st.integers(1, 40),
    st.integers(1, 40),
    st.integers(1, 40),
    st.booleans(),
    st.booleans(),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 2**32 - 1),
)
def test_gemm_accumulate_adds_the_product(m, n, k, trans_a, trans_b, wider, wider_out, seed):
    rng = np.random.default_rng(seed)
    a = _matrix(rng, (m, k), trans_a, wider)
    b = _matrix(rng, (k, n), trans_b, wider)
    out_wide = rng.standard_normal((m, n + wider_out)).astype(np.float32)
    out, past_the_end = out_wide[:, :n], out_wide[:, n:].copy()
    before = out.copy()
    accumulate = blas.gemm(a, b, out, accumulate=True)
    assert accumulate is not None
    for run in range(2):  # it adds on every call
        accumulate()
        want = before.astype(np.float64) + (run + 1) * _exact(a, b)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out_wide[:, n:], past_the_end)


def test_gemm_declines_what_blas_cannot_take():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal((6, 5)).astype(np.float32)
    out = np.zeros((8, 5), np.float32)
    assert blas.gemm(a, b, out) is not None
    wide = np.zeros((8, 10), np.float32)
    declined = {
        "int32": (a.astype(np.int32), b.astype(np.int32), out.astype(np.int32)),
        "dtypes differ": (a.astype(np.float64), b, out),
        "big-endian": (a.astype(">f4"), b.astype(">f4"), out.astype(">f4")),
        "a vector": (a, b[:, 0], out[:, 0]),
        "out with a column stride": (a, b, wide[:, ::2]),
        "out overlapping b": (np.zeros((6, 6), np.float32), wide[:6, :5], wide[:6, 1:6]),
        "an operand strided both ways": (rng.standard_normal((16, 12)).astype(np.float32)[::2, ::2], b, out),
        "out broadcast along its batch": (a[None], b[None], np.broadcast_to(out, (2, 8, 5))),
    }
    for why, operands in declined.items():
        assert blas.gemm(*operands) is None, why


def test_product_adds_the_bias_with_and_without_blas(monkeypatch):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((32, 24)).astype(np.float32)
    b = rng.standard_normal((24, 40)).astype(np.float32)
    want_plain = _exact(a, b)
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


@given(
    st.integers(1, 40),
    st.integers(1, 40),
    st.sampled_from([np.float32, np.float64]),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 2**32 - 1),
)
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


def _run_python(code, hide_the_wheel=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "OPENBLAS_"))}
    source = (textwrap.dedent(HIDE_THE_WHEEL) if hide_the_wheel else "") + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


HIDE_THE_WHEEL = """
    import importlib.abc, sys

    class HideWheel(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "scipy_openblas32":
                raise ModuleNotFoundError(name)
            return None

    sys.meta_path.insert(0, HideWheel())
"""


def test_without_the_wheel_pmx_calls_numpys_blas_and_splits_only_when_it_has_one_thread(tmp_path):
    """The fallback: numpy's BLAS, found among the loaded libraries; its thread count
    read, never set; GEMMs split over the InferenceSession's threads only when it is 1."""
    out = _run_python(
        """
        import numpy as np, threadpoolctl
        from pmx.runtime import blas, parallel
        lib = blas.library()
        assert lib is not None and not lib.private and "numpy" in lib.path, lib
        before = [(i["filepath"], i["num_threads"]) for i in threadpoolctl.threadpool_info()]
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((3, 40, 30)), rng.standard_normal((30, 20))
        out = np.empty((3, 40, 20))
        blas.matmul(a, b, out)()
        assert np.allclose(out, a @ b)
        assert [(i["filepath"], i["num_threads"]) for i in threadpoolctl.threadpool_info()] == before
        print(blas.threads(), parallel.Pool(2).splits_gemms)
        with threadpoolctl.threadpool_limits(1):
            print(blas.threads(), parallel.Pool(2).splits_gemms)
    """,
        hide_the_wheel=True,
    )
    assert out == ["2", "False", "1", "True"]


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2 or not os.path.isdir("/proc/self/task"),
    reason="needs Linux and two CPUs: with one, OpenBLAS starts no pool however it is loaded",
)
def test_pmxs_library_starts_no_thread_pool_and_leaves_the_callers_cpus():
    """OpenBLAS starts a pool of busy-waiting threads inside dlopen, one per CPU; pmx's
    library never uses it (one thread), so loading it adds no thread to the process and
    leaves the calling thread's CPUs as they were. Oracle: the kernel's list of the
    process's threads, and the same file loaded plainly, which does start a pool."""
    out = _run_python("""
        import ctypes, os, time
        from pmx.runtime import blas
        def threads():
            time.sleep(0.05)  # a thread that has just ended leaves the list a moment later
            return len(os.listdir("/proc/self/task"))
        cpus, before = os.sched_getaffinity(0), threads()
        lib = blas.library()
        print(lib.private, threads() - before, os.sched_getaffinity(0) == cpus, lib.threads())
    """)
    plain = _run_python("""
        import ctypes, os, time
        from pmx.runtime import blas
        before = len(os.listdir("/proc/self/task"))
        ctypes.CDLL(blas._private_library_path())
        time.sleep(0.05)
        print(len(os.listdir("/proc/self/task")) - before)
    """)
    assert out == ["True", "0", "True", "1"]
    assert int(plain[0]) >= 1  # the oracle can tell: a plain load does start threads


def test_where_a_threads_cpus_cannot_be_set_the_library_still_loads_at_one_thread():
    """The loader thread's confinement is an optimization: where sched_setaffinity is
    refused (a sandbox, another OS), pmx's library loads as before and runs at one
    thread."""
    out = _run_python("""
        import os
        def refused(*args):
            raise OSError(1, "Operation not permitted")
        os.sched_setaffinity = refused
        from pmx.runtime import blas
        lib = blas.library()
        print(lib.private, lib.threads())
    """)
    assert out == ["True", "1"]


def test_a_library_someone_else_loaded_is_not_pmxs_to_set():
    """If the host had loaded the wheel's library itself, pmx neither sets its thread
    count nor calls it its own: it falls back to numpy's BLAS."""
    out = _run_python("""
        import ctypes, importlib.util, os
        from pmx.runtime import blas
        host = ctypes.CDLL(blas._private_library_path())
        host.scipy_openblas_set_num_threads(2)
        lib = blas.library()
        print(lib.private, host.scipy_openblas_get_num_threads())
    """)
    assert out == ["False", "2"]


def test_a_library_someone_else_loaded_through_a_symlink_is_seen(tmp_path):
    """/proc/self/maps names the file the host opened by its real path: pmx compares real
    paths, so a host that loaded the wheel's library through a link still keeps it."""
    out = _run_python(f"""
        import ctypes, os
        from pmx.runtime import blas
        link = os.path.join({str(tmp_path)!r}, "libblas_link.so")
        os.symlink(blas._private_library_path(), link)
        ctypes.CDLL(link)
        print(blas.library().private)
    """)
    assert out == ["False"]
