"""Worker processes (PMX_WORKERS=processes, runtime/parallel.py): split parts run in a
forked process with a GIL of its own, over memory shared with it.

The mode is read from the environment at import; here it is switched on by patching
parallel.PROCESS_WORKERS, which process_workers() reads on every call. Splits send
parts to worker processes only when made inside parallel.shared_memory(), as a
session's binding makes them."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import OPENBLAS_PREAMBLE, run_openblas_script

from pmx.runtime import InferenceSession, parallel


@pytest.fixture
def processes(monkeypatch):
    if not (hasattr(os, "fork") and sys.platform.startswith("linux") and parallel._spin() is not None):
        pytest.skip("worker processes need fork and pthread spinlocks (Linux)")
    monkeypatch.setattr(parallel, "PROCESS_WORKERS", True)
    monkeypatch.setattr(parallel, "_process_workers", [])
    monkeypatch.setattr(parallel, "_num_threads", 2)
    yield
    parallel._stop_process_workers()


def _state(pid):
    """The process's state letter from /proc (R running, S sleeping, ...), None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _shared_split():
    """(a shared array of two zeros, a split whose parts write 1.0 and 2.0 into it), the
    split made as a session's binding makes them (inside shared_memory)."""
    with parallel.shared_memory():
        out = np.zeros(2)
        split = parallel.split([lambda: out.__setitem__(0, 1.0), lambda: out.__setitem__(1, 2.0)])
    return out, split


