"""Threads: how many the runtime uses, for BLAS, numexpr and its own kernel splits.

numpy's ufuncs and copies release the GIL, so a kernel that is a sequence of ufunc calls
(depthwise convolution, im2col copies, big elementwise passes) can run its halves on two
cores at once (kernels/common.gemm splits GEMMs the same way). `split(parts)` turns a
list of callables, each covering a disjoint slice of the work, into one callable that
runs part 0 on the calling thread and the others on persistent worker threads, which
spin for parts while runs are inside (`running()`; see the workers section). A dispatch
then costs about 5-40 us here (GIL hand-off), so kernels split only work measured to
take well over that (`worth_splitting`). With PMX_WORKERS=processes (Linux), the parts
of a session's splits run in a forked worker process instead, which has a GIL of its
own (see the worker processes section at the end).

The thread count is process-wide, as BLAS's and numexpr's are: set_num_threads(n) sets
all three, BLAS's when the next run starts (InferenceSession(..., num_threads=n) calls
it). The default is the number of cores this process may run on. BLAS is found among
the libraries loaded in this process (numpy's bundled OpenBLAS, or MKL) and driven
through its own C entry point; when none is found, BLAS keeps its own default and
`blas_threads_controlled()` says False.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import sys
import threading
import time

from pmx.runtime import openblas_env

# below this many elements touched, a split's dispatch costs more than the second core saves
SPLIT_MIN_ELEMENTS = 1 << 16

# (setter, getter) entry points per BLAS build
_BLAS_ENTRY_POINTS = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
                      ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
                      ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
                      ("openblas_set_num_threads", "openblas_get_num_threads"),
                      ("MKL_Set_Num_Threads", "MKL_Get_Max_Threads"),
                      ("bli_thread_set_num_threads", "bli_thread_get_num_threads"))
_BLAS_LIB_HINTS = ("openblas", "mkl_rt", "libblis")


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_num_threads = _default_threads()
_workers: list = []
_runs_inside = 0  # runs (on any thread) inside running()
_lock = threading.Lock()  # guards _workers and _runs_inside


def num_threads() -> int:
    return _num_threads


def set_num_threads(n: int) -> None:
    """Threads for BLAS, numexpr (if loaded later, it picks this up) and kernel splits.
    BLAS gets the count when a run first needs BLAS control (or blas_threads() asks):
    finding the BLAS library reads /proc/self/maps (~0.8 ms), which session creation
    need not pay."""
    global _num_threads, _blas_pending
    n = int(n)
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    _num_threads = n
    _blas_pending = True

    if not _runs_inside:
        _set_numexpr_threads(n)


def numexpr_threads() -> int:
    """The thread count numexpr should have now: 1 inside runs (see running())."""
    return 1 if _runs_inside else _num_threads


_numexpr_adopted = False  # numexpr runs pmx's programs (adopt_numexpr)


def adopt_numexpr():
    """numexpr now runs pmx's programs (expr._numexpr_compiler): from here on pmx sets its
    thread count, 1 inside runs (see running()) and num_threads() outside."""
    global _numexpr_adopted
    _numexpr_adopted = True
    _set_numexpr_threads(numexpr_threads())


def _set_numexpr_threads(n):
    """numexpr's thread count, once pmx runs programs on it. A numexpr loaded by anything
    else (pandas loads it whenever it is installed) is left alone: the two changes a run
    would make cost ~55 us (set_num_threads(1) 40 us, back to 2 14 us)."""
    if _numexpr_adopted:
        sys.modules["numexpr"].set_num_threads(n)


# --- BLAS ----------------------------------------------------------------------------

def _loaded_libraries():
    """Sorted paths of the mapped files whose name mentions a BLAS (_BLAS_LIB_HINTS).
    Read in one call and only the lines naming a hint are split: splitting each of its
    lines, read one by one, cost ~0.8 ms of every load."""
    try:
        with open("/proc/self/maps", "rb") as f:
            text = f.read().decode(errors="surrogateescape")
    except OSError:
        return []
    # fields: address perms offset dev inode path
    fields = [line.split(None, 5) for line in text.splitlines() if any(h in line.lower() for h in _BLAS_LIB_HINTS)]
    paths = {f[5].strip() for f in fields if len(f) == 6 and "/" in f[5]}
    return sorted(p for p in paths if any(h in os.path.basename(p).lower() for h in _BLAS_LIB_HINTS))


@functools.cache
def blas_libraries():
    """_loaded_libraries(), read once: numpy loads its BLAS when it is imported."""
    return _loaded_libraries()


@functools.cache
def blas_handles():
    """ctypes handles of the loaded BLAS libraries (blas_libraries()) that open, in that
    order: where the runtime looks up BLAS's C entry points."""
    handles = []
    for path in blas_libraries():
        try:
            handles.append(ctypes.CDLL(path))
        except OSError:
            continue
    return handles


