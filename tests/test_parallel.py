"""runtime/parallel.py (thread count, BLAS control, the split primitive) and the GEMM
splitter kernels build on it (kernels/common.gemm)."""

import os
import threading

import numpy as np
import pytest
from helpers import OPENBLAS_PREAMBLE, run_openblas_script

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


@pytest.fixture(params=["spin", "sleep"])
def worker_mode(request, monkeypatch):
    """Workers that spin on libc spinlocks inside runs, and the sleeping kind used where
    there are none (PMX_NO_SPIN=1 or not glibc): fresh workers of that kind."""
    if request.param == "spin" and parallel._spin() is None:
        pytest.skip("no pthread spinlocks in this libc")
    if request.param == "sleep":
        monkeypatch.setenv("PMX_NO_SPIN", "1")
    parallel._spin.cache_clear()
    monkeypatch.setattr(parallel, "_workers", [])
    monkeypatch.setattr(parallel, "_process_workers", [])  # with PMX_WORKERS=processes set
    monkeypatch.setattr(parallel, "_num_threads", 3)
    yield request.param
    parallel._spin.cache_clear()


def test_workers_spin_only_while_runs_are_inside(worker_mode):
    """A split outside any run wakes its workers for that one split; inside running()
    they stay awake (spinning ones from the run's start, sleeping ones from their first
    part) until the last of two overlapping runs leaves; every part runs exactly once
    either way, and an error still surfaces after all parts."""
    done = []
    split = parallel.split([lambda i=i: done.append(i) for i in range(3)])
    split()
    assert sorted(done) == [0, 1, 2]
    workers = parallel._get_workers(2)
    assert not any(w.awake for w in workers), "a split outside a run left a worker awake"
    with parallel.running():
        assert all(w.awake for w in workers) == (worker_mode == "spin")
        with parallel.running():
            for _ in range(50):
                split()
        assert all(w.awake for w in workers), "parked while a run was inside"
        failing = parallel.split([lambda: None, lambda: 1 / 0])
        with pytest.raises(ZeroDivisionError):
            failing()
        split()
    assert not any(w.awake for w in workers)
    assert sorted(done) == sorted(list(range(3)) * 52)


def test_spinning_workers_report_done_holding_the_gil(worker_mode):
    """A spinning worker posts "done" through pthread_spin_unlock called with the GIL
    held (ctypes.PyDLL): posting it with the GIL released left the worker asleep in the
    GIL's wait instead of spinning for the next part (an empty split 14-16 -> 9 us).
    "go" is posted as before, and sleeping workers keep their plain locks."""
    [worker] = parallel._get_workers(1)
    if worker_mode == "sleep":
        assert isinstance(worker._done, parallel._Signal)
        return
    keep = parallel._unlock_keeping_gil()
    if keep is None:
        pytest.skip("no pthread_spin_unlock through PyDLL")
    assert worker._done.post.func is keep
    assert worker._go.post.func is not keep
    with parallel.running():
        got = []
        for _ in range(20):
            parallel.split([lambda: got.append(0), lambda: got.append(1)])()
    assert sorted(got) == [0] * 20 + [1] * 20


