"""runtime/parallel.py (thread count, BLAS control, the split primitive) and the GEMM
splitter kernels build on it (kernels/common.gemm)."""

import threading

import numpy as np
import pytest

from pmx.runtime import InferenceSession, parallel
from pmx.runtime.errors import PmxInputError


def test_ranges_cover_without_gaps_or_empties():
    for n in (1, 2, 3, 7, 64):
        for parts in (1, 2, 3, 8):
            got = parallel.ranges(n, parts)
            assert got[0][0] == 0 and got[-1][1] == n
            assert all(lo < hi for lo, hi in got)
            assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
            assert len(got) == min(parts, n)


def test_split_runs_every_part_and_raises_after_all_finish():
    done = []
    ok = parallel.split([lambda i=i: done.append(i) for i in range(3)])
    ok()
    assert sorted(done) == [0, 1, 2]

    finished = threading.Event()

    def slow_part():
        finished.wait(0.2)
        done.append("slow")

    def failing_part():
        raise ValueError("part failed")

    bad = parallel.split([failing_part, slow_part])
    done.clear()
    with pytest.raises(ValueError, match="part failed"):
        bad()
    assert done == ["slow"], "the error must surface only after the other part ran"
    ok()  # the workers are free again after a failure


def test_num_threads_is_validated():
    with pytest.raises(ValueError):
        parallel.set_num_threads(0)


def test_session_num_threads_is_validated(tmp_path):
    with pytest.raises(PmxInputError, match="num_threads"):
        InferenceSession(str(_example_model(tmp_path)), num_threads=0)


@pytest.mark.skipif(not parallel.blas_threads_controlled(), reason="no BLAS pmx can drive in this process")
def test_blas_held_at_one_thread_only_while_runs_are_inside():
    """Counted: the configured count comes back when the last concurrent run leaves,
    never while another run is still inside (its GEMMs would change rounding)."""
    before = parallel.num_threads()
    parallel.set_num_threads(2)
    try:
        assert parallel.blas_threads() == 2
        with parallel.blas_single_threaded():
            assert parallel.blas_threads() == 1
            with parallel.blas_single_threaded():  # a second run, on another thread in real use
                assert parallel.blas_threads() == 1
            assert parallel.blas_threads() == 1, "restored while a run was still inside"
        assert parallel.blas_threads() == 2
    finally:
        parallel.set_num_threads(before)


@pytest.mark.skipif(not parallel.blas_threads_controlled(), reason="no BLAS pmx can drive in this process")
@pytest.mark.parametrize("threads", [1, 2])
def test_blas_gets_the_thread_count_at_the_first_run_not_at_load(threads):
    """set_num_threads (InferenceSession(num_threads=)) leaves finding BLAS to the first
    run; that run, with one configured thread or more, leaves BLAS at the count."""
    before = parallel.num_threads()
    try:
        parallel._blas()[0](3)  # whatever BLAS had
        parallel._blas.cache_clear()
        parallel.set_num_threads(threads)
        assert parallel._blas.cache_info().currsize == 0, "set_num_threads looked BLAS up"
        with parallel.blas_single_threaded():
            pass
        assert parallel._blas()[1]() == threads
    finally:
        parallel.set_num_threads(before)
        parallel.blas_threads()


def test_gemm_split_matches_numpy(monkeypatch):
    """kernels/common.gemm by batch, columns and rows, with post() seeing each part."""
    from pmx.runtime.kernels import common

    monkeypatch.setattr(parallel, "_num_threads", 2)
    rng = np.random.default_rng(0)
    cases = [((6, 200, 64), (6, 64, 200)), ((300, 256), (256, 1024)), ((1024, 512), (512, 64))]
    for a_shape, b_shape in cases:
        a = rng.standard_normal(a_shape).astype(np.float32)
        b = rng.standard_normal(b_shape).astype(np.float32)
        out = np.empty(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (a_shape[-2], b_shape[-1]), np.float32)
        assert out.size * a_shape[-1] >= common.GEMM_SPLIT_MIN_MACS
        seen = []
        common.gemm(a, b, out, post=lambda part, cut: (lambda: seen.append(part.shape)))()
        np.testing.assert_allclose(out, np.matmul(a, b), rtol=1e-5, atol=1e-4)
        assert len(seen) == 2 and sum(int(np.prod(s)) for s in seen) == out.size, f"parts {seen} do not tile {out.shape}"


def _example_model(tmp_path):
    import pathlib

    from pmx.compiler.driver import compile_model

    example = pathlib.Path(__file__).parents[1] / "tools" / "example" / "cnn.pnnx.param"
    out = tmp_path / "example.pmx"
    compile_model(str(example), None, str(out))
    return out
