"""The BLAS that pmx calls: a copy of OpenBLAS of its own, held at one thread.

numpy's OpenBLAS shares each GEMM out to a pool of threads that busy-wait for work: on a
host whose other cores are busy, every GEMM then waits for a descheduled thread
(ResNet-18's runs became many times slower under load; docs/performance.md, "Kernel
measurements"). pmx may not set numpy's BLAS to one thread, since the host's own numpy
would change under it. So pmx loads the OpenBLAS of the `scipy-openblas32` wheel (a
dependency where that wheel ships), a library separate from numpy's, with its own
symbols (scipy_cblas_sgemm), loads it so that it starts no thread pool of its own, sets
it to one thread, and splits GEMMs over each InferenceSession's own threads
(kernels/common.gemm), which sleep while they wait.

Where that wheel is missing, or something else in the process had already loaded the
same file (its thread count is then not pmx's to set), pmx calls numpy's BLAS, found
among the loaded libraries, and only reads its thread count: when it is one, GEMMs split
over the InferenceSession's threads; otherwise BLAS's own threads share them out.

`matmul(a, b, out)` is what kernels call for every float32/float64 product: one cblas
call (`?gemm`, or `?gemm_batch_strided` for a batch), through contiguous copies when an
operand's strides are not BLAS's, and np.matmul only for dtypes BLAS has no routine for.
ctypes releases the GIL for the call, so split parts run concurrently.

`gemm(..., accumulate=True)` computes out += a @ b (beta = 1): a conv or linear layer
fills out with its bias (one broadcast copy, as cheap as the zeroing np.matmul makes
OpenBLAS do) and the GEMM adds the product onto it. `transposed_copy` calls OpenBLAS's
?omatcopy, a blocked out-of-place transpose, measured faster than numpy's strided copy
on the NCHW <-> NHWC permutes of channels-last blocks (docs/performance.md, "Kernel
measurements").
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os
import threading

import numpy as np

from pmx.runtime.record import FrozenRecord

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112

# set False to keep numpy everywhere (A/B measurements, debugging)
ENABLED = True

PRIVATE_PACKAGE = "scipy_openblas32"

# names a loaded BLAS library's file may have (the fallback's search)
_BLAS_LIB_HINTS = ("openblas", "mkl_rt", "libblis")
_THREAD_GETTERS = (
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
    "openblas_get_num_threads64_",
    "openblas_get_num_threads",
    "MKL_Get_Max_Threads",
    "bli_thread_get_num_threads",
)


class Library(FrozenRecord):
    """A loaded BLAS: its ctypes handle, file, symbol spellings with their integer type,
    and whether it is pmx's own (loaded and held at one thread by pmx)."""

    __slots__ = ("handle", "path", "spellings", "private")

    def __init__(self, handle, path, spellings, private):
        for name, value in zip(self.__slots__, (handle, path, spellings, private)):
            object.__setattr__(self, name, value)

    def entry_point(self, routine):
        """(the cblas function, its integer type), or None when the library lacks it."""
        for spelling, integer in self.spellings:
            fn = getattr(self.handle, spelling.format(routine), None)
            if fn is not None:
                fn.restype = None
                return fn, integer
        return None

    def threads(self):
        """The library's current thread count, or None when it has no known getter."""
        getter = _thread_getter(self.handle)
        return getter() if getter is not None else None


@functools.cache
def _thread_getter(handle):
    """The library's thread-count getter, looked up once: run() reads the count on every
    call, and each symbol a library lacks costs a failed dlsym."""
    for name in _THREAD_GETTERS:
        getter = getattr(handle, name, None)
        if getter is not None:
            getter.argtypes, getter.restype = [], ctypes.c_int
            return getter
    return None


_PRIVATE_SPELLINGS = (("scipy_cblas_{}", ctypes.c_int),)
# numpy's wheels ship ILP64 OpenBLAS (scipy_cblas_sgemm64_); other builds, LP64
_SHARED_SPELLINGS = (
    ("scipy_cblas_{}64_", ctypes.c_int64),
    ("cblas_{}64_", ctypes.c_int64),
    ("scipy_cblas_{}", ctypes.c_int),
    ("cblas_{}", ctypes.c_int),
)