def test_runs_on_two_threads_share_the_workers(worker_mode):
    """Two threads inside running() at once, each splitting work: the worker lock hands
    the workers to one split at a time and every result is right."""
    a = np.arange(4096, dtype=np.float64).reshape(64, 64)
    errors = []

    def job(seed):
        out = np.empty_like(a)
        split = parallel.split([lambda lo=lo, hi=hi: np.multiply(a[lo:hi], seed, out=out[lo:hi])
                                for lo, hi in parallel.ranges(64, 3)])
        with parallel.running():
            for _ in range(200):
                out.fill(0)
                split()
                if not np.array_equal(out, a * seed):
                    errors.append(seed)

    threads = [threading.Thread(target=job, args=(s,)) for s in (2.0, 3.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

def test_spinning_workers_are_pinned_off_the_callers_core(monkeypatch):
    """Entering a run pins each spinning worker to its own core, not the caller's (a
    worker spinning on the caller's core stalls the caller until the scheduler tick);
    workers beyond the free cores may run on any allowed core; a caller on another core
    at the next run moves the pins."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or parallel._spin() is None or parallel._sched_getcpu() is None:
        pytest.skip("needs two cores and glibc's spinlocks and sched_getcpu")
    assert parallel._sched_getcpu()() in allowed
    monkeypatch.setattr(parallel, "_workers", [])
    monkeypatch.setattr(parallel, "_process_workers", [])  # with PMX_WORKERS=processes set
    monkeypatch.setattr(parallel, "_num_threads", len(allowed) + 1)  # one worker too many
    workers = parallel._get_workers(len(allowed))
    try:
        for home in (allowed[0], allowed[-1], allowed[0]):
            # the caller "runs" on `home` (the scheduler may move this thread at will)
            monkeypatch.setattr(parallel, "_sched_getcpu", lambda home=home: lambda: home)
            with parallel.running():
                pins = [os.sched_getaffinity(w.native_id) for w in workers]
            assert all(len(p) == 1 for p in pins[:-1]), pins
            assert sorted(set().union(*pins[:-1])) == [c for c in allowed if c != home], pins
            assert pins[-1] == set(allowed), "the spare worker may run on any allowed core"
    finally:
        for w in workers:
            os.sched_setaffinity(w.native_id, allowed)


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
        with parallel.running():
            assert parallel.blas_threads() == 1
            with parallel.running():  # a second run, on another thread in real use
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
        with parallel.running():
            pass
        assert parallel._blas()[1]() == threads
    finally:
        parallel.set_num_threads(before)
        parallel.blas_threads()


@pytest.mark.parametrize("order,user_timeout", [("pmx.runtime first", None), ("pmx.compiler first", None),
                                                 ("pmx.runtime first", "12"), ("numpy first", None)])
def test_openblas_pool_started_by_pmx_sleeps_at_once(order, user_timeout):
    """When pmx.runtime (or the compiler, which imports it first) loads numpy, OpenBLAS's
    pool starts with a 2^4-cycle idle timeout (parallel.BLAS_RESTART_TIMEOUT), so its
    threads do not spin on the core pmx's worker needs; the variable pmx sets for that
    is gone afterwards. A timeout the user set is kept, and a numpy loaded before pmx
    keeps its own."""
    first = {"pmx.runtime first": "import pmx.runtime", "pmx.compiler first": "import pmx.compiler",
             "numpy first": "import numpy, pmx.runtime"}[order]
    script = first + OPENBLAS_PREAMBLE + 'import os\nprint(timeout(), os.environ.get("OPENBLAS_THREAD_TIMEOUT"))\n'
    words = run_openblas_script(script, user_timeout)
    want = {None: f"{parallel.BLAS_RESTART_TIMEOUT} None", "12": "12 12"}[user_timeout]
    assert words == (["0", "None"] if order == "numpy first" else want.split())


@pytest.mark.parametrize("first,other_thread", [("numpy", False), ("numpy", True), ("pmx.runtime", False)])
def test_openblas_pool_started_before_pmx_is_restarted_calm_at_the_first_run(first, other_thread):
    """numpy loaded before pmx.runtime: OpenBLAS's pool runs with the default idle
    timeout. The first run's entry shuts it down with the timeout static at
    parallel.BLAS_RESTART_TIMEOUT (its thread exits; OpenBLAS starts a new one when pmx
    sets its thread count), and BLAS gives the right result after. With another Python
    thread alive (it might be inside BLAS) the pool is left alone, and a pool pmx.runtime
    started calm is not restarted."""
    import sys
    import textwrap

    if not sys.platform.startswith("linux"):
        pytest.skip("counts threads in /proc")
    script = f"import {first}\n" + textwrap.dedent("""
        import os, threading, numpy as np
        a = np.random.default_rng(0).standard_normal((300, 300)).astype(np.float32)
        a @ a  # the pool has run
    """) + OPENBLAS_PREAMBLE + textwrap.dedent(f"""
        if {other_thread}:
            threading.Thread(target=threading.Event().wait, daemon=True).start()
        tasks = lambda: set(os.listdir("/proc/self/task"))
        parallel.set_num_threads(2)
        before, timeout_before = tasks(), timeout()
        with parallel.running():
            inside = tasks()
        product = a @ a
        exact = np.abs(product - a.astype(np.float64) @ a).max() < 1e-3
        print(timeout_before, timeout(), len(before - inside), exact, parallel.blas_threads())
    """)
    words = run_openblas_script(script, OPENBLAS_NUM_THREADS="2")
    if first == "pmx.runtime":
        assert words == [str(parallel.BLAS_RESTART_TIMEOUT)] * 2 + ["0", "True", "2"]
    elif other_thread:
        assert words == ["0", "0", "0", "True", "2"]
    else:  # the pool's one thread (2 threads: the caller's and one more) was replaced
        assert words == ["0", str(parallel.BLAS_RESTART_TIMEOUT), "1", "True", "2"]


def test_numexpr_loaded_by_others_keeps_its_thread_count(monkeypatch):
    """pmx sets numexpr's thread count (1 inside runs) only once numexpr runs pmx's
    programs; a numexpr someone else loaded (pandas does) is left alone, sparing each
    run two set_num_threads calls."""
    numexpr = pytest.importorskip("numexpr")
    before = numexpr.get_num_threads()
    monkeypatch.setattr(parallel, "_numexpr_adopted", False)
    monkeypatch.setattr(parallel, "_num_threads", 2)
    try:
        numexpr.set_num_threads(3)
        with parallel.running():
            assert numexpr.get_num_threads() == 3
        parallel.set_num_threads(2)
        assert numexpr.get_num_threads() == 3
        parallel.adopt_numexpr()
        assert numexpr.get_num_threads() == 2
        with parallel.running():
            assert numexpr.get_num_threads() == 1
        assert numexpr.get_num_threads() == 2
    finally:
        numexpr.set_num_threads(before)


def test_gemm_split_matches_numpy(monkeypatch):
    """kernels/common.gemm by batch, columns and rows (rows first when asked: 1x1 convs),
    each part with its share of the bias, and the activation seeing each part (the
    epilogue is replaced by one that records the parts it is given)."""
    from helpers import KernelNode

    from pmx.runtime.kernels import common

    monkeypatch.setattr(parallel, "_num_threads", 2)
    rng = np.random.default_rng(0)
    # (a, b, part shape with columns first, part shape with rows first)
    cases = [((6, 200, 64), (6, 64, 200), (3, 200, 200), (3, 200, 200)),
             ((300, 256), (256, 1024), (300, 512), (150, 1024)),
             ((1024, 512), (512, 64), (512, 64), (512, 64)),
             ((32, 512), (512, 4096), (32, 2048), (32, 2048))]
    for a_shape, b_shape, *parts in cases:
        a = rng.standard_normal(a_shape).astype(np.float32)
        b = rng.standard_normal(b_shape).astype(np.float32)
        for rows_first, part in zip((False, True), parts):
            out = np.empty(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (a_shape[-2], b_shape[-1]), np.float32)
            assert out.size * a_shape[-1] >= common.GEMM_SPLIT_MIN_MACS
            # a conv's bias runs along the rows, a linear layer's along the columns
            bias = rng.standard_normal((a_shape[-2], 1) if rows_first else b_shape[-1:]).astype(np.float32)
            seen = []
            monkeypatch.setattr(common, "epilogue", lambda node, part, threads=None: lambda: seen.append(part.shape))
            common.gemm(a, b, out, activation=KernelNode("linear", {}, "maximum(@0,0)", ""), rows_first=rows_first,
                        bias=bias)()
            np.testing.assert_allclose(out, np.matmul(a, b) + bias, rtol=1e-5, atol=1e-4)
            assert seen == [part, part], f"rows_first={rows_first}: parts {seen} of {out.shape}, expected two {part}"


def test_gemm_split_thresholds_for_matrices_and_vectors(monkeypatch):
    """With worker threads, a product of two matrices splits from MATRIX_SPLIT_MIN_MACS
    (384K multiply-adds) and a matrix-vector product only from GEMM_SPLIT_MIN_MACS
    (1.5M); within a binding for worker processes both split from 1.5M / 4 = 384K."""
    from pmx.runtime.kernels import common

    monkeypatch.setattr(parallel, "_num_threads", 2)
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
    monkeypatch.setattr(parallel, "_binding_for_processes", lambda: True)
    assert parallel.split_minimum(common.GEMM_SPLIT_MIN_MACS) == common.MATRIX_SPLIT_MIN_MACS
    assert splits((1, 1024), (1024, 1000)) and splits((64, 96), (96, 128))
    assert not splits((64, 32), (32, 128))


def _example_model(tmp_path):
    import pathlib

    from pmx.compiler.driver import compile_model

    example = pathlib.Path(__file__).parents[1] / "tools" / "example" / "cnn.pnnx.param"
    out = tmp_path / "example.pmx"
    compile_model(str(example), None, str(out))
    return out