@functools.cache
def _blas():
    """(setter, getter or None) of the first loaded BLAS with a known entry point, or
    (None, None). Looked up once."""
    for lib in blas_handles():
        for set_name, get_name in _BLAS_ENTRY_POINTS:
            setter, getter = getattr(lib, set_name, None), getattr(lib, get_name, None)
            if setter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                if getter is not None:
                    getter.argtypes, getter.restype = [], ctypes.c_int
                return setter, getter
    return None, None


def blas_threads():
    """BLAS's current thread count, or None when pmx found no BLAS it can drive."""
    _apply_blas_threads()
    getter = _blas()[1]
    return getter() if getter is not None else None


_blas_pending = False  # set_num_threads was called and BLAS has not been told yet


def _apply_blas_threads():
    global _blas_pending
    if _blas_pending:
        _blas_pending = False
        setter = _blas()[0]
        if setter is not None:
            setter(_num_threads)


def blas_threads_controlled() -> bool:
    return _blas()[0] is not None


# --- kernel splits -------------------------------------------------------------------


def worth_splitting(elements: int) -> bool:
    return _num_threads > 1 and elements >= split_minimum(SPLIT_MIN_ELEMENTS)


def split_minimum(threshold):
    """A kernel's smallest work worth a split: `threshold` as measured with worker
    threads, divided by PROCESS_SPLIT_DIVISOR for a kernel bound for worker processes
    (inside shared_memory)."""
    return threshold // PROCESS_SPLIT_DIVISOR if _binding_for_processes() else threshold


def ranges(n: int, parts: int):
    """`parts` contiguous (start, stop) ranges covering range(n), none empty."""
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def split(parts):
    """One callable running the callables in `parts` concurrently (part 0 on the caller's
    thread); exceptions of any part are raised after all parts finish."""
    parts = [p for p in parts if p is not None]
    if len(parts) <= 1:
        return parts[0] if parts else None
    first, rest = parts[0], parts[1:]
    # parts go to a worker process only when made where every buffer is shared with it
    process = _binding_for_processes()
    workers = _get_process_workers(len(rest)) if process else _get_workers(len(rest))

    def run():
        for w, p in zip(workers, messages):
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

    # a worker process runs a part named by its id; a thread, the callable itself
    messages = _register_parts(rest, run) if process else rest
    return run


# --- workers ---------------------------------------------------------------------------
#
# A worker that sleeps between parts pays the kernel's wake-up, and on a VM whose idle
# vCPU halts that is the vCPU's too: a split of two no-op parts cost 24 us hot, 117 us
# after 5 ms of the caller's own work and 162 us after 20 ms (this 2-core Firecracker
# VM). Inside run() a split comes every 0.1-1 ms, so most paid the slow case: two halves
# of a 960x160 @ 160x49 GEMM took 240 us after other work against 196 us for the whole
# on one thread. So inside runs (`running()`) workers wait for parts spinning on a libc
# spinlock through ctypes, which releases the GIL while it spins: the same split took
# 4-12 us hot and 12-40 us after 20 ms, and the halved GEMM 154 us. Outside runs they
# sleep, burning no CPU between runs (as onnxruntime's spinning pool does, a run keeps
# one core per extra thread busy). Without pthread spinlocks (not glibc/Linux) workers
# always sleep.


@functools.cache
def _libc_functions(*names):
    """The C library's functions `names` (through ctypes), or None where one is missing
    (not glibc/Linux)."""
    try:
        libc = ctypes.CDLL(None)
        return tuple(getattr(libc, name) for name in names)
    except (OSError, AttributeError):
        return None


@functools.cache
def _spin():
    """(lock, unlock, init) of libc's pthread spinlocks taking an address, or None
    (PMX_NO_SPIN set, or no such functions). Read when the first worker is made."""
    fns = None if os.environ.get("PMX_NO_SPIN") else _libc_functions("pthread_spin_lock", "pthread_spin_unlock",
                                                                      "pthread_spin_init")
    if fns is None:
        return None
    for f in fns:
        f.argtypes, f.restype = [ctypes.c_void_p] + ([ctypes.c_int] if f is fns[2] else []), ctypes.c_int
    return fns


