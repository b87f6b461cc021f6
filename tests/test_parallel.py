"""runtime/parallel.py (pools and the split primitive) and the GEMM splitter kernels
build on it (kernels/common.gemm). What a host process sees of pmx's threads is
tested through the public API in test_threads_host.py."""

import itertools
import threading

import numpy as np
import pytest

from pmx.runtime import parallel


def test_ranges_cover_without_gaps_or_empties():
    for n in (1, 2, 3, 7, 64):
        for parts in (1, 2, 3, 8):
            got = parallel.ranges(n, parts)
            assert got[0][0] == 0 and got[-1][1] == n
            assert all(lo < hi for lo, hi in got)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
            assert len(got) == min(parts, n)


def test_split_runs_every_part_and_raises_after_all_finish():
    done = []
    ok = parallel.split([lambda i=i: done.append(i) for i in range(3)], parallel.Pool(3))
    ok()
    assert sorted(done) == [0, 1, 2]

    finished = threading.Event()

    def slow_part():
        finished.wait(0.2)
        done.append("slow")

    def failing_part():
        raise ValueError("part failed")

    bad = parallel.split([failing_part, slow_part], parallel.Pool(3))
    done.clear()
    with pytest.raises(ValueError, match="part failed"):
        bad()
    assert done == ["slow"], "the error must surface only after the other part ran"
    ok()  # the workers are free again after a failure


def test_gemm_split_matches_numpy(monkeypatch):
    """kernels/common.gemm by batch, columns and rows (rows first when asked: 1x1 convs),
    each part with its share of the bias, and the activation seeing each part (the
    epilogue is replaced by one that records the parts it is given)."""
    from helpers import KernelNode, bind_context

    from pmx.runtime.kernels import common

    ctx = bind_context(2)
    rng = np.random.default_rng(0)
    # (a, b, part shape with columns first, part shape with rows first)
    cases = [
        ((6, 200, 64), (6, 64, 200), (3, 200, 200), (3, 200, 200)),
        ((300, 256), (256, 1024), (300, 512), (150, 1024)),
        ((1024, 512), (512, 64), (512, 64), (512, 64)),
        ((32, 512), (512, 4096), (32, 2048), (32, 2048)),
    ]
    for a_shape, b_shape, *parts in cases:
        a = rng.standard_normal(a_shape).astype(np.float32)
        b = rng.standard_normal(b_shape).astype(np.float32)
        for rows_first, part in zip((False, True), parts):
            out = np.empty(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (a_shape[-2], b_shape[-1]), np.float32)
            assert out.size * a_shape[-1] >= common.GEMM_SPLIT_MIN_MACS
            # a conv's bias runs along the rows, a linear layer's along the columns
            bias = rng.standard_normal((a_shape[-2], 1) if rows_first else b_shape[-1:]).astype(np.float32)
            seen = []
            monkeypatch.setattr(
                common, "epilogue", lambda ctx, node, part, threads=None, seen=seen: lambda: seen.append(part.shape)
            )
            common.gemm(
                ctx,
                a,
                b,
                out,
                activation=KernelNode("linear", {}, "maximum(@0,0)", ""),
                rows_first=rows_first,
                bias=bias,
            )()
            np.testing.assert_allclose(out, np.matmul(a, b) + bias, rtol=1e-5, atol=1e-4)
            assert seen == [part, part], f"rows_first={rows_first}: parts {seen} of {out.shape}, expected two {part}"


def test_gemm_split_thresholds_for_matrices_and_vectors():
    """A product of two matrices splits from MATRIX_SPLIT_MIN_MACS (384K multiply-adds)
    and a matrix-vector product only from GEMM_SPLIT_MIN_MACS (1.5M)."""
    from pmx.runtime.kernels import common

    assert common.MATRIX_SPLIT_MIN_MACS < common.GEMM_SPLIT_MIN_MACS

    def splits(a_shape, b_shape):
        a, b = np.ones(a_shape, np.float32), np.ones(b_shape, np.float32)
        out = np.empty((a_shape[0], b_shape[1]), np.float32)
        return common._gemm_split(a, b, out, 2, rows_first=True) is not None

    # 64x96 @ 96x128: 786K, a 1x1 conv at 8x16 (rows first: by its 64 channels)
    assert splits((64, 96), (96, 128))
    assert not splits((64, 32), (32, 128))  # 262K
    # 1x1024 @ 1024x1000 (1.0M): a classifier's GEMV stays whole with threads
    assert not splits((1, 1024), (1024, 1000))
    assert splits((1, 2048), (2048, 1000))  # 2.0M


