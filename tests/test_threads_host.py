"""What a host process sees of pmx's threads, through the public API only: per-InferenceSession
thread counts (SessionOptions, num_threads=, OMP_NUM_THREADS), nothing process-wide
changed by import, load or runs, other threads' BLAS settings untouched, and no worker
burning CPU between runs."""

import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import threadpoolctl

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession, PmxInputError, SessionOptions, parallel
from pmx.runtime.options import cgroup_cpu_limit

WORKER_NAME = "pmx-worker"


def splitting_module():
    """A conv stack big enough that its kernels split their work over two threads."""
    import torch.nn as nn

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(16, 32, 3, padding=1)
            self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)
            self.pointwise = nn.Conv2d(32, 64, 1)
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            x = nn.functional.hardswish(self.depthwise(self.conv(x).relu()))
            x = self.pointwise(x).sigmoid().mean((2, 3))
            return self.fc(x)

    return Stack()


@pytest.fixture(scope="module")
def model_path(exporter, tmp_path_factory):
    import torch

    prefix = exporter("threads_host", splitting_module(), (torch.rand(1, 16, 64, 64),))
    out = tmp_path_factory.mktemp("threads_host") / "model.pmx"
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(out))
    return str(out)


def feed(seed=0):
    return {"in0": np.random.default_rng(seed).standard_normal((1, 16, 64, 64)).astype(np.float32)}


def options(threads, spinning=False):
    so = SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return so


def pmx_workers():
    return [t for t in threading.enumerate() if t.name == WORKER_NAME]


THREAD_VARIABLES = ("OMP_", "OPENBLAS_", "MKL_", "NUMEXPR_")  # Ray's init sets some in this process