@functools.cache
def _unlock_keeping_gil():
    """libc's pthread_spin_unlock called through ctypes.PyDLL, so the caller keeps the GIL
    during the call (it never blocks), or None where it is missing."""
    try:
        fn = ctypes.PyDLL(None).pthread_spin_unlock
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_int
    return fn


class _Spinlock:
    """A pthread spinlock, created held. wait() spins (GIL released) until another
    thread's post(), and takes it again for the next round. With `keep_gil`, post()
    does not release the GIL (_Worker's "done")."""

    def __init__(self, fns, keep_gil=False):
        lock, unlock, init = fns
        self._cell = ctypes.c_int(0)
        address = ctypes.addressof(self._cell)
        init(address, 0)
        lock(address)
        self.wait = functools.partial(lock, address)
        self.post = functools.partial((keep_gil and _unlock_keeping_gil()) or unlock, address)


class _Signal:
    """The sleeping stand-in for _Spinlock: a raw lock created held."""

    def __init__(self):
        lock = threading.Lock()
        lock.acquire()
        self.wait, self.post = lock.acquire, lock.release


_PARK = object()  # the part that sends an awake worker back to sleep


class _Worker:
    """A daemon thread running one callable per start()/wait() pair. While `awake` it
    waits for parts on `_go` (a spinlock, so it spins); otherwise it sleeps on `_wake`.
    running() wakes it when the first run enters and parks it when the last leaves;
    start() wakes a parked worker for one part (a split outside any run) or, inside
    runs, until the last run leaves."""

    def __init__(self):
        spin = _spin()
        # "done" is posted holding the GIL: a worker that released it there found the
        # caller holding it on return and slept in the GIL's wait until the caller's next
        # release, so a split soon after found it asleep instead of spinning. An empty
        # split after 0.1-0.3 ms of the caller's work: 13.7-15.7 -> 8.9 us; after 1 ms
        # 14.4 -> 9.2; after 5 ms level (14-16). Whole models, alternating processes in
        # a noisy hour: MobileNetV2 12.96 -> 12.70 ms (7 of 8 pairs) and 13.42 -> 13.33
        # (4 of 8), ShuffleNetV2 6.77 -> 6.72 (7 of 8) and 7.81 -> 7.65 (6 of 8), the
        # others within noise.
        self._go, self._done = ((_Spinlock(spin), _Spinlock(spin, keep_gil=True)) if spin
                                else (_Signal(), _Signal()))
        self._wake = _Signal()
        self._fn = self._error = None
        self.awake = False
        self._one_part = False  # woken for one split outside a run: sleep again after it
        self.lock = threading.Lock()  # one caller at a time (sessions run on many threads)
        self.cpu = None  # the core _place_workers pinned it to (None: any allowed core)
        thread = threading.Thread(target=self._loop, daemon=True, name="pmx-worker")
        thread.start()
        self.native_id = thread.native_id

    def _loop(self):
        while True:
            self._wake.wait()
            while True:
                self._go.wait()
                fn = self._fn
                if fn is not _PARK:
                    try:
                        fn()
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        self._error = e
                self._done.post()
                if fn is _PARK:
                    break

    def start(self, fn):
        self.lock.acquire()
        if not self.awake:
            self.unpark()
            self._one_part = _runs_inside == 0
        self._fn, self._error = fn, None
        self._go.post()

    def wait(self):
        self._done.wait()
        error, self._fn, self._error = self._error, None, None
        if self._one_part:
            self.park()
        self.lock.release()
        return error

    def unpark(self):
        """(caller holds self.lock)"""
        self._wake.post()
        self.awake, self._one_part = True, False

    def park(self):
        """(caller holds self.lock) Sends the worker back to sleep once it has taken the
        message, so a later unpark() cannot race with it."""
        self._fn = _PARK
        self._go.post()
        self._done.wait()
        self._fn, self.awake, self._one_part = None, False, False


@contextlib.contextmanager
def running():
    """What a session's run() holds, from the first concurrent run's start to the last
    one's end (counted, so one thread finishing never hands BLAS threads back in the
    middle of another's GEMMs: results stay bit-identical across threads):
    - BLAS on one thread. pmx splits its GEMMs itself (kernels/common.gemm); OpenBLAS's
      idle threads spin for a while after each call, and a spinning BLAS thread on the
      core a pmx worker needs doubled the time of the step after a GEMM (measured on
      MobileNetV2's depthwise layers).
    - numexpr on one thread: its own pool would share a core with a spinning worker
      (the scheduler slices them by the millisecond), so numexpr programs are split over
      pmx's threads like numpy ones.
    - pmx's workers awake, spinning for parts (see the note above _spin)."""
    global _runs_inside
    with _lock:
        _runs_inside += 1
        workers = _enter_first_run() if _runs_inside == 1 else []
    for w in workers:
        with w.lock:
            if not w.awake:
                w.unpark()
    try:
        yield
    finally:
        with _lock:
            _runs_inside -= 1
            workers = _leave_last_run() if _runs_inside == 0 else []
        for w in workers:
            with w.lock:
                if w.awake:
                    w.park()


