"""Threads: how many the runtime uses, for BLAS, numexpr and its own kernel splits.

numpy's ufuncs and copies release the GIL, so a kernel that is a sequence of ufunc calls
(depthwise convolution, im2col copies, big elementwise passes) can run its halves on two
cores at once (kernels/common.gemm splits GEMMs the same way). `split(parts)` turns a
list of callables, each covering a disjoint slice of the work, into one callable that
runs part 0 on the calling thread and the others on persistent worker threads, which
spin for parts while runs are inside (`running()`; see the workers section). A dispatch
then costs about 5-40 us here (GIL hand-off), so kernels split only work measured to
take well over that (`worth_splitting`).

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
import os
import sys
import threading

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


def _set_numexpr_threads(n):
    """numexpr's thread count, if a model has imported numexpr."""
    numexpr = sys.modules.get("numexpr")
    if numexpr is not None:
        numexpr.set_num_threads(n)


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
def _blas():
    """(setter, getter or None) of the first loaded BLAS with a known entry point, or
    (None, None). Looked up once."""
    for path in blas_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
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
    return _num_threads > 1 and elements >= SPLIT_MIN_ELEMENTS


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
    workers = _get_workers(len(rest))

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
    _apply_blas_threads()
    setter = _blas()[0]
    if setter is not None and _num_threads > 1:
        setter(1)
    _set_numexpr_threads(1)
    if not (_spin() and _num_threads > 1):
        return []
    _place_workers(_workers)
    return list(_workers)


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
    return list(_workers)


def _forget_workers():
    """In a forked child the workers' threads do not exist: start afresh."""
    global _workers, _runs_inside
    _workers, _runs_inside = [], 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _get_workers(n):
    with _lock:
        while len(_workers) < n:
            _workers.append(_Worker())
        return _workers[:n]