def _until(condition, seconds=5.0):
    """Poll `condition` until it holds or `seconds` pass; its last value."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_parts_run_in_a_worker_process_over_shared_memory(processes):
    """The second part runs in another process and writes into shared memory the caller
    reads; parts made after the worker was forked make it fork again."""
    pids = np.zeros(2, np.int64)
    with parallel.shared_memory():
        out = np.zeros(8)
        seen = np.zeros(2, np.int64)

        def part(k):
            out[4 * k:4 * k + 4] = k + 1
            seen[k] = os.getpid()

        first = parallel.split([lambda: part(0), lambda: part(1)])
    with parallel.running():
        first()
        assert out.tolist() == [1] * 4 + [2] * 4
        assert seen[0] == os.getpid() and seen[1] not in (0, os.getpid())
        [worker] = parallel._process_workers
        pids[0] = worker.pid
        with parallel.shared_memory():
            later = np.zeros(4)
            second = parallel.split([lambda: later.__setitem__(0, 5.0), lambda: later.__setitem__(3, 7.0)])
        second()
        assert later.tolist() == [5.0, 0.0, 0.0, 7.0]
        pids[1] = worker.pid
        out[:] = 0
        first()
        assert out.tolist() == [1] * 4 + [2] * 4
    assert pids[1] != pids[0], "a part made after the fork ran without a new worker"
    assert _until(lambda: _state(pids[0]) is None), "the replaced worker process is still there"


def test_splits_made_outside_a_shared_binding_keep_worker_threads(processes):
    """A kernel bound outside a session (tests' run_kernel, `pmx compile --tune`) has
    its buffers in private memory: its parts must not go to a worker process, which
    would write its own copies of them."""
    out = np.zeros(2)
    split = parallel.split([lambda: out.__setitem__(0, 1.0), lambda: out.__setitem__(1, 2.0)])
    with parallel.running():
        split()
    assert out.tolist() == [1.0, 2.0]
    assert not parallel._process_workers


def test_a_failing_part_in_the_worker_raises_in_the_caller(processes):
    def failing():
        raise ValueError("bad part 7")

    ran = []
    with parallel.shared_memory():
        bad = parallel.split([lambda: ran.append(0), failing])
    out, good = _shared_split()
    with parallel.running():
        with pytest.raises(RuntimeError, match="ValueError: bad part 7"):
            bad()
        assert ran == [0]
        good()
    assert out.tolist() == [1.0, 2.0], "the worker did not serve the split after the failed one"


def test_a_killed_worker_is_replaced(processes):
    out, split = _shared_split()
    with parallel.running():
        split()
        [worker] = parallel._process_workers
        old = worker.pid
    os.kill(old, signal.SIGKILL)
    assert _until(lambda: _state(old) in (None, "Z"))
    out[:] = 0
    with parallel.running():
        split()
    assert out.tolist() == [1.0, 2.0]
    assert worker.pid != old


def test_the_worker_sleeps_outside_runs(processes):
    """Inside runs the worker spins for parts; when the last run leaves it blocks on its
    pipe (no CPU burnt between runs), and a split outside any run wakes it for that split
    only."""
    out, split = _shared_split()
    with parallel.running():
        split()
        [worker] = parallel._process_workers
        assert worker.awake
    assert not worker.awake
    assert _until(lambda: _state(worker.pid) == "S"), f"worker state {_state(worker.pid)}"
    out[:] = 0
    split()
    assert out.tolist() == [1.0, 2.0] and not worker.awake
    assert _until(lambda: _state(worker.pid) == "S")


def test_the_worker_outlives_the_thread_that_forked_it(processes):
    """Sessions run from short-lived threads (a request handler's) keep their worker when
    the thread that happened to fork it ends (PR_SET_PDEATHSIG would have killed it
    then)."""
    import threading

    out, split = _shared_split()

    def first_run():
        with parallel.running():
            split()

    thread = threading.Thread(target=first_run)
    thread.start()
    thread.join()
    [worker] = parallel._process_workers
    pid = worker.pid
    for _ in range(3):
        out[:] = 0
        with parallel.running():
            split()
        assert out.tolist() == [1.0, 2.0]
    assert worker.pid == pid and _state(pid) not in (None, "Z")


def test_the_worker_dies_with_its_parent(tmp_path):
    """A parent that exits in the middle of a run without running its atexit handlers
    (os._exit), its worker spinning for the next part, still takes the worker with it."""
    if not (hasattr(os, "fork") and sys.platform.startswith("linux") and parallel._spin() is not None):
        pytest.skip("worker processes need fork and pthread spinlocks (Linux)")
    script = textwrap.dedent("""
        import os, numpy as np
        from pmx.runtime import parallel
        parallel.set_num_threads(2)
        assert parallel.process_workers()
        with parallel.shared_memory():
            out = np.zeros(2)
            split = parallel.split([lambda: out.__setitem__(0, 1), lambda: out.__setitem__(1, 2)])
        with parallel.running():  # exit inside the run: the worker spins, not asleep
            split()
            print(parallel._process_workers[0].pid, out.tolist(), flush=True)
            os._exit(0)
    """)
    env = dict(os.environ, PMX_WORKERS="processes")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid, values = done.stdout.split(" ", 1)
    assert values.strip() == "[1.0, 2.0]"
    assert _until(lambda: _state(int(pid)) in (None, "Z")), "the worker outlived its parent"


@pytest.mark.parametrize("user_timeout", [None, "12"])
def test_blas_pools_restarted_after_the_fork_sleep_at_once(user_timeout):
    """The fork shuts OpenBLAS's pool down and the run's end restarts it. Before the
    first fork, OpenBLAS's thread timeout (read from OPENBLAS_THREAD_TIMEOUT into a
    static) is set to parallel.BLAS_RESTART_TIMEOUT, so the restarted pool's idle
    threads sleep at once instead of spinning on the worker's core; the environment is
    left as it was, and a timeout the user set is kept."""
    if not (hasattr(os, "fork") and sys.platform.startswith("linux") and parallel._spin() is not None):
        pytest.skip("worker processes need fork and pthread spinlocks (Linux)")
    script = "import os, numpy as np\n" + OPENBLAS_PREAMBLE + textwrap.dedent("""
        before = timeout()
        parallel.set_num_threads(2)
        with parallel.shared_memory():
            out = np.zeros(2)
            split = parallel.split([lambda: out.__setitem__(0, 1), lambda: out.__setitem__(1, 2)])
        with parallel.running():
            split()
        assert parallel._process_workers[0].pid is not None and out.tolist() == [1.0, 2.0]
        print(before, timeout(), os.environ.get("OPENBLAS_THREAD_TIMEOUT"), parallel.blas_threads())
    """)
    before, after, environ, blas_threads = run_openblas_script(script, user_timeout, PMX_WORKERS="processes")
    assert blas_threads == "2"  # BLAS has its threads back after the run
    if user_timeout is None:
        assert (before, after, environ) == ("0", str(parallel.BLAS_RESTART_TIMEOUT), "None")
    else:
        assert (before, after, environ) == (user_timeout, user_timeout, user_timeout)


def test_a_model_gives_the_same_outputs_with_worker_processes(processes, check_model, monkeypatch):
    """A MobileNetV3 block (expand, depthwise, squeeze-and-excitation, project) large
    enough that its kernels split. With the split thresholds of worker threads the parts
    are the same, and the outputs bit-identical to worker threads'; with the lower ones
    of worker processes (more splits), within the usual tolerance of torch's."""
    import torch
    from helpers import rel_error
    from test_e2e_cnn_blocks import MobileNetV3Block

    torch.manual_seed(0)
    x = torch.randn(1, 8, 112, 112)
    session, _, torch_outs = check_model("procworkers_mnv3", MobileNetV3Block().eval(), (x,))
    feed = {session.get_inputs()[0].name: x.numpy()}
    path = session.model.path
    own_thresholds = [InferenceSession(path).run(None, feed) for _ in range(3)]
    assert parallel._process_workers and parallel._process_workers[0].pid is not None, "nothing split"
    for outs, expected in zip(own_thresholds[0], torch_outs):
        assert rel_error(outs, expected) < 1e-4
    monkeypatch.setattr(parallel, "PROCESS_SPLIT_DIVISOR", 1)
    got = [InferenceSession(path).run(None, feed) for _ in range(3)]
    monkeypatch.setattr(parallel, "PROCESS_WORKERS", False)
    expected = InferenceSession(path).run(None, feed)
    for outs in got:
        for a, b in zip(outs, expected):
            assert np.array_equal(a, b)


def test_sessions_on_several_threads_share_the_worker_process(processes, check_model):
    """Each thread binds its own arena (sessions keep bindings per thread), sessions come
    and go, and the worker is forked again for each new binding's parts. In the forked
    worker Python drops the other threads' thread-local data, which collected their
    bindings' splits there and made it forget parts the caller still sent (KeyError);
    every run must give the sequential run's bytes."""
    import threading

    import torch
    from test_e2e_cnn_blocks import MobileNetV3Block

    torch.manual_seed(0)
    x = torch.randn(1, 8, 112, 112)
    session, _, _ = check_model("procworkers_mnv3", MobileNetV3Block().eval(), (x,))
    path = session.model.path
    base = InferenceSession(path)
    feed = {base.get_inputs()[0].name: x.numpy()}
    want = base.run(None, feed)
    problems = []

    def job():
        try:
            for r in range(4):
                sess = InferenceSession(path) if r % 2 else base
                for _ in range(3):
                    got = sess.run(None, feed)
                    if any(not np.array_equal(a, b) for a, b in zip(got, want)):
                        problems.append("mismatch")
                del sess
        except Exception as e:  # noqa: BLE001 - reported below
            problems.append(repr(e)[:300])

    threads = [threading.Thread(target=job) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not problems, problems[:3]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(base.run(None, feed), want))


def test_a_worker_counts_as_alive_while_sigchld_is_ignored(processes):
    """With SIGCHLD ignored (some servers do) the kernel reaps children itself and
    waitpid() fails for a live worker too; taking that for its death would fork a second
    worker beside it on the same control block."""
    out, split = _shared_split()
    before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        with parallel.running():
            split()
            [worker] = parallel._process_workers
            pid = worker.pid
            assert worker._alive()
            for _ in range(20):
                out[:] = 0
                split()
                assert out.tolist() == [1.0, 2.0]
        assert worker.pid == pid
    finally:
        parallel._stop_process_workers()
        signal.signal(signal.SIGCHLD, before)


def test_split_thresholds_are_lower_for_worker_processes(processes):
    """A split costs a worker process no GIL hand-offs, so kernels bound for one split
    from a quarter of the work they need with threads; kernels bound elsewhere keep the
    threads' thresholds."""
    half = parallel.SPLIT_MIN_ELEMENTS // 2
    assert not parallel.worth_splitting(half)
    assert parallel.split_minimum(1 << 20) == 1 << 20
    with parallel.shared_memory():
        assert parallel.worth_splitting(half)
        assert not parallel.worth_splitting(parallel.SPLIT_MIN_ELEMENTS // parallel.PROCESS_SPLIT_DIVISOR - 1)
        assert parallel.split_minimum(1 << 20) == (1 << 20) // parallel.PROCESS_SPLIT_DIVISOR


def test_a_session_option_and_the_cli_choose_worker_processes(check_model, monkeypatch, capsys):
    """InferenceSession(..., workers=...) and `pmx run --workers` set the kind for the
    bindings made from then on; anything else is refused by name."""
    if not (hasattr(os, "fork") and sys.platform.startswith("linux") and parallel._spin() is not None):
        pytest.skip("worker processes need fork and pthread spinlocks (Linux)")
    import torch
    from test_e2e_cnn_blocks import MobileNetV3Block

    from pmx.compiler.cli import main
    from pmx.runtime.errors import PmxInputError

    monkeypatch.setattr(parallel, "PROCESS_WORKERS", False)
    monkeypatch.setattr(parallel, "_process_workers", [])
    monkeypatch.setattr(parallel, "_num_threads", 2)
    torch.manual_seed(0)
    x = torch.randn(1, 8, 112, 112)
    session, _, _ = check_model("procworkers_mnv3", MobileNetV3Block().eval(), (x,))
    path = session.model.path
    feed = {session.get_inputs()[0].name: x.numpy()}
    try:
        with pytest.raises(PmxInputError, match="threads, processes"):
            InferenceSession(path, workers="forks")
        assert not parallel.process_workers()
        with_processes = InferenceSession(path, workers="processes")
        assert parallel.process_workers()
        with_processes.run(None, feed)
        [worker] = parallel._process_workers
        assert worker.pid is not None
        InferenceSession(path, workers="threads")
        assert not parallel.process_workers()
        assert main(["run", path, "--random", "--repeat", "1", "--workers", "processes"]) == 0
        assert parallel.process_workers()
        assert "median of 1 runs" in capsys.readouterr().out
    finally:
        parallel._stop_process_workers()