def _enter_first_run():
    """(caller holds _lock) BLAS and numexpr to one thread; the workers to wake."""
    _calm_blas_pool()
    _apply_blas_threads()
    setter = _blas()[0]
    if setter is not None and _num_threads > 1:
        setter(1)
    _set_numexpr_threads(1)
    if not (_spin() and _num_threads > 1):
        return []
    workers = _all_workers()
    _place_workers(workers)
    return workers


# --- where spinning workers run ------------------------------------------------------
#
# A woken worker that Linux places on the caller's core spins there, and the caller waits
# for the scheduler tick (4 ms here) to get its core back; the load balancer moves one of
# them after a tick or two. That happened in the first run of most fresh processes on
# this 2-core VM: empty splits took 4-8 ms instead of 0.01-0.04 ms, and SqueezeNet's first
# run spent 33-36 ms in its kernels against 16-18 ms (the same run with workers that
# sleep: 18 ms). So when a run enters, each spinning worker is pinned to a core other than
# the caller's, the caller itself left free (pmx does not own its threads).


@functools.cache
def _sched_getcpu():
    """libc's sched_getcpu (the calling thread's core), or None where it is missing."""
    found = _libc_functions("sched_getcpu")
    if found is None:
        return None
    [getcpu] = found
    getcpu.argtypes, getcpu.restype = [], ctypes.c_int
    return getcpu


def _place_workers(workers):
    """(caller holds _lock) Pin each worker to its own core among those this thread may
    use, skipping the one it runs on; workers beyond the free cores may run anywhere."""
    getcpu = _sched_getcpu()
    if getcpu is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        allowed = os.sched_getaffinity(0)
    except OSError:  # a sandbox that refuses the call: leave placement to the scheduler
        return
    here = getcpu()
    free = sorted(allowed - {here}) if here in allowed else []
    for k, w in enumerate(workers):
        cpu = free[k] if k < len(free) else None
        if w.native_id is None:  # a worker process not forked yet
            continue
        if cpu != w.cpu:
            try:
                os.sched_setaffinity(w.native_id, {cpu} if cpu is not None else allowed)
            except OSError:  # the thread is gone (forked child) or the core was taken away
                cpu = None
            w.cpu = cpu


def _leave_last_run():
    """(caller holds _lock) BLAS and numexpr back to the configured count; the workers
    to park."""
    setter = _blas()[0]
    if setter is not None and _num_threads > 1:
        setter(_num_threads)
    _set_numexpr_threads(_num_threads)
    return _all_workers()


def _all_workers():
    """(caller holds _lock) The worker processes (sessions' splits) before the worker
    threads (splits of kernels bound elsewhere)."""
    return list(_process_workers if process_workers() else []) + list(_workers)


def _forget_workers():
    """In a forked child the workers' threads do not exist: start afresh."""
    global _workers, _runs_inside, _process_workers
    _workers, _runs_inside, _process_workers = [], 0, []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _get_workers(n):
    with _lock:
        while len(_workers) < n:
            _workers.append(_Worker())
        return _workers[:n]


# --- worker processes (PMX_WORKERS=processes) ------------------------------------------
#
# Worker threads share the GIL with the caller: every numpy call a part makes may hand it
# over, a futex wake each time, so a split node gains little on two cores (a depthwise
# conv of 576x7x7, 5x5, with bias and hardswish: 303 us on one thread, 231 split over two
# threads). A forked worker process has a GIL of its own: the same split took 162 us.
# With PMX_WORKERS=processes set before import (or set_workers("processes"), which
# InferenceSession(..., workers=...) calls), splits send their parts to worker
# processes instead (Linux: fork, process-shared pthread spinlocks; elsewhere threads
# stay). A worker is forked from the caller once the parts exist, and again when parts
# made after its fork come (a new binding). A binding made in this mode puts the arrays
# its kernels allocate in memory shared with the workers (shared_memory), so what one
# process writes the other reads.