def run_python(code, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith(THREAD_VARIABLES)} | (env or {})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_load_and_runs_change_nothing_process_wide(model_path):
    """os.environ, numpy's BLAS and numexpr's thread counts (through threadpoolctl),
    numpy's functions and every thread's CPU affinity are the same before import, after
    import, after load and after runs with two threads; pmx's own BLAS is at one thread."""
    out = run_python(f"""
        import os, sys
        import numpy as np, numexpr, threadpoolctl

        def state():
            # every BLAS but pmx's own (its library is loaded at the first run, at one thread)
            blas = sorted((i["filepath"], i["num_threads"]) for i in threadpoolctl.threadpool_info()
                          if "scipy_openblas32" not in i["filepath"])
            funcs = tuple(id(getattr(np, f)) for f in ("empty", "zeros", "ones", "full", "empty_like", "matmul"))
            tasks = sorted(int(t) for t in os.listdir("/proc/self/task"))
            affinity = {{t: sorted(os.sched_getaffinity(t)) for t in tasks}}
            return dict(os.environ), blas, numexpr.get_num_threads(), funcs, set(map(tuple, affinity.values()))

        before = state()
        import pmx.runtime
        assert state() == before, "import"
        sess = pmx.runtime.InferenceSession({model_path!r}, num_threads=2)
        assert state() == before, "load"
        x = np.random.default_rng(0).standard_normal((1, 16, 64, 64)).astype(np.float32)
        for _ in range(3):
            sess.run(None, {{"in0": x}})
        after = state()
        assert after[:4] == before[:4], "runs"
        assert after[4] == before[4], ("affinities", after[4], before[4])
        own = [i for i in threadpoolctl.threadpool_info() if "scipy_openblas32" in i["filepath"]]
        assert [i["num_threads"] for i in own] == [1], own
        assert len(before[1]) >= 1  # numpy's BLAS was seen, and kept its count
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_other_threads_keep_their_blas_thread_count_during_runs(model_path):
    """A thread sampling BLAS's thread count while another thread runs pmx sees the
    count it had before every time."""
    controller = threadpoolctl.ThreadpoolController()
    blas = [c for c in controller.lib_controllers if c.user_api == "blas"]
    if not blas:
        pytest.skip("no BLAS threadpoolctl can see")
    want = [c.get_num_threads() for c in blas]
    sess = InferenceSession(model_path, num_threads=2)
    stop = threading.Event()
    seen = []

    def sample():
        while not stop.is_set() and len(seen) < 2000:
            seen.append([c.get_num_threads() for c in blas])
            a = np.ones((64, 64), np.float32)
            np.matmul(a, a)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for k in range(20):
            sess.run(None, feed(k))
    finally:
        stop.set()
        sampler.join()
    assert seen and all(s == want for s in seen), f"{sum(s != want for s in seen)} of {len(seen)} samples differed"


def runs_through_two_thread_trials(sess, feed):
    """Outputs of the runs through the first two trials in which a multi-thread
    InferenceSession times runs with its workers against runs on the calling thread
    alone (parallel.RunChooser), so both ways run."""
    gate = parallel.RunChooser
    return [sess.run(None, feed)[0] for _ in range(1 + gate.WARM + 2 * gate.TRIALS + gate.RECHECK[0] + 2 * gate.TRIALS)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_runs_through_the_thread_trials_agree(model_path, deterministic):
    """The one-thread way is bound for one thread (whole GEMMs): its results may differ
    from the split way's in the last bits. use_deterministic_compute makes it run the
    split parts instead, so every run gives the same bits."""
    so = options(2)
    so.use_deterministic_compute = deterministic
    sess = InferenceSession(model_path, sess_options=so)
    outs = runs_through_two_thread_trials(sess, feed(0))
    one_thread = InferenceSession(model_path, sess_options=options(1)).run(None, feed(0))[0]
    for out in outs:
        if deterministic:
            np.testing.assert_array_equal(out, outs[0])
        else:
            np.testing.assert_allclose(out, one_thread, rtol=1e-5, atol=1e-6)
    if not deterministic:
        # the first run takes the one-thread way (its binding plans no split), and so do
        # trials after it, bound for one thread: the 1-thread session's bits
        np.testing.assert_array_equal(outs[0], one_thread)
        assert any(np.array_equal(out, one_thread) for out in outs[1:])


def test_two_sessions_with_their_own_thread_counts_run_concurrently_bit_identical(model_path):
    one = InferenceSession(model_path, sess_options=options(1))
    # deterministic: each calling thread has its own binding, whose thread chooser may
    # settle on the other way (test_runs_through_the_thread_trials_agree)
    so = options(2)
    so.use_deterministic_compute = True
    two = InferenceSession(model_path, sess_options=so)
    assert one.get_session_options().intra_op_num_threads == 1
    assert two.get_session_options().intra_op_num_threads == 2
    feeds = [feed(k) for k in range(6)]
    runs_through_two_thread_trials(two, feeds[0])
    want = [one.run(None, f)[0] for f in feeds]
    np.testing.assert_allclose(np.stack([two.run(None, f)[0] for f in feeds]), np.stack(want), rtol=1e-5, atol=1e-6)
    sequential = {id(s): [s.run(None, f)[0] for f in feeds] for s in (one, two)}
    got = {}
    errors = []

    def worker(sess):
        try:
            got[id(sess)] = [sess.run(None, f)[0] for f in feeds for _ in range(2)][::2]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s in (one, two):
        for g, w in zip(got[id(s)], sequential[id(s)]):
            np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def heavy_model_path(exporter, tmp_path_factory):
    """A model past the multiply-adds from which a first run binds for the split way:
    one 1x1 conv of 1024 channels on 32x32 (1.07G multiply-adds)."""
    import torch
    import torch.nn as nn

    prefix = exporter("threads_host_heavy", nn.Conv2d(1024, 1024, 1), (torch.rand(1, 1024, 32, 32),))
    out = tmp_path_factory.mktemp("threads_host_heavy") / "model.pmx"
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(out))
    return str(out)


def test_a_heavy_models_first_run_splits_a_light_ones_does_not(model_path, heavy_model_path):
    """A first run binds its kernels once: for one thread on a light model (binding the
    splits would cost more than they save), for the split way on a heavy one. Seen from
    outside: whether the first run handed work to a worker thread."""
    out = run_python(f"""
        import threading
        import numpy as np
        from pmx.runtime import InferenceSession
        count = lambda: sum(t.name == "pmx-worker" for t in threading.enumerate())
        light = InferenceSession({model_path!r}, num_threads=2)
        light.run(None, {{"in0": np.ones((1, 16, 64, 64), np.float32)}})
        print(count())
        heavy = InferenceSession({heavy_model_path!r}, num_threads=2)
        heavy.run(None, {{"in0": np.ones((1, 1024, 32, 32), np.float32)}})
        print(count())
    """)
    assert out.split() == ["0", "1"]


def test_a_session_starts_threads_minus_one_workers_per_calling_thread(model_path):
    out = run_python(f"""
        import threading
        import numpy as np
        from pmx.runtime import InferenceSession
        x = {{"in0": np.ones((1, 16, 64, 64), np.float32)}}
        count = lambda: sum(t.name == "pmx-worker" for t in threading.enumerate())
        one = InferenceSession({model_path!r}, num_threads=1)
        one.run(None, x)
        print(count())
        three = InferenceSession({model_path!r}, num_threads=3)
        for _ in range(2):  # the first run takes the one-thread way; the second splits
            three.run(None, x)
        print(count())
        del three
        import gc, time
        gc.collect()
        deadline = time.monotonic() + 60  # the workers are told to stop; they end on their own
        while count() and time.monotonic() < deadline:  # bounded, and generous for a busy host
            time.sleep(0.01)
        print(count())
    """)
    one, three, after = map(int, out.split())
    assert (one, after) == (0, 0)
    assert 1 <= three <= 2, "a 3-thread InferenceSession uses at most two workers"


def test_omp_num_threads_sets_the_default(model_path):
    code = f"""
        import threading
        import numpy as np
        from pmx.runtime import InferenceSession
        sess = InferenceSession({model_path!r})
        sess.run(None, {{"in0": np.ones((1, 16, 64, 64), np.float32)}})
        print(sess.get_session_options().intra_op_num_threads, sum(t.name == "pmx-worker" for t in threading.enumerate()))
    """
    assert run_python(code, {"OMP_NUM_THREADS": "1"}).split() == ["1", "0"]
    assert run_python(code, {"OMP_NUM_THREADS": "3"}).split()[0] == "3"
    # the cores this process may use, capped by its cgroup CPU quota (tests/test_default_threads.py)
    default = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limit = cgroup_cpu_limit()
    if limit is not None:
        default = min(default, max(1, math.ceil(limit)))
    assert run_python(code).split()[0] == str(default)


def test_thread_count_precedence_and_validation(model_path):
    assert InferenceSession(model_path, sess_options=options(3)).get_session_options().intra_op_num_threads == 3
    assert (
        InferenceSession(model_path, sess_options=options(3), num_threads=1).get_session_options().intra_op_num_threads
        == 1
    )
    for bad in (-2, "two"):
        with pytest.raises(PmxInputError, match="thread count"):
            InferenceSession(model_path, num_threads=bad)
    # a shortcut for intra_op_num_threads, whose 0 is the default: the options', then the machine's
    assert (
        InferenceSession(model_path, sess_options=options(3), num_threads=0).get_session_options().intra_op_num_threads
        == 3
    )
    so = options(-1)
    with pytest.raises(PmxInputError, match="thread count"):
        InferenceSession(model_path, sess_options=so)
    with pytest.raises(PmxInputError, match="allow_spinning"):
        SessionOptions().add_session_config_entry("session.intra_op.allow_spinning", "yes")


def test_threadpool_limits_around_runs(model_path):
    """threadpoolctl limits BLAS for what runs inside and restores it after; results
    stay those of an unlimited run (within float32 rounding: BLAS may sum in another
    order on one thread)."""
    sess = InferenceSession(model_path, num_threads=2)
    want = sess.run(None, feed())[0]
    before = threadpoolctl.threadpool_info()
    with threadpoolctl.threadpool_limits(1):
        limited = sess.run(None, feed())[0]
        assert all(i["num_threads"] == 1 for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")
    assert threadpoolctl.threadpool_info() == before
    np.testing.assert_allclose(limited, want, rtol=1e-5, atol=1e-6)


def _cpu_seconds(native_id):
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread CPU times come from Linux's /proc")
@pytest.mark.parametrize("spinning", [False, True])
def test_no_worker_uses_cpu_between_runs(model_path, spinning):
    """Workers sleep while they wait, whatever allow_spinning says (onnxruntime's key is
    accepted; pmx's workers never spin)."""
    sess = InferenceSession(model_path, sess_options=options(2, spinning))
    for k in range(5):
        sess.run(None, feed(k))
    workers = pmx_workers()
    assert workers, "a 2-thread InferenceSession's run splits work onto a worker"
    before = [_cpu_seconds(w.native_id) for w in workers]
    time.sleep(0.5)
    used = [_cpu_seconds(w.native_id) - b for w, b in zip(workers, before)]
    assert max(used) < 0.05, f"workers used {used} s of CPU in 0.5 s between runs"


def test_outputs_agree_with_and_without_pmxs_own_blas(model_path, tmp_path):
    """Without the scipy-openblas32 wheel pmx calls numpy's BLAS: the outputs agree
    (different BLAS builds and splits, so not bit for bit)."""
    code = """
        import numpy as np
        from pmx.runtime import InferenceSession, blas
        sess = InferenceSession({path!r}, num_threads=2)
        x = np.random.default_rng(0).standard_normal((1, 16, 64, 64)).astype(np.float32)
        for _ in range(12):  # past the first split trials
            y = sess.run(None, {{"in0": x}})[0]
        np.save({save!r}, y)
        print(blas.library().private)
    """
    own, shared = tmp_path / "own.npy", tmp_path / "shared.npy"
    assert run_python(code.format(path=model_path, save=str(own))).split() == ["True"]
    hide = """
        import importlib.abc, sys
        class HideWheel(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "scipy_openblas32":
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, HideWheel())
    """
    assert run_python(
        textwrap.dedent(hide) + textwrap.dedent(code.format(path=model_path, save=str(shared)))
    ).split() == ["False"]
    np.testing.assert_allclose(np.load(own), np.load(shared), rtol=1e-4, atol=1e-5)


def test_numpys_blas_threads_take_no_cpu_during_runs(model_path):
    """pmx's GEMMs and GEMVs run on its own BLAS (one thread); what it leaves to numpy
    (batches of short vector products: runtime/blas.py) runs on numpy's calling thread.
    So numpy's BLAS threads, at their default count, burn no CPU while pmx runs: a pool
    woken by pmx would take a share of the ticks after every call. Both sides are counted
    over the same amount of calling-thread CPU (ticks, not runs or seconds, so a faster or
    a busy host changes nothing), and numpy's own threaded GEMM over as much CPU is the
    control that shows the pool's ticks are seen when it works."""
    out = run_python(f"""
        import os
        import numpy as np, threadpoolctl

        numpy_blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
        threads = set(os.listdir("/proc/self/task")) - {{str(os.getpid())}}  # numpy's BLAS pool
        main = [str(os.getpid())]

        def ticks(tasks):
            total = 0
            for t in tasks:
                with open(f"/proc/self/task/{{t}}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            return total

        def pool_ticks_over(work, main_ticks=50, calls=20000):
            pool, start = ticks(threads), ticks(main)
            for _ in range(calls):  # bounded: 50 ticks is well under a second of work
                work()
                if ticks(main) - start >= main_ticks:
                    break
            return ticks(threads) - pool, ticks(main) - start

        from pmx.runtime import InferenceSession
        sess = InferenceSession({model_path!r}, num_threads=2)
        x = np.random.default_rng(0).standard_normal((1, 16, 64, 64)).astype(np.float32)
        sess.run(None, {{"in0": x}})
        pmx_pool, pmx_main = pool_ticks_over(lambda: sess.run(None, {{"in0": x}}))
        a = np.ones((384, 384), np.float32)
        numpy_pool, numpy_main = pool_ticks_over(lambda: np.matmul(a, a))
        print(numpy_blas[0]["num_threads"], len(threads), pmx_pool, pmx_main, numpy_pool, numpy_main)
    """)
    blas_threads, pool_threads, pmx_pool, pmx_main, numpy_pool, numpy_main = map(int, out.split())
    if blas_threads < 2 or pool_threads < 1:
        pytest.skip("numpy's BLAS has no thread pool here (one core)")
    assert numpy_pool >= numpy_main // 4, f"control: numpy's threaded GEMM put only {numpy_pool} ticks on its pool"
    assert pmx_pool <= 2 + pmx_main // 20, f"numpy's BLAS threads ran {pmx_pool} ticks while pmx ran {pmx_main}"
