"""Threads: each session's own worker threads, and how kernels split work over them.

numpy's ufuncs, copies and BLAS calls release the GIL, so a kernel that is a sequence of
such calls can run disjoint slices of its work on several cores at once. `split(parts)`
turns callables that each cover one slice into one callable that runs part 0 on the
calling thread and the others on worker threads of the current `Pool`.

A pool belongs to one session and one calling thread (sessions keep a pool per thread,
as they keep an arena per thread), so two sessions never share or resize each other's
threads, and nothing here changes process-wide state: not the environment, not BLAS's
or numexpr's thread counts, not affinities. BLAS's thread count is only read: when a
pool binds kernels while the BLAS is limited to one thread (OPENBLAS_NUM_THREADS=1,
threadpoolctl), kernels split their GEMMs over the pool's threads; otherwise GEMMs run
whole and BLAS's own threads share them out, so the two never multiply.

Waiting workers sleep on locks (threading.Lock, which any thread may release). With
spinning allowed (SessionOptions' "session.intra_op.allow_spinning"), a pool's workers
and its caller instead spin on POSIX spinlocks, with the GIL released, while one of its
runs is inside `running()`, and sleep again when it ends: a hand-off to a sleeping
thread costs a kernel wake-up (tens to hundreds of microseconds on a VM), a spinning one
a few. Each spinlock is unlocked only by the thread holding it (_SpinHandoff).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import time
import weakref

# below this many elements touched, a split's hand-off costs more than the second core saves
SPLIT_MIN_ELEMENTS = 1 << 16

# --- BLAS: found among the loaded libraries, its thread count only read -----------------

_BLAS_LIB_HINTS = ("openblas", "mkl_rt", "libblis")
_BLAS_THREAD_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                        "openblas_get_num_threads64_", "openblas_get_num_threads", "MKL_Get_Max_Threads",
                        "bli_thread_get_num_threads")


def _loaded_libraries():
    """Sorted paths of the mapped files whose name mentions a BLAS (_BLAS_LIB_HINTS)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            text = f.read().decode(errors="surrogateescape")
    except OSError:
        return []
    fields = [line.split(None, 5) for line in text.splitlines() if any(h in line.lower() for h in _BLAS_LIB_HINTS)]
    paths = {f[5].strip() for f in fields if len(f) == 6 and "/" in f[5]}
    return sorted(p for p in paths if any(h in os.path.basename(p).lower() for h in _BLAS_LIB_HINTS))


@functools.cache
def blas_handles():
    """ctypes handles of the loaded BLAS libraries: where blas.py looks up its public C
    entry points. Read once: numpy loads its BLAS when it is imported."""
    handles = []
    for path in _loaded_libraries():
        try:
            handles.append(ctypes.CDLL(path))
        except OSError:
            continue
    return handles


@functools.cache
def _blas_thread_getter():
    for lib in blas_handles():
        for name in _BLAS_THREAD_GETTERS:
            getter = getattr(lib, name, None)
            if getter is not None:
                getter.argtypes, getter.restype = [], ctypes.c_int
                return getter
    return None


def blas_threads():
    """BLAS's current thread count, or None when no known BLAS is loaded."""
    getter = _blas_thread_getter()
    return getter() if getter is not None else None


# --- pools -------------------------------------------------------------------------------


class Pool:
    """Up to `threads - 1` worker threads (made on first use) that run split parts for one
    caller thread at a time. `spinning`: workers poll for parts inside running().
    `splits_gemms` (None: read BLAS's thread count now) says whether kernels bound on it
    split their BLAS calls over its threads."""

    def __init__(self, threads: int, spinning: bool = False, splits_gemms: bool | None = None):
        self.threads = max(1, int(threads))
        self.spinning = spinning
        self._workers: list[_Worker] = []
        self._runs_inside = 0
        self._lock = threading.Lock()
        # read when kernels bind: whether their GEMMs are this pool's to split
        if splits_gemms is None:
            splits_gemms = blas_threads() == 1
        self.splits_gemms = self.threads > 1 and splits_gemms
        weakref.finalize(self, _stop_all, self._workers)

    def workers(self, n):
        with self._lock:
            while len(self._workers) < n:
                self._workers.append(_Worker())
            return self._workers[:n]

    @contextlib.contextmanager
    def running(self):
        """A run on the pool's caller thread: with spinning allowed, the workers spin for
        parts until it ends (and sleep again after)."""
        if not self.spinning:
            yield
            return
        with self._lock:
            self._runs_inside += 1
            workers = list(self._workers) if self._runs_inside == 1 else []
        for w in workers:
            w.begin_spinning()
        try:
            yield
        finally:
            with self._lock:
                self._runs_inside -= 1
                workers = list(self._workers) if self._runs_inside == 0 else []
            for w in workers:
                w.end_spinning()