@functools.cache
def library() -> Library | None:
    """The BLAS pmx calls: its own (private_library) where it can be had, else numpy's."""
    return private_library() or shared_library()


@functools.cache
def private_library() -> Library | None:
    """The scipy-openblas32 wheel's OpenBLAS, loaded by pmx and set to one thread; None
    when the wheel is not installed, cannot be loaded, or was already loaded by
    something else in the process (then its thread count is not pmx's to set)."""
    path = _private_library_path()
    if path is None or _is_mapped(path):
        return None
    handle = _load_seeing_one_cpu(path)
    if handle is None:
        return None
    setter = getattr(handle, "scipy_openblas_set_num_threads", None)
    if setter is None:
        return None
    setter.argtypes, setter.restype = [ctypes.c_int], None
    setter(1)
    return Library(handle, path, _PRIVATE_SPELLINGS, private=True)


def _load_seeing_one_cpu(path):
    """dlopen `path` (RTLD_LOCAL: its symbols stay out of the global namespace) from a
    thread of pmx's own that may run on one CPU only, then let that thread end.

    OpenBLAS starts its thread pool inside dlopen, one thread per CPU its loading thread
    may run on, and each new thread busy-waits for work for about 0.1 s before it sleeps.
    pmx sets the library to one thread right after, so that pool never gets work, but on
    a small host its spinning took a core from the first run (docs/performance.md, "The
    first run and OpenBLAS's spinning threads"). Loaded from a thread confined to one
    CPU, OpenBLAS counts one CPU and starts no pool. The confinement is the loading
    thread's own: no thread of the host's or of a session is touched, and the thread is
    gone when this returns. Where a thread's CPUs cannot be set, a plain dlopen."""
    loaded = {}
    cpu = _current_cpu()  # free while this thread waits in join: the loader starts at once

    def load():
        try:
            allowed = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {cpu if cpu in allowed else min(allowed)})
        except (AttributeError, OSError, ValueError):
            pass  # not on this platform: the library starts its pool, as on a plain load
        try:
            loaded["handle"] = ctypes.CDLL(path)
        except OSError:
            loaded["handle"] = None

    loader = threading.Thread(target=load, name="pmx-blas-loader", daemon=True)
    loader.start()
    loader.join()
    return loaded.get("handle")


