"""Threads: how many the runtime uses, for BLAS, numexpr and its own kernel splits.

numpy's ufuncs and copies release the GIL, so a kernel that is a sequence of ufunc calls
(depthwise convolution, im2col copies, big elementwise passes) can run its halves on two
cores at once. `split(parts)` turns a list of callables, each covering a disjoint slice
of the work, into one callable that runs part 0 on the calling thread and the others on
persistent worker threads. A dispatch costs about 35 us here (thread wake-up and GIL
hand-off), so kernels split only work measured to take well over that
(`worth_splitting`).

The thread count is process-wide, as BLAS's and numexpr's are: set_num_threads(n) sets
all three (InferenceSession(..., num_threads=n) calls it). The default is the number of
cores this process may run on. BLAS is found among the libraries loaded in this process
(numpy's bundled OpenBLAS, or MKL) and driven through its own C entry point; when none
is found, BLAS keeps its own default and `blas_threads_controlled()` says False.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import numpy as np

# below this many elements touched, a split's dispatch costs more than the second core saves
SPLIT_MIN_ELEMENTS = 1 << 16
# GEMMs: split only products of at least this many multiply-adds (~0.15 ms on one core)
GEMM_SPLIT_MIN_MACS = 1 << 22
GEMM_SPLIT_MIN_COLUMNS = 512
GEMM_SPLIT_MIN_ROWS = 64

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
    """Threads for BLAS, numexpr (if loaded later, it picks this up) and kernel splits."""
    global _num_threads
    n = int(n)
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    _num_threads = n
    _set_blas_threads(n)
    import sys

    numexpr = sys.modules.get("numexpr")
    if numexpr is not None:
        numexpr.set_num_threads(n)


def configure_numexpr(numexpr) -> None:
    """Called by runtime/expr.py when it first imports numexpr."""
    numexpr.set_num_threads(_num_threads)


# --- BLAS ----------------------------------------------------------------------------

_blas_setter = None
_blas_getter = None
_blas_searched = False


def _loaded_libraries():
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if any(h in os.path.basename(p).lower() for h in _BLAS_LIB_HINTS))


def _find_blas_setter():
    global _blas_setter, _blas_getter, _blas_searched
    if _blas_searched:
        return _blas_setter
    _blas_searched = True
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
                _blas_setter, _blas_getter = setter, getter
                return setter
    return None


def blas_threads():
    """BLAS's current thread count, or None when pmx found no BLAS it can drive."""
    _find_blas_setter()
    return _blas_getter() if _blas_getter is not None else None


def _set_blas_threads(n):
    setter = _find_blas_setter()
    if setter is not None:
        setter(n)


def blas_threads_controlled() -> bool:
    return _find_blas_setter() is not None


_runs_inside = 0  # runs (on any thread) currently holding BLAS at one thread
_runs_lock = threading.Lock()


@contextlib.contextmanager
def blas_single_threaded():
    """BLAS on one thread while any model runs, the configured count again when the last
    concurrent run ends (counted, so one thread finishing never hands BLAS threads back
    in the middle of another's GEMMs: results stay bit-identical across threads).
    pmx splits its GEMMs itself (`matmul`) and runs non-BLAS steps on its own workers;
    OpenBLAS's idle threads spin for a while after each call, and a spinning BLAS thread
    on the core a pmx worker needs doubled the time of the step after a GEMM (measured
    on MobileNetV2's depthwise layers)."""
    global _runs_inside
    setter = _find_blas_setter() if _num_threads > 1 else None
    if setter is None:
        yield
        return
    with _runs_lock:
        if _runs_inside == 0:
            setter(1)
        _runs_inside += 1
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


def matmul(a, b, out, threads=None, post=None):
    """Callable computing np.matmul(a, b, out=out), split over the threads when the
    product is big enough: along out's first batch axis longer than 1, else its columns
    (each thread reads half of b: a linear layer's weights, a conv's im2col columns),
    else its rows. BLAS itself runs single-threaded inside run() (see
    `blas_single_threaded`), so this is where GEMMs get the other cores.
    `post(part, index)` may return a callable to run on each part of out right after its
    product (bias, activation: while the part is in cache); index is the part's index
    into out (`part_of` applies it to an operand that broadcasts against out). Measured on
    this 2-core machine with BLAS on one thread (idle machine): a two-way split takes
    0.50-0.65x the time of one thread from ~4M multiply-adds up (e.g. 512x4608 @ 4608x49:
    3.24 -> 1.63 ms; 960x160 @ 160x49: 0.19 -> 0.12 ms) and loses below (a GEMV of 1.3M:
    0.08 -> 0.14)."""
    threads = threads or _num_threads
    post = post or (lambda part, index: None)
    plan = _gemm_split(a, b, out, threads)
    if plan is None:
        return _then(lambda: np.matmul(a, b, out=out), post(out, (Ellipsis,)))
    axes, length = plan
    parts = []
    for lo, hi in ranges(length, threads):
        pa, pb, po = (_along(x, axis, lo, hi) for x, axis in zip((a, b, out), axes))
        index = (Ellipsis, slice(lo, hi)) + (slice(None),) * (-axes[2] - 1)
        parts.append(_then(lambda pa=pa, pb=pb, po=po: np.matmul(pa, pb, out=po), post(po, index)))
    return split(parts)


def _gemm_split(a, b, out, threads):
    """((axis of a, of b, of out), length) to split along, axes counted from the end where
    numpy aligns batch dims (None: that operand is whole in every part); None when the
    product is too small to pay for the dispatch or has a vector operand."""
    macs = int(np.prod(out.shape, dtype=np.int64)) * a.shape[-1]
    if threads < 2 or macs < GEMM_SPLIT_MIN_MACS or min(a.ndim, b.ndim) < 2:
        return None
    for i, d in enumerate(out.shape[:-2]):
        if d > 1:
            axis = i - out.ndim
            return (axis, axis, axis), d
    if out.shape[-1] >= GEMM_SPLIT_MIN_COLUMNS:
        return (None, -1, -1), out.shape[-1]
    if out.shape[-2] >= GEMM_SPLIT_MIN_ROWS:
        return (-2, None, -2), out.shape[-2]
    return None


def _along(x, axis, lo, hi):
    """x restricted to lo:hi along `axis` (counted from the end); whole when axis is None
    or x broadcasts along it."""
    if axis is None or -axis > x.ndim or x.shape[axis] == 1:
        return x
    return x[(Ellipsis, slice(lo, hi)) + (slice(None),) * (-axis - 1)]


def part_of(x, index):
    """`x` (broadcasting against a GEMM's out) cut to the part `index` (from matmul's
    post) selects: axes where x has size 1, or that x lacks, stay whole."""
    if len(index) == 1:
        return x
    axis = -len(index) + 1  # index = (Ellipsis, slice at axis, then whole axes)
    return _along(x, axis, index[1].start, index[1].stop)


def _then(first, second):
    if second is None:
        return first
    return lambda: (first(), second())


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
