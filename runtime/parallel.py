"""Threads: how many the runtime uses, for BLAS, numexpr and its own kernel splits.

numpy's ufuncs and copies release the GIL, so a kernel that is a sequence of ufunc calls
(depthwise convolution, im2col copies, big elementwise passes) can run its halves on two
cores at once (kernels/common.gemm splits GEMMs the same way). `split(parts)` turns a
list of callables, each covering a disjoint slice of the work, into one callable that
runs part 0 on the calling thread and the others on persistent worker threads. A dispatch costs about 35 us here (thread wake-up and GIL
hand-off), so kernels split only work measured to take well over that
(`worth_splitting`).

The thread count is process-wide, as BLAS's and numexpr's are: set_num_threads(n) sets
all three, BLAS's when the next run starts (InferenceSession(..., num_threads=n) calls it). The default is the number of
cores this process may run on. BLAS is found among the libraries loaded in this process
(numpy's bundled OpenBLAS, or MKL) and driven through its own C entry point; when none
is found, BLAS keeps its own default and `blas_threads_controlled()` says False.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
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
_workers_lock = threading.Lock()


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
    import sys

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
def _blas():
    """(setter, getter or None) of the first loaded BLAS with a known entry point, or
    (None, None). Looked up once: numpy loads its BLAS when it is imported."""
    for path in _loaded_libraries():
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


_runs_inside = 0  # runs (on any thread) currently holding BLAS at one thread
_runs_lock = threading.Lock()


@contextlib.contextmanager
def blas_single_threaded():
    """BLAS on one thread while any model runs, the configured count again when the last
    concurrent run ends (counted, so one thread finishing never hands BLAS threads back
    in the middle of another's GEMMs: results stay bit-identical across threads).
    pmx splits its GEMMs itself (kernels/common.gemm) and runs non-BLAS steps on its own workers;
    OpenBLAS's idle threads spin for a while after each call, and a spinning BLAS thread
    on the core a pmx worker needs doubled the time of the step after a GEMM (measured
    on MobileNetV2's depthwise layers)."""
    global _runs_inside
    with _runs_lock:
        if _runs_inside == 0:
            _apply_blas_threads()
        setter = _blas()[0] if _num_threads > 1 else None
        if setter is not None:
            if _runs_inside == 0:
                setter(1)
            _runs_inside += 1
    if setter is None:
        yield
        return
    try:
        yield
    finally:
        with _runs_lock:
            _runs_inside -= 1
            if _runs_inside == 0:
                setter(_num_threads)


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


class _Worker:
    """A daemon thread running one callable per start()/wait() pair."""

    def __init__(self):
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._fn = None
        self._error = None
        self._lock = threading.Lock()  # one caller at a time (sessions run on many threads)
        threading.Thread(target=self._loop, daemon=True, name="pmx-worker").start()

    def _loop(self):
        while True:
            self._go.acquire()
            try:
                self._fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._error = e
            self._done.release()

    def start(self, fn):
        self._lock.acquire()
        self._fn, self._error = fn, None
        self._go.release()

    def wait(self):
        self._done.acquire()
        error, self._fn, self._error = self._error, None, None
        self._lock.release()
        return error


def _get_workers(n):
    with _workers_lock:
        while len(_workers) < n:
            _workers.append(_Worker())
        return _workers[:n]