def _stop_all(workers):
    for w in workers:
        w.stop()


_context = threading.local()  # .pool: the pool kernels bound on this thread split over


def _default_threads():
    from pmx.runtime.options import default_thread_count

    return default_thread_count()


def current_pool() -> Pool:
    """The pool of the binding in progress on this thread (`binding`), else this thread's
    default pool (the default thread count; compile-time folding and tuning bind here)."""
    pool = getattr(_context, "pool", None)
    if pool is None:
        pool = getattr(_context, "default", None)
        if pool is None:
            pool = _context.default = Pool(_default_threads())
    return pool


@contextlib.contextmanager
def binding(pool: Pool):
    """Kernels made inside split their work over `pool`."""
    saved = getattr(_context, "pool", None)
    _context.pool = pool
    try:
        yield pool
    finally:
        _context.pool = saved


def using_threads(n: int, spinning: bool = False, splits_gemms: bool | None = None):
    """Kernels made inside split over a new pool of `n` threads (tests, tools)."""
    return binding(Pool(n, spinning, splits_gemms))


def running():
    """The current pool's running() (see Pool.running)."""
    return current_pool().running()


def num_threads() -> int:
    return current_pool().threads


def gemm_threads() -> int:
    """Threads a kernel may split BLAS calls over: the pool's when BLAS runs on one
    thread, else 1 (BLAS's own threads share the GEMM out)."""
    pool = current_pool()
    return pool.threads if pool.splits_gemms else 1


def worth_splitting(elements: int) -> bool:
    return num_threads() > 1 and elements >= SPLIT_MIN_ELEMENTS


def ranges(n: int, parts: int):
    """`parts` contiguous (start, stop) ranges covering range(n), none empty."""
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def split(parts):
    """One callable running the callables in `parts` concurrently (part 0 on the caller's
    thread, the others on the current pool's workers); an exception of any part is raised
    after all parts finish."""
    parts = [p for p in parts if p is not None]
    if len(parts) <= 1:
        return parts[0] if parts else None
    first, rest = parts[0], parts[1:]
    pool = current_pool()  # kept alive by run(): a collected pool stops its workers
    workers = pool.workers(len(rest))

    def run():
        for w, p in zip(workers, rest):
            w.start(p)
        error = None
        try:
            first()
        except BaseException as e:  # noqa: BLE001 - re-raised once the workers are done
            error = e
        for w in workers:
            e = w.wait()
            error = error or e
        if error is not None:
            raise error

    run.pool = pool
    return run


# --- workers -----------------------------------------------------------------------------

_STOP = object()
_SPIN_BEGIN, _SPIN_END = object(), object()