_CAN_FORK_WORKERS = hasattr(os, "fork") and sys.platform.startswith("linux")
PROCESS_WORKERS = os.environ.get("PMX_WORKERS", "") == "processes" and _CAN_FORK_WORKERS
# A worker with no run inside sleeps after spinning this long without a part: runs back
# to back keep it spinning, one run now and then costs this much CPU after it.
PROCESS_LINGER_SECONDS = 0.002
# Parts in a worker process run without GIL hand-offs, so smaller work pays for a split:
# every split threshold (split_minimum) divided by this. Steady ms, worker processes,
# thresholds as measured for threads -> divided by 4 -> by 16, alternating fresh
# processes: MobileNetV3-small 4.32-4.40 -> 3.99-4.08 -> 4.03-4.16, ShuffleNetV2
# 5.32-5.47 -> 5.17-5.21 -> 5.16-5.17, MobileNetV2 11.19-11.27 -> 10.95-10.96 -> 11.04-11.13.
PROCESS_SPLIT_DIVISOR = 4
# OpenBLAS's pool threads spin for its thread timeout (2^28 cycles, ~0.1 s here) after
# each call before they sleep. A fork shuts the pool down (OpenBLAS's fork handler), and
# the end of that run restarts it, BLAS getting its N threads back between runs; the
# restarted thread then spun on the worker's core and took whole scheduler ticks from
# it: MobileNetV3-small's runs 2-13 after the first took 8.9-9.1 ms, against 4.2-4.3
# with OPENBLAS_THREAD_TIMEOUT=4 (2^4 cycles: idle threads sleep at once; runs 14-40
# 4.1 either way). See _calm_blas_restarts.
BLAS_RESTART_TIMEOUT = openblas_env.SHORT_TIMEOUT
_SHARED_CHUNK = 64 << 20
_parts_registry: dict = {}  # part id -> callable, for parts a worker process may run
_next_part_id = 0
_EXIT = -1


@functools.cache
def _openblas_pool_functions():
    """(openblas_read_env, openblas_thread_timeout, blas_thread_shutdown_) of the first
    loaded BLAS that has all three (OpenBLAS), or None."""
    for lib in blas_handles():
        functions = [getattr(lib, name, None) for name in ("openblas_read_env", "openblas_thread_timeout",
                                                           "blas_thread_shutdown_")]
        if None not in functions:
            read_env, timeout, shutdown = functions
            read_env.argtypes, read_env.restype = [], None
            timeout.argtypes, timeout.restype = [], ctypes.c_int
            shutdown.argtypes, shutdown.restype = [], ctypes.c_int
            return read_env, timeout, shutdown
    return None


@functools.cache
def _calm_blas_restarts():
    """Have OpenBLAS pools started from now on (after each fork) put idle threads to
    sleep at once (BLAS_RESTART_TIMEOUT); returns whether that took. OpenBLAS reads
    OPENBLAS_THREAD_TIMEOUT into a static in openblas_read_env(), at load and when called,
    and a pool (re)start reads that static: so the variable is set for one such call and
    removed again. A timeout you set yourself is left alone. The cost: your own
    multi-threaded BLAS calls between runs wake sleeping threads (a futex each) instead
    of finding them spinning."""
    found = _openblas_pool_functions()
    if found is None or openblas_env.user_set_timeout():
        return False
    read_env, timeout, _ = found
    with openblas_env.short_timeout():
        read_env()
    return timeout() == BLAS_RESTART_TIMEOUT


_blas_pool_settled = False  # the pool's idle timeout is short, or pmx may not change it


def _calm_blas_pool():
    """(caller holds _lock, at a first run's entry) When numpy loaded OpenBLAS before
    pmx.runtime could set its idle timeout (runtime/__init__.py), the pool's threads spin
    ~0.1 s after each of your BLAS calls on the core pmx's worker needs. Then the pool is
    shut down with the timeout static at BLAS_RESTART_TIMEOUT, and OpenBLAS starts it
    again (when its thread count is next set, as below, or at its next multi-threaded
    call) with threads that sleep at once. Only while no
    Python thread exists but the caller and pmx's workers: a pool shut down under another
    thread's BLAS call loses that call's job and hangs it. Tried again at later first
    runs until done, or until it cannot apply (no OpenBLAS, a timeout you set, or one set
    as numpy loaded). While other threads live, a first run pays one thread count (~0.5 us)."""
    global _blas_pool_settled
    if _blas_pool_settled or threading.active_count() > 1 + len(_workers):
        return
    ours = {threading.get_native_id()} | {w.native_id for w in _workers}
    if any(t.native_id not in ours for t in threading.enumerate()):
        return
    _blas_pool_settled = True
    found = _openblas_pool_functions()
    if found is not None and found[1]() == 0 and _calm_blas_restarts():
        found[2]()  # blas_thread_shutdown_


