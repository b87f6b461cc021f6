"""Threads: each InferenceSession's own worker threads, and how kernels split work over them.

numpy's ufuncs, copies and BLAS calls release the GIL, so a kernel that is a sequence of
such calls can run disjoint slices of its work on several cores at once. `split(parts,
pool)` turns callables that each cover one slice into one callable that runs part 0 on
the calling thread and the others on worker threads of `pool`. Kernel factories get the
pool from the binding's context (kernels/bind.py) and pass it here when they make their
callables; nothing in this module is thread-local.

A pool belongs to one InferenceSession and one calling thread (InferenceSessions keep a pool per thread,
as they keep an arena per thread), so two InferenceSessions never share or resize each other's
threads, and nothing here changes process-wide state: not the environment, not numpy's
BLAS or numexpr's thread counts, not affinities. The BLAS pmx calls (runtime/blas.py)
is its own, held at one thread, so kernels split their GEMMs over the pool's threads.
Without it pmx calls numpy's BLAS and only reads its thread count: when it is one
(OPENBLAS_NUM_THREADS=1, threadpoolctl), GEMMs split over the pool's threads; otherwise
they run whole and BLAS's own threads share them out, so the two never multiply.

Waiting workers sleep in a blocking queue.get(); they never spin. A worker that spun
for its part would still sleep on the GIL when it got it, and a spinning thread on a busy
host costs the others whole scheduler ticks (docs/performance.md, 2026-11-26).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

import numpy as np

from pmx.runtime import blas

# below this many elements touched, a split's hand-off costs more than the second core saves
SPLIT_MIN_ELEMENTS = 1 << 16

# --- pools -------------------------------------------------------------------------------


class Pool:
    """Up to `threads - 1` worker threads (made on first use) that run split parts for one
    caller thread at a time. `splits_gemms` (None: read BLAS's thread count now) says
    whether kernels bound on it split their BLAS calls over its threads. While `serial`
    is set, every split bound on it runs its parts one after another on the calling
    thread (a run RunChooser gives to one thread, in a deterministic InferenceSession)."""

    def __init__(self, threads: int, splits_gemms: bool | None = None):
        self.threads = max(1, int(threads))
        self.serial = False
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        # read when kernels bind: whether their GEMMs are this pool's to split
        if splits_gemms is None:
            splits_gemms = blas.threads() == 1
        self.splits_gemms = self.threads > 1 and splits_gemms
        weakref.finalize(self, _stop_all, self._workers)

    def workers(self, n):
        with self._lock:
            while len(self._workers) < n:
                self._workers.append(_Worker())
            return self._workers[:n]


def _stop_all(workers):
    for w in workers:
        w.stop()


def worth_splitting(elements: int, threads: int) -> bool:
    """Whether work touching `elements` pays for a split over `threads` threads."""
    return threads > 1 and elements >= SPLIT_MIN_ELEMENTS


def ranges(n: int, parts: int):
    """`parts` contiguous (start, stop) ranges covering range(n), none empty."""
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def split(parts, pool: Pool):
    """One callable running the callables in `parts` concurrently: part 0 on the caller's
    thread, the others handed to `pool`'s workers. A part no worker has started
    by the time the caller is done with its own, the caller runs itself, so a worker that
    is slow to wake (a busy host, a short part) costs no waiting. An exception of any part
    is raised after all parts finish.

    Whether handing parts to workers pays is measured, not assumed: the callable times
    its first calls both ways (_Chooser) and keeps the faster, since a worker's wake-up
    and GIL hand-offs can cost more than a short part saves. Both ways run the same
    parts, so results are the same bits."""
    parts = [p for p in parts if p is not None]
    if len(parts) <= 1:
        return parts[0] if parts else None
    first, rest = parts[0], parts[1:]
    workers = pool.workers(len(rest))

    def concurrent():
        tasks = [_Task(p) for p in rest]
        for w, t in zip(workers, tasks):
            w.queue.put(t)
        error = None
        try:
            first()
        except BaseException as e:  # re-raised once every part is done
            error = e
        for t in tasks:
            error = t.run_here_or_wait() or error
        if error is not None:
            raise error

    def serial():
        error = None
        for p in parts:
            try:
                p()
            except BaseException as e:  # raised once every part is done, as above
                error = error or e
        if error is not None:
            raise error

    return _Chooser(concurrent, serial, pool)


class _Chooser:
    """Calls `a` or `b`: alternately for the first TRIALS calls of each, timing them, then
    for good the one with the lower median time."""

    TRIALS = 5
    clock = staticmethod(time.perf_counter)  # a test's own clock makes the choice deterministic

    def __init__(self, a, b, pool):
        self._fns, self._times = (a, b), ([], [])
        self._calls = 0
        self._chosen = None
        self.pool = pool  # also keeps the pool alive: a collected pool stops its workers

    def __call__(self):
        if self.pool.serial:
            return self._fns[1]()
        chosen = self._chosen
        if chosen is not None:
            return chosen()
        k = self._calls % 2
        self._calls += 1
        t0 = self.clock()
        try:
            self._fns[k]()
        finally:
            self._times[k].append(self.clock() - t0)
            if self._calls == 2 * self.TRIALS:
                a, b = (sorted(t)[len(t) // 2] for t in self._times)
                self._chosen = self._fns[0] if a <= b else self._fns[1]
        return None


class RunChooser:
    """Whether runs hand split parts to the pool's workers (`concurrent`) or run on the
    calling thread alone (kernels bound for one thread, or with
    use_deterministic_compute every split's parts one after another: Pool.serial),
    decided on whole runs. A split's own timing (_Chooser) misses what a worker costs
    the nodes after it (a late wake-up taking the GIL and a core from the caller) and
    what handing parts over costs when they end up run one after another: on a host
    whose other cores were busy, 2-thread runs were slower than 1-thread ones
    (docs/performance.md, "Kernel measurements"). After WARM runs (the splits' choosers
    settle), TRIALS runs each way alternate, timed, and the faster way by median stays
    until the next trials, RECHECK runs later: soon after the first decisions, since a
    burst of noise on the host can make the slower way win five runs (ResNet-18 kept the
    slower single-thread kernels), then every RECHECK[-1] runs (the host's load
    changes). Inactive (one thread): always concurrent."""

    WARM, TRIALS, RECHECK = 10, 5, (20, 50, 100, 200, 500)

    def __init__(self, active: bool):
        self._active = active
        self._runs = 0
        self._decisions = 0
        self._times = ([], [])  # seconds per trial run: split, single-thread
        self._chosen = True
        self.concurrent = True  # this run's way

    @property
    def splits(self) -> bool:
        """The way runs take outside trials: True hands split parts to the workers."""
        return self._chosen

    @property
    def settled(self) -> bool:
        """True once the first trials have decided the way (always, when inactive)."""
        return not self._active or self._decisions > 0

    def before_run(self) -> bool:
        """Set `concurrent` for this run; True when the run is a trial to time (after_run)."""
        if not self._active:
            return False
        self._runs += 1
        trial = self._runs - self.WARM
        timed = 0 < trial <= 2 * self.TRIALS
        self.concurrent = trial % 2 == 1 if timed else self._chosen
        return timed

    def after_run(self, seconds: float):
        """Record a trial run's time; after the last trial, keep the faster way."""
        self._times[0 if self.concurrent else 1].append(seconds)
        if self._runs - self.WARM == 2 * self.TRIALS:
            split_way, single = (sorted(t)[len(t) // 2] for t in self._times)
            self._chosen = split_way <= single
            self._times = ([], [])
            wait = self.RECHECK[min(self._decisions, len(self.RECHECK) - 1)]
            self._decisions += 1
            self._runs = self.WARM - wait  # the trials come round again after `wait` runs


# --- workers -----------------------------------------------------------------------------

_STOP = object()


class _Task:
    """One part, claimed by whichever of the worker and the caller gets to it first."""

    __slots__ = ("fn", "claim", "done", "error")

    def __init__(self, fn):
        self.fn, self.error = fn, None
        self.claim, self.done = threading.Lock(), threading.Lock()
        self.done.acquire()

    def _run(self):
        """Run the part; its error, or None."""
        try:
            self.fn()
        except BaseException as e:  # handed to the caller
            return e
        return None

    def run_claimed(self):
        """(worker) Run the part unless the caller took it; then post done."""
        if self.claim.acquire(blocking=False):
            self.error = self._run()
            self.done.release()

    def run_here_or_wait(self):
        """(caller) Run the part if no worker has started it, else wait for it; its error."""
        if self.claim.acquire(blocking=False):
            return self._run()
        self.done.acquire()
        return self.error


class _Worker:
    """A daemon thread running the tasks put on its queue. It sleeps in queue.get()
    between them (a blocking wait, never a spin), burning no CPU."""

    def __init__(self):
        self.queue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="pmx-worker").start()

    def _loop(self):
        get = self.queue.get
        # as the session's run loop: a split part may compute over columns it then drops
        # (a stride phase's padding), and no warning of it should reach the host's stderr
        with np.errstate(all="ignore"):
            while True:
                task = get()
                if task is _STOP:
                    return
                task.run_claimed()

    def stop(self):
        self.queue.put(_STOP)