class _Worker:
    """A daemon thread running one callable per start()/wait() pair.

    Asleep, it blocks on `_go`, a lock created held that the caller releases for each
    part; it releases `_done`, made the same way, when the part is done (threading.Lock
    may be released by any thread). While a spinning pool's run lasts, the worker and
    its caller hand parts over with a _SpinHandoff instead."""

    def __init__(self):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._fn = self._error = None
        self._spin = None  # the _SpinHandoff while spinning
        self.lock = threading.Lock()  # one caller at a time
        threading.Thread(target=self._loop, daemon=True, name="pmx-worker").start()

    def _loop(self):
        while True:
            self._go.acquire()
            fn = self._fn
            if fn is _SPIN_BEGIN:
                spin = self._spin
                spin.worker_enter()
                self._done.release()
                self._serve_spinning(spin)
                continue
            if fn is _STOP:
                self._done.release()
                return
            self._call(fn)
            self._done.release()

    def _serve_spinning(self, spin):
        while True:
            spin.worker_wait_go()
            fn = self._fn
            if fn is _SPIN_END:
                spin.worker_leave()
                return
            self._call(fn)
            spin.worker_post_done()

    def _call(self, fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._error = e

    def start(self, fn):
        self.lock.acquire()
        self._fn, self._error = fn, None
        if self._spin is not None:
            self._spin.caller_post_go()
        else:
            self._go.release()

    def wait(self):
        if self._spin is not None:
            self._spin.caller_wait_done()
        else:
            self._done.acquire()
        error, self._fn, self._error = self._error, None, None
        self.lock.release()
        return error

    def begin_spinning(self):
        """(on the thread that will post parts until end_spinning)"""
        functions = _spinlock_functions()
        if functions is None or self._spin is not None:
            return
        with self.lock:
            spin = _SpinHandoff(functions)
            spin.caller_enter()
            self._fn = _SPIN_BEGIN
            self._spin = spin
            self._go.release()
            self._done.acquire()
            self._fn = None

    def end_spinning(self):
        spin = self._spin
        if spin is None:
            return
        with self.lock:
            self._fn = _SPIN_END
            spin.caller_post_go()
            spin.caller_leave()
            self._spin = self._fn = None

    def stop(self):
        self.start(_STOP)
        self.wait()


@functools.cache
def _spinlock_functions():
    """(init, destroy, lock, unlock) of the C library's POSIX spinlocks, or None (not
    glibc/Linux). lock() goes through ctypes.CDLL, which releases the GIL while it spins;
    unlock() through PyDLL, which keeps it: the call never blocks."""
    try:
        c, py = ctypes.CDLL(None), ctypes.PyDLL(None)
        fns = (c.pthread_spin_init, c.pthread_spin_destroy, c.pthread_spin_lock, py.pthread_spin_unlock)
    except (OSError, AttributeError):
        return None
    for f in fns:
        f.argtypes, f.restype = [ctypes.c_void_p] + ([ctypes.c_int] if f is fns[0] else []), ctypes.c_int
    return fns


class _SpinHandoff:
    """Parts handed between one caller thread and one worker over three POSIX spinlocks
    used in rotation, so that every lock is only ever unlocked by the thread holding it
    (POSIX leaves any other unlock undefined). In round r the caller holds locks r and
    r+1 and the worker holds r+2 (mod 3): the caller unlocks r (go), the worker, spinning
    on it, takes it, runs the part and unlocks r+2 (done), which the caller spins on.
    Then the caller holds r+1 and r+2 and the worker r: round r+1's positions."""

    def __init__(self, functions):
        self._init, self._destroy, self._lock, self._unlock = functions
        self._cells = (ctypes.c_int * 48)()  # three locks, each on its own cache line
        self._addresses = [ctypes.addressof(self._cells) + 64 * k for k in range(3)]
        for address in self._addresses:
            self._init(address, 0)
        self._caller_round = self._worker_round = 0

    def _at(self, k):
        return self._addresses[k % 3]

    def caller_enter(self):
        self._lock(self._at(0))
        self._lock(self._at(1))

    def worker_enter(self):
        self._lock(self._at(2))

    def caller_post_go(self):
        self._unlock(self._at(self._caller_round))

    def caller_wait_done(self):
        self._lock(self._at(self._caller_round + 2))
        self._caller_round += 1

    def worker_wait_go(self):
        self._lock(self._at(self._worker_round))

    def worker_post_done(self):
        self._unlock(self._at(self._worker_round + 2))
        self._worker_round += 1

    def worker_leave(self):
        """The worker took round r's go and holds r and r+2: it frees both, r+2 last."""
        self._unlock(self._at(self._worker_round))
        self._unlock(self._at(self._worker_round + 2))

    def caller_leave(self):
        """After posting the worker's way out: wait until it has freed r+2, then free all."""
        r = self._caller_round
        self._lock(self._at(r + 2))
        self._unlock(self._at(r + 1))
        self._unlock(self._at(r + 2))
        for address in self._addresses:
            self._destroy(address)