def test_gemms_split_over_the_pool_only_when_blas_runs_on_one_thread():
    """GEMMs split over pmx's threads would multiply with BLAS's own threads: a pool
    splits them only when BLAS is single-threaded (or told to, as tests do)."""
    from helpers import bind_context

    from pmx.runtime.kernels import common

    a, b = np.ones((256, 512), np.float32), np.ones((512, 1024), np.float32)
    out = np.empty((256, 1024), np.float32)
    pieces = []
    real_split = parallel.split
    try:
        parallel.split = lambda parts, pool: (len(parts) > 1 and pieces.append(len(parts))) or real_split(parts, pool)
        for splits_gemms, want in ((False, []), (True, [2])):
            pieces.clear()
            common.gemm(bind_context(parallel.Pool(2, splits_gemms)), a, b, out)()
            assert pieces == want
            np.testing.assert_array_equal(out, np.full((256, 1024), 512, np.float32))
    finally:
        parallel.split = real_split


def test_parts_on_worker_threads_run_with_numpy_warnings_off():
    """The session's run loop computes with numpy's floating-point warnings off (a split
    part may compute over columns it then drops); its pool's worker threads run parts
    the same way, so no RuntimeWarning of theirs reaches the host's stderr."""
    import warnings

    zero, out = np.zeros(4, np.float32), np.empty(4, np.float32)
    handed_over = threading.Event()
    ran_on = []

    def caller_part():
        handed_over.wait(0.2)  # long enough for a worker to take the other part

    def dividing_part():
        ran_on.append(threading.current_thread().name)
        np.divide(zero, zero, out=out)  # 0/0: "invalid value encountered" unless ignored
        handed_over.set()

    fn = parallel.split([caller_part, dividing_part], parallel.Pool(2))
    with warnings.catch_warnings(record=True) as caught, np.errstate(all="ignore"):
        warnings.simplefilter("always")
        for _ in range(2 * parallel._Chooser.TRIALS + 2):
            handed_over.clear()
            fn()
    assert "pmx-worker" in ran_on, "some call handed the part to the worker"
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_split_keeps_the_faster_of_its_concurrent_and_serial_forms():
    """A split times its first calls run concurrently and serially (_Chooser), then keeps
    the faster; either way every part runs once per call and errors surface after all
    parts. The forms advance a clock of the test's own, so which is faster does not
    depend on how busy the host is."""
    for slow in (0, 1):
        ran = [0, 0]
        now = [0.0]

        def form(k, slow=slow, ran=ran, now=now):
            ran[k] += 1
            now[0] += 2.0 if k == slow else 1.0

        class Chooser(parallel._Chooser):
            clock = staticmethod(lambda now=now: now[0])

        chooser = Chooser(lambda: form(0), lambda: form(1), parallel.Pool(2))
        for _ in range(2 * parallel._Chooser.TRIALS + 10):
            chooser()
        assert ran[slow] == parallel._Chooser.TRIALS, f"form {slow} is slower and ran after its trials"
        assert ran[1 - slow] == parallel._Chooser.TRIALS + 10

    def failing():
        raise ValueError("part failed")

    done = []
    bad = parallel.split([failing, lambda: done.append(1)], parallel.Pool(2))
    for _ in range(2 * parallel._Chooser.TRIALS + 2):
        with pytest.raises(ValueError, match="part failed"):
            bad()
    assert len(done) == 2 * parallel._Chooser.TRIALS + 2, "the other part ran every time, in both forms"


@pytest.mark.parametrize("split_faster", [True, False])
def test_runs_use_split_kernels_only_while_whole_runs_are_faster_with_them(split_faster):
    """RunChooser: after its warm-up, trial runs alternate between the split and the
    single-thread kernels; the faster way (by the times reported) stays until the trials
    come round again."""
    gate = parallel.RunChooser(True)
    seen = []
    for _ in range(gate.WARM + 2 * gate.TRIALS):
        timed = gate.before_run()
        seen.append((timed, gate.concurrent))
        if timed:
            gate.after_run(1.0 if gate.concurrent == split_faster else 2.0)
    assert seen[: gate.WARM] == [(False, True)] * gate.WARM
    assert [c for t, c in seen[gate.WARM :] if t] == [True, False] * gate.TRIALS
    for wait in gate.RECHECK + gate.RECHECK[-1:]:
        settled = []
        for _ in range(wait):
            settled.append(gate.before_run())
            assert gate.concurrent is split_faster
        assert not any(settled)
        for k in range(2 * gate.TRIALS):
            assert gate.before_run(), "the trials come round again"
            assert gate.concurrent is (k % 2 == 0)
            gate.after_run(1.0 if gate.concurrent == split_faster else 2.0)
    inactive = parallel.RunChooser(False)
    assert not any(inactive.before_run() for _ in range(100)) and inactive.concurrent