def _current_cpu():
    """The CPU the calling thread runs on (/proc/thread-self/stat, field 39), or None."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[36])
    except (OSError, IndexError, ValueError):
        return None


def _private_library_path():
    """The shared library file inside the scipy-openblas32 wheel, found without importing
    the package (its import reads package metadata: milliseconds)."""
    try:
        spec = importlib.util.find_spec(PRIVATE_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = os.path.join(next(iter(spec.submodule_search_locations)), "lib")
    try:
        names = os.listdir(lib_dir)
    except OSError:
        return None
    found = sorted(
        n for n in names if n.startswith("libscipy_openblas") and (".so" in n or n.endswith((".dylib", ".dll")))
    )
    return os.path.join(lib_dir, found[0]) if found else None


@functools.cache
def shared_library() -> Library | None:
    """The first BLAS among the libraries already loaded (numpy's), or None."""
    candidates = {p for p in _mapped_files() if any(h in os.path.basename(p).lower() for h in _BLAS_LIB_HINTS)}
    for path in sorted({os.path.realpath(p) for p in candidates}):
        try:
            handle = ctypes.CDLL(path)
        except OSError:
            continue
        lib = Library(handle, path, _SHARED_SPELLINGS, private=False)
        if lib.entry_point("sgemm") is not None:
            return lib
    return None


def _mapped_files():
    """Paths of the files mapped into this process, as the kernel names them (empty where
    /proc is missing). Callers resolve only the ones they look at: resolving all of them
    (a few hundred lstat calls) cost a first run milliseconds."""
    try:
        with open("/proc/self/maps", "rb") as f:
            text = f.read().decode(errors="surrogateescape")
    except OSError:
        return set()
    fields = (line.split(None, 5) for line in text.splitlines())
    return {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")}


def _is_mapped(path):
    """Whether the file at `path` is mapped into this process (under any name of it)."""
    real = os.path.realpath(path)
    names = {os.path.basename(path), os.path.basename(real)}
    return any(os.path.realpath(p) == real for p in _mapped_files() if os.path.basename(p) in names)


def threads():
    """The thread count of the BLAS pmx calls, or None when there is none (or unknown)."""
    lib = library()
    return lib.threads() if lib is not None else None


@functools.cache
def _entry_point(routine):
    lib = library()
    return lib.entry_point(routine) if lib is not None else None


# --- products ----------------------------------------------------------------------------

# (gemm routine, batched routine, C type of alpha and beta) per item type
_GEMM = {
    np.dtype(np.float32): ("sgemm", "sgemm_batch_strided", ctypes.c_float),
    np.dtype(np.float64): ("dgemm", "dgemm_batch_strided", ctypes.c_double),
}
# at most this many cblas calls for a batch whose strides do not collapse to one
_MAX_CALLS = 256


def matmul(a, b, out):
    """Callable computing np.matmul(a, b, out=out) (out of the broadcast shape, not
    overlapping a or b): through pmx's BLAS for float32 and float64 (gemm), through
    contiguous copies of the operands BLAS cannot read as they lie, np.matmul for
    other dtypes or without a BLAS."""
    a2, b2, out2 = _as_matrices(a, b, out)
    if _few_tap_vectors(a2, b2, out2):
        return lambda: np.matmul(a, b, out=out)
    fn = gemm(a2, b2, out2)
    if fn is not None:
        return fn
    if not ENABLED or _entry_point(_GEMM.get(out.dtype, ("",))[0]) is None or not _same_float(a, b, out):
        return lambda: np.matmul(a, b, out=out)
    return _through_copies(a2, b2, out2)


# a batch of vector products this short inside (a depthwise conv's taps) runs on numpy
FEW_TAPS = 64


def _few_tap_vectors(a, b, out):
    """Whether the product is a batch of row-by-matrix or matrix-by-column products over
    at most FEW_TAPS terms (a depthwise conv's (C, 1, taps) @ (C, taps, L)). numpy's
    matmul runs them in its own loop, one single-threaded ?gemv each; from Python every
    cblas call costs more, and ?gemm_batch_strided packs its operands: both measured
    slower than numpy's loop on MobileNets' depthwise shapes (docs/performance.md,
    "Kernel measurements"). numpy's BLAS threads take no part
    (tests/test_threads_host.py checks their CPU time)."""
    if out.dtype not in _GEMM or a.shape[-1] > FEW_TAPS or 1 not in out.shape[-2:]:
        return False
    return math.prod(out.shape[:-2]) > 1


def _as_matrices(a, b, out):
    """a, b, out with np.matmul's vector operands as views of one-row / one-column matrices."""
    if b.ndim == 1:
        b, out = b[:, None], np.expand_dims(out, -1)
    if a.ndim == 1:
        a, out = a[None, :], np.expand_dims(out, -2)
    return a, b, out


def _through_copies(a, b, out):
    """matmul for operands BLAS cannot read in place: each such one copied into a
    contiguous buffer (made once) before the product, out through one after it."""
    steps, stand_ins = [], []
    for x in (a, b, out):
        readable = (
            x.flags.aligned
            and x.dtype.isnative
            and _batch_layout(x) is not None
            and (_output_matrix(x) if x is out else _matrix(x)) is not None
        )
        if readable and (x is out or not np.may_share_memory(x, out)):
            stand_ins.append(x)
            continue
        buffer = np.empty(x.shape, x.dtype)
        if x is not out:
            steps.append(functools.partial(np.copyto, buffer, x))
        stand_ins.append(buffer)
    fn = gemm(*stand_ins)
    if fn is None:  # a shape BLAS cannot take (a dim beyond its integers)
        return lambda: np.matmul(a, b, out=out)
    steps.append(fn)
    if stand_ins[2] is not out:
        steps.append(functools.partial(np.copyto, out, stand_ins[2]))
    steps = tuple(steps)

    def run():
        for step in steps:
            step()

    return run


def _same_float(*arrays):
    return all(x.dtype == arrays[0].dtype and x.dtype in _GEMM and x.ndim >= 1 for x in arrays)


def gemm(a, b, out, accumulate=False):
    """Callable computing out = a @ b (out += a @ b with `accumulate`) in cblas calls, for
    float32 or float64 operands of 2 dims or more (batch dims broadcast as np.matmul's),
    or None when BLAS cannot: no BLAS, another dtype, a stride BLAS cannot take, out
    overlapping an operand, or sizes beyond BLAS's integers."""
    routines = _GEMM.get(getattr(out, "dtype", None))
    if not ENABLED or routines is None or not _same_float(a, b, out) or min(a.ndim, b.ndim, out.ndim) < 2:
        return None
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = out.shape[:-2]
    if (
        b.shape[-2] != k
        or out.shape[-2:] != (m, n)
        or np.broadcast_shapes(a.shape[:-2], b.shape[:-2], batch) != batch
        or not all(x.flags.aligned and x.dtype.isnative for x in (a, b, out))
    ):
        return None
    if out.size == 0:
        return lambda: None
    if k == 0:
        return (lambda: None) if accumulate else (lambda: out.fill(0))
    if np.may_share_memory(out, a) or np.may_share_memory(out, b):
        return None
    found = _entry_point(routines[0])
    layout = _batch_layout(a, b, out)
    ops = [_matrix(x) for x in (a, b)] + [_output_matrix(out)]
    if found is None or layout is None or None in ops:
        return None
    fn, integer = found
    if max(m, n, k, *(ld for _, ld in ops), *_strides_in(layout)) > _integer_max(integer):
        return None
    scalar = routines[2]
    beta = scalar(1.0 if accumulate else 0.0)
    if m == 1 or n == 1:
        return _vector_products(a, b, out, ops, layout, routines, beta)
    head = (_ROW_MAJOR, ops[0][0], ops[1][0], integer(m), integer(n), integer(k), scalar(1.0))
    pointers = [x.ctypes.data for x in (a, b, out)]
    outer, (count, strides) = layout
    if count > 1:
        # numpy's OpenBLAS 0.3.31 crashed in ?gemm_batch_strided on small products: pmx's own only
        batched = _entry_point(routines[1]) if library().private else None
        if batched is not None and batched[1] is integer and len(outer) <= _MAX_CALLS:
            pa, pb, pc = pointers
            calls = [
                functools.partial(
                    batched[0],
                    *head,
                    ctypes.c_void_p(pa + oa),
                    integer(ops[0][1]),
                    integer(strides[0]),
                    ctypes.c_void_p(pb + ob),
                    integer(ops[1][1]),
                    integer(strides[1]),
                    beta,
                    ctypes.c_void_p(pc + oc),
                    integer(ops[2][1]),
                    integer(strides[2]),
                    integer(count),
                )
                for oa, ob, oc in outer
            ]
            return _run_all(calls, (a, b, out))
        outer = _expanded(layout, out.itemsize)
    if len(outer) > _MAX_CALLS:
        return None
    calls = [
        functools.partial(
            fn,
            *head,
            ctypes.c_void_p(pointers[0] + oa),
            integer(ops[0][1]),
            ctypes.c_void_p(pointers[1] + ob),
            integer(ops[1][1]),
            beta,
            ctypes.c_void_p(pointers[2] + oc),
            integer(ops[2][1]),
        )
        for oa, ob, oc in outer
    ]
    return _run_all(calls, (a, b, out))


def _vector_products(a, b, out, ops, layout, routines, beta):
    """gemm for products of a row by a matrix or a matrix by a column: one cblas ?gemv
    call per product (OpenBLAS's ?gemm packs both operands first, which costs a vector
    product several times its time: docs/performance.md, "Kernel measurements"), or None
    past _MAX_CALLS products or a stride BLAS cannot take."""
    found = _entry_point(routines[0][0] + "gemv")
    if found is None:
        return None
    fn, integer = found
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    item = out.itemsize
    if n == 1:  # y (m) = a (m x k) @ x (k): the matrix is a
        (trans, ld), matrix, x, y = ops[0], a, b, out
        rows, cols = (m, k) if trans == _NO_TRANS else (k, m)
        x_step, y_step = b.strides[-2], out.strides[-2]
        offsets = _expanded(layout, item)
    else:  # y (n) = x (k) @ b (k x n) = b^T x: the matrix is b, read transposed
        (trans, ld), matrix, x, y = ops[1], b, a, out
        trans = _TRANS if trans == _NO_TRANS else _NO_TRANS
        rows, cols = (k, n) if trans == _TRANS else (n, k)
        x_step, y_step = a.strides[-1], out.strides[-1]
        offsets = [(ob, oa, oc) for oa, ob, oc in _expanded(layout, item)]
    incx = 1 if x.shape[-2 if n == 1 else -1] <= 1 else _elements(x_step, item)
    incy = 1 if out.shape[-2 if n == 1 else -1] <= 1 else _elements(y_step, item)
    if incx is None or incy is None or len(offsets) > _MAX_CALLS:
        return None
    if max(rows, cols, ld, incx, incy) > _integer_max(integer):
        return None
    pm, px, py = matrix.ctypes.data, x.ctypes.data, y.ctypes.data
    head = (_ROW_MAJOR, trans, integer(rows), integer(cols), routines[2](1.0))
    calls = [
        functools.partial(
            fn,
            *head,
            ctypes.c_void_p(pm + om),
            integer(ld),
            ctypes.c_void_p(px + ox),
            integer(incx),
            beta,
            ctypes.c_void_p(py + oy),
            integer(incy),
        )
        for om, ox, oy in offsets
    ]
    return _run_all(calls, (a, b, out))


def _expanded(layout, item):
    """A batch layout's byte offsets of every product, one (a, b, out) triple each."""
    outer, (count, strides) = layout
    return [
        (oa + i * strides[0] * item, ob + i * strides[1] * item, oc + i * strides[2] * item)
        for oa, ob, oc in outer
        for i in range(count)
    ]


def _run_all(calls, operands):
    """One callable making `calls` in order; it keeps `operands` (the arrays whose
    addresses the calls pass) alive."""
    if len(calls) == 1:
        run = calls[0]
    else:
        calls = tuple(calls)

        def run():
            for call in calls:
                call()

    run.operands = operands
    return run


def _integer_max(integer):
    return (1 << (8 * ctypes.sizeof(integer) - 1)) - 1


def _strides_in(layout):
    """Every element stride of a batch layout (to check against BLAS's integers)."""
    outer, (_, strides) = layout
    return [abs(s) for s in strides] + [abs(o) for offsets in outer for o in offsets]


def _matrix(x):
    """(transpose flag, leading dimension) under which BLAS reads the last two dims of x
    as they lie, else None. Along a dim of length 1 any stride will do."""
    rows, cols = x.shape[-2:]
    rs, cs = x.strides[-2:]
    item = x.itemsize
    if cols <= 1 or cs == item:
        ld = max(1, cols) if rows <= 1 else _elements(rs, item)
        if ld is not None and ld >= max(1, cols):
            return _NO_TRANS, ld
    if rows <= 1 or rs == item:
        ld = max(1, rows) if cols <= 1 else _elements(cs, item)
        if ld is not None and ld >= max(1, rows):
            return _TRANS, ld
    return None


def _output_matrix(out):
    """_matrix(out) when BLAS can write it: rows of unit stride, and no two batch
    entries on the same memory (a batch stride of 0)."""
    found = _matrix(out)
    if found is None or found[0] != _NO_TRANS:
        return None
    if any(s == 0 and d > 1 for s, d in zip(out.strides[:-2], out.shape[:-2])):
        return None
    return found


def _elements(stride, item):
    return stride // item if stride > 0 and stride % item == 0 else None


def _batch_layout(*arrays):
    """How the batch dims (all but the last two) of `arrays` map onto cblas calls: (outer,
    (count, strides)), where `outer` lists the element offsets of each call's first
    matrix in each array, and each call covers `count` matrices `strides` elements apart
    per array; None when a batch stride is negative or not a whole number of items.
    Dims an array broadcasts along step by 0; dims that line up in every array merge."""
    out = arrays[-1]
    batch = out.shape[:-2]
    per_dim = []
    for axis, size in enumerate(batch):
        if size == 1:
            continue
        strides = []
        for x in arrays:
            lead = x.ndim - 2 - len(batch) + axis
            stride = x.strides[lead] if lead >= 0 and x.shape[lead] != 1 else 0
            if stride < 0 or stride % x.itemsize:
                return None
            strides.append(stride // x.itemsize)
        per_dim.append((size, strides))
    merged = []
    for size, strides in per_dim:
        if merged and all(s_out == s_in * size for s_out, s_in in zip(merged[-1][1], strides)):
            merged[-1] = (merged[-1][0] * size, strides)
        else:
            merged.append((size, strides))
    if not merged:
        return [(0,) * len(arrays)], (1, [0] * len(arrays))
    *outer_dims, inner = merged
    outer = [(0,) * len(arrays)]
    for size, strides in outer_dims:
        outer = [tuple(o + i * s for o, s in zip(offsets, strides)) for offsets in outer for i in range(size)]
        if len(outer) > _MAX_CALLS * 16:
            return None
    item = [x.itemsize for x in arrays]
    return [tuple(o * i for o, i in zip(offsets, item)) for offsets in outer], inner


# --- transposes --------------------------------------------------------------------------

# the omatcopy routine and the C type of its alpha, per item type
_OMATCOPY = {np.dtype(np.float32): ("somatcopy", ctypes.c_float), np.dtype(np.float64): ("domatcopy", ctypes.c_double)}


def transposed_copy(src, dst):
    """Callable writing dst = src.T (cblas_?omatcopy, alpha = 1), or None when it cannot:
    no such entry point (only OpenBLAS has one), not both 2-D native float32 or float64
    with rows of unit stride, an empty matrix, or dst overlapping src. Values are copied
    exactly: multiplying by 1 changes no finite, infinite or subnormal value, and a NaN
    stays a NaN."""
    routine = _OMATCOPY.get(getattr(src, "dtype", None))
    if not ENABLED or routine is None or not isinstance(dst, np.ndarray) or dst.dtype != src.dtype:
        return None
    found = _entry_point(routine[0])
    if (
        found is None
        or src.ndim != 2
        or dst.shape != src.shape[::-1]
        or src.size == 0
        or not src.dtype.isnative
        or not (src.flags.aligned and dst.flags.aligned)
        or np.may_share_memory(src, dst)
    ):
        return None
    (trans_a, lda), (trans_b, ldb) = _matrix(src) or (None, 0), _matrix(dst) or (None, 0)
    if trans_a != _NO_TRANS or trans_b != _NO_TRANS:
        return None
    fn, integer = found
    rows, cols = src.shape
    if max(rows, cols, lda, ldb) > _integer_max(integer):
        return None
    run = functools.partial(
        fn,
        _ROW_MAJOR,
        _TRANS,
        integer(rows),
        integer(cols),
        routine[1](1.0),
        ctypes.c_void_p(src.ctypes.data),
        integer(lda),
        ctypes.c_void_p(dst.ctypes.data),
        integer(ldb),
    )
    run.operands = (src, dst)  # the arrays whose addresses it passes stay alive with it
    return run