def process_workers() -> bool:
    """Whether splits run their parts in worker processes (PMX_WORKERS=processes or
    set_workers("processes"), with pthread spinlocks available)."""
    return PROCESS_WORKERS and _spin() is not None


WORKER_KINDS = ("threads", "processes")


def set_workers(kind: str) -> None:
    """"threads" or "processes": what runs the parts of the splits of bindings made from
    now on, process-wide like the thread count (InferenceSession(..., workers=kind) calls
    it). "processes" where fork or pthread spinlocks are missing (not Linux) stays
    threads. Bindings already made keep their kind."""
    global PROCESS_WORKERS
    if kind not in WORKER_KINDS:
        raise ValueError(f"workers must be one of {', '.join(WORKER_KINDS)}, got {kind!r}")
    PROCESS_WORKERS = kind == "processes" and _CAN_FORK_WORKERS
    if PROCESS_WORKERS:
        _stop_at_exit()


@functools.cache
def _stop_at_exit():
    import atexit
    atexit.register(_stop_process_workers)


class _SharedArena:
    """Bump allocation of arrays in anonymous MAP_SHARED memory (chunks of _SHARED_CHUNK
    bytes or more), which worker processes forked later see and write. A chunk is
    unmapped when the last array in it is gone."""

    def __init__(self, np, allocate):
        self._np, self._allocate = np, allocate
        self._chunk, self._used = None, 0

    def empty(self, shape, dtype=float, order="C"):
        np = self._np
        dtype = np.dtype(dtype)
        shape = tuple(shape) if np.iterable(shape) else (int(shape),)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0 or order not in ("C", "K", "A"):
            return self._allocate(shape, dtype, order)
        if self._chunk is None or self._used + nbytes > len(self._chunk):
            import mmap
            self._chunk, self._used = mmap.mmap(-1, max(_SHARED_CHUNK, nbytes + 64), flags=mmap.MAP_SHARED), 0
        start = self._used
        self._used += -(-nbytes // 64) * 64
        return np.frombuffer(self._chunk, np.uint8, nbytes, start).view(dtype).reshape(shape)


_shared_lock = threading.Lock()
_shared_scope = threading.local()  # .active: this thread is inside shared_memory()


@contextlib.contextmanager
def shared_memory():
    """While a session binds its kernels with worker processes on: np.empty, np.zeros,
    np.ones, np.full and np.empty_like called from this thread return arrays in shared
    memory (every buffer a kernel allocates, whichever process writes it at run time),
    and only splits made here send parts to worker processes (a kernel bound anywhere
    else, as tests and `pmx compile --tune` bind them, keeps worker threads). numpy's
    functions are swapped for the duration under a lock; calls from other threads
    meanwhile get numpy's own. Without worker processes, nothing changes."""
    if not process_workers():
        yield
        return
    import numpy as np
    names = ("empty", "zeros", "ones", "full", "empty_like")
    with _shared_lock:
        saved = {name: getattr(np, name) for name in names}
        arena = _SharedArena(np, saved["empty"])
        me = threading.get_ident()

        def mine(fn, real):
            return lambda *a, **k: fn(*a, **k) if threading.get_ident() == me else real(*a, **k)

        def empty(shape, dtype=float, order="C", **_):
            return arena.empty(shape, dtype, order)

        def full(shape, fill_value, dtype=None, order="C", **_):
            a = arena.empty(shape, np.asarray(fill_value).dtype if dtype is None else dtype, order)
            np.copyto(a, fill_value, casting="unsafe")
            return a

        def zeros(shape, dtype=float, order="C", **_):
            return full(shape, 0, float if dtype is None else dtype, order)

        def ones(shape, dtype=None, order="C", **_):
            return full(shape, 1, float if dtype is None else dtype, order)

        def empty_like(prototype, dtype=None, order="K", subok=True, shape=None, **_):
            return arena.empty(prototype.shape if shape is None else shape, prototype.dtype if dtype is None else dtype)

        ours = dict(empty=empty, zeros=zeros, ones=ones, full=full, empty_like=empty_like)
        for name in names:
            setattr(np, name, mine(ours[name], saved[name]))
        _shared_scope.active = True
        try:
            yield
        finally:
            _shared_scope.active = False
            for name, fn in saved.items():
                setattr(np, name, fn)



def _binding_for_processes():
    """Whether splits made now send parts to worker processes: the mode is on and this
    thread is binding inside shared_memory()."""
    return getattr(_shared_scope, "active", False) and process_workers()


def _register_parts(parts, owner):
    """Ids under which a worker process finds `parts`; forgotten when `owner` (the split's
    callable) is collected."""
    import weakref
    global _next_part_id
    with _lock:
        ids = list(range(_next_part_id, _next_part_id + len(parts)))
        _next_part_id += len(parts)
        _parts_registry.update(zip(ids, parts))
    weakref.finalize(owner, _forget_parts, ids, os.getpid())
    return ids


def _forget_parts(ids, owner_pid):
    # Only in the process that made them: in a forked worker, Python drops the other
    # threads' thread-local data (sessions keep bindings per thread), which collects
    # their splits there while the caller still sends their parts.
    # No lock: a finalizer may run inside code holding _lock; dict.pop is atomic.
    if os.getpid() == owner_pid:
        for i in ids:
            _parts_registry.pop(i, None)


class _ProcessWorker:
    """A forked process running registered parts by id, with _Worker's interface (start,
    wait, park, unpark, lock, awake) over a control block in shared memory: spinlocks
    "go", "done" and "state" (process-shared), the part id, whether a run is inside,
    whether the worker sleeps, an error message. The worker spins for "go"; with no run
    inside it sleeps on a pipe after PROCESS_LINGER_SECONDS, and "state" orders its
    going to sleep against the caller's posting "go", so a post is never missed.
    A part whose worker died runs on the caller instead (parts only write their own
    outputs, so running one again is safe) and the next part forks a new worker."""

    _ERROR_AT, _ERROR_BYTES = 256, 2048

    def __init__(self):
        import mmap
        self._ctl = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._ctl))
        self._go, self._done, self._state = base, base + 64, base + 128
        self._cmd, self._failed, self._sleeping, self._inside = (ctypes.c_int64.from_buffer(self._ctl, at)
                                                                 for at in (192, 200, 208, 216))
        lock, unlock, init = _spin()
        for address in (self._go, self._done, self._state):
            init(address, 1)  # PTHREAD_PROCESS_SHARED
        lock(self._go)
        lock(self._done)
        self._lock_fn, self._unlock_fn = lock, unlock
        self._trylock = _libc_functions("pthread_spin_trylock")[0]
        self._trylock.argtypes, self._trylock.restype = [ctypes.c_void_p], ctypes.c_int
        self.pid = self._wake = None
        self.forked_below = 0
        self._part = None
        self.awake = False
        self.lock = threading.Lock()  # one caller at a time
        self.cpu = self.native_id = None

    # --- the caller's side

    def start(self, part_id):
        self.lock.acquire()
        if self.pid is None or part_id >= self.forked_below:
            self._fork()
        self._part = part_id
        self._cmd.value, self._failed.value = part_id, 0
        self._post_go()

    def wait(self):
        try:
            done, interrupted = self._wait_done_through_interrupts()
            if interrupted is not None:
                raise interrupted
            if not done:
                self._forget_dead()
                try:
                    _parts_registry[self._part]()
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    return e
            elif self._failed.value:
                at = self._ERROR_AT
                return RuntimeError(self._ctl[at:at + self._ERROR_BYTES].split(b"\0", 1)[0].decode("utf-8", "replace"))
            return None
        finally:
            self._part = None
            self.lock.release()

    def _wait_done_through_interrupts(self):
        """(whether the worker posted "done", the first interruption meanwhile or None): a
        Ctrl-C does not end the wait, since the worker still runs the part and nothing may
        be posted to it before it is done."""
        interrupted = None
        while True:
            try:
                return self._wait_done(), interrupted
            except BaseException as e:  # noqa: BLE001 - the caller raises it after
                interrupted = interrupted or e

    def unpark(self):
        """(caller holds self.lock) A run is inside: spin for parts however long apart."""
        self._inside.value = 1
        self.awake = True

    def park(self):
        """(caller holds self.lock) No run inside: sleep after PROCESS_LINGER_SECONDS."""
        self._inside.value = 0
        self.awake = False

    def stop(self):
        """(caller holds self.lock, or the process is exiting) End the worker process."""
        if self.pid is None:
            return
        self._cmd.value = _EXIT
        self._post_go()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self._forget_dead()

    def _post_go(self):
        sleeping = False
        if self._spin_for(self._state):  # False: the worker died (holding it); wait() finds out
            sleeping, self._sleeping.value = self._sleeping.value, 0
            self._unlock_fn(self._state)
        self._unlock_fn(self._go)
        if sleeping:
            try:
                os.write(self._wake, b"w")
            except OSError:  # the worker is gone: wait() finds out
                pass

    def _wait_done(self):
        """Whether the worker posted "done" (False: it died)."""
        return self._spin_for(self._done)

    def _spin_for(self, address):
        """Take the spinlock at `address`, spinning (the GIL released in each try) while
        the worker lives; False if it died first."""
        trylock = self._trylock
        spins = 0
        while trylock(address) != 0:
            spins += 1
            if spins % 4096 == 0 and not self._alive():
                return False
        return True

    def _alive(self):
        if self.pid is None:
            return False
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            # not waitable (SIGCHLD ignored: the kernel reaps children itself), but it may
            # still run: believe it gone only when no such process exists
            try:
                os.kill(self.pid, 0)
                return True
            except ProcessLookupError:
                return False
            except OSError:
                return True

    def _forget_dead(self):
        if self._wake is not None:
            os.close(self._wake)
        self.pid = self._wake = self.native_id = self.cpu = None
        # a dead worker may have left "go" posted (not taken), "done" posted or "state"
        # held: "go" and "done" back to held, "state" to free
        self._trylock(self._go)
        self._trylock(self._done)
        _spin()[2](self._state, 1)
        self._sleeping.value = 0

    def _fork(self):
        """(caller holds self.lock) Fork a worker that knows every part registered so far."""
        import warnings
        if self.pid is not None:
            self.stop()
        _calm_blas_restarts()
        wake_r, wake_w = os.pipe()
        self._inside.value = 1 if self.awake else 0
        with _lock:
            known = _next_part_id
        caller = os.getpid()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: forking with threads alive
            pid = os.fork()
        if pid == 0:
            os.close(wake_w)
            self._serve(wake_r, caller)  # never returns
        os.close(wake_r)
        self.pid, self._wake, self.forked_below = pid, wake_w, known
        self.native_id, self.cpu = pid, None
        if _runs_inside:
            with _lock:
                _place_workers([self])  # off the caller's core, as running() places workers

    # --- the worker's side

    def _serve(self, wake_r, parent):
        try:
            import signal
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
            # the caller's files and sockets stay the caller's: a copy held here would keep
            # a connection it closes open
            os.closerange(3, wake_r)
            os.closerange(wake_r + 1, max(wake_r + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024))
            # The worker ends when the caller's process does: its pipe reads end of file
            # when it sleeps, and it checks its parent while it spins (_await_go). Not
            # PR_SET_PDEATHSIG, which fires when the forking *thread* ends: a session run
            # from a short-lived thread would lose its worker with that thread.
            import numpy as np
            np.seterr(all="ignore")
            while True:
                self._await_go(wake_r, parent)
                cmd = self._cmd.value
                if cmd == _EXIT:
                    os._exit(0)
                try:
                    _parts_registry[cmd]()
                except BaseException as e:  # noqa: BLE001 - reported to the caller
                    message = f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:self._ERROR_BYTES - 1]
                    self._ctl[self._ERROR_AT:self._ERROR_AT + len(message) + 1] = message + b"\0"
                    self._failed.value = 1
                self._unlock_fn(self._done)
        finally:
            os._exit(0)

    def _await_go(self, wake_r, parent):
        """Spin until "go" is posted; while no run is inside, sleep on the pipe after
        PROCESS_LINGER_SECONDS without one (under "state", so the caller either sees
        the worker asleep and writes the pipe, or the worker sees "go"). Exit once the
        parent is gone (checked every 64K spins, a few ms)."""
        trylock, unlock = self._trylock, self._unlock_fn
        go, state = self._go, self._state
        idle_since = None
        spins = 0
        while trylock(go) != 0:
            spins += 1
            if spins % 256:
                continue
            if spins % 65536 == 0 and os.getppid() != parent:
                os._exit(0)
            if self._inside.value:
                idle_since = None
                continue
            now = time.monotonic()
            if idle_since is None:
                idle_since = now
            elif now - idle_since > PROCESS_LINGER_SECONDS:
                while trylock(state) != 0:  # held for a moment by the caller's _post_go
                    if os.getppid() != parent:  # ... which died holding it
                        os._exit(0)
                if trylock(go) == 0:
                    unlock(state)
                    return
                self._sleeping.value = 1
                unlock(state)
                if not os.read(wake_r, 1):
                    os._exit(0)
                idle_since = None


_process_workers: list = []


def _get_process_workers(n):
    with _lock:
        while len(_process_workers) < n:
            _process_workers.append(_ProcessWorker())
        return _process_workers[:n]


def _stop_process_workers():
    for w in list(_process_workers):
        with w.lock:
            w.stop()


if PROCESS_WORKERS:
    _stop_at_exit()
