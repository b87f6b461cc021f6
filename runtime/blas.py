"""Direct calls to the BLAS numpy loaded, for what np.matmul cannot ask for.

np.matmul(a, b, out=c) calls sgemm with beta = 0, and OpenBLAS then zeroes c in a pass of
its own before accumulating into it; a conv or linear layer then adds its bias in another
pass. `sgemm_accumulate` calls cblas_sgemm with beta = 1 instead, so a layer fills c with
its bias (one broadcast copy, as cheap as the zeroing) and the GEMM adds the product:
two passes over c fewer. One thread, the shapes of 1x1 convs with bias, (ms, medians of
9x30 calls), matmul + add -> fill + sgemm(beta = 1): 96x16 @ 16x12544 0.94 -> 0.86,
144x24 @ 24x3136 0.46 -> 0.42, 32x144 @ 144x3136 0.44 -> 0.39, 192x32 @ 32x784 0.19
-> 0.17, 576x96 @ 96x196 0.30 -> 0.28.

The entry point is looked up by name among the loaded BLAS libraries (numpy's bundled
OpenBLAS exports scipy_cblas_sgemm64_, with 64-bit integers); when none is found, or
the operands are not float32 matrices BLAS can read in place, callers keep np.matmul.
ctypes releases the GIL for the call, so split parts still run concurrently.

`transposed_copy` calls OpenBLAS's cblas_?omatcopy extension, a blocked out-of-place
transpose, for what numpy does as a strided copy: 3x faster on the NCHW <-> NHWC
permutes of channels-last blocks (ConvNeXt's), one thread, float32, us: 96x3136 ->
3136x96 151 -> 49, 192x784 74 -> 25, 768x49 25 -> 7.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from pmx.runtime import parallel

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112

# set False to keep numpy everywhere (A/B measurements, debugging)
ENABLED = True


@functools.cache
def _entry_point(routine):
    """(cblas_<routine>, its integer type) of the first loaded BLAS that has it, or None.
    ILP64 spellings first, as numpy's wheels ship them (scipy_cblas_sgemm64_)."""
    spellings = ((f"scipy_cblas_{routine}64_", ctypes.c_int64), (f"cblas_{routine}64_", ctypes.c_int64),
                 (f"scipy_cblas_{routine}", ctypes.c_int), (f"cblas_{routine}", ctypes.c_int))
    for lib in parallel.blas_handles():
        for name, int_type in spellings:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = None
                return fn, int_type
    return None


def _operand(m):
    """(transpose flag, leading dimension) for a 2-D float32 array BLAS can read as it
    is, else None."""
    item = m.itemsize
    rows, cols = m.strides
    if cols == item and rows % item == 0 and rows // item >= max(1, m.shape[1]):
        return _NO_TRANS, rows // item
    if rows == item and cols % item == 0 and cols // item >= max(1, m.shape[0]):
        return _TRANS, cols // item
    return None


def sgemm_accumulate(a, b, out):
    """Callable computing out += a @ b in place (cblas_sgemm, beta = 1), or None when it
    cannot: no such BLAS entry point, not all float32 2-D, a vector product (numpy's GEMV
    path is as fast), out not row-major with unit column stride, or out overlapping an
    operand."""
    found = _entry_point("sgemm") if ENABLED else None
    if found is None or not all(isinstance(m, np.ndarray) and m.ndim == 2 and m.dtype == np.float32
                                and m.flags.aligned for m in (a, b, out)):
        return None
    m, k = a.shape
    n = b.shape[1]
    if min(m, n, k) < 2 or out.shape != (m, n) or np.may_share_memory(out, a) or np.may_share_memory(out, b):
        return None
    ta, tb, tc = _operand(a), _operand(b), _operand(out)
    if ta is None or tb is None or tc is None or tc[0] != _NO_TRANS:
        return None
    fn, integer = found
    one = ctypes.c_float(1.0)
    args = (_ROW_MAJOR, ta[0], tb[0], integer(m), integer(n), integer(k), one,
            ctypes.c_void_p(a.ctypes.data), integer(ta[1]), ctypes.c_void_p(b.ctypes.data), integer(tb[1]),
            one, ctypes.c_void_p(out.ctypes.data), integer(tc[1]))
    run = functools.partial(fn, *args)
    run.operands = (a, b, out)  # the arrays whose addresses it passes stay alive with it
    return run


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
    if (found is None or src.ndim != 2 or dst.shape != src.shape[::-1] or src.size == 0 or not src.dtype.isnative
            or not (src.flags.aligned and dst.flags.aligned) or np.may_share_memory(src, dst)):
        return None
    (trans_a, lda), (trans_b, ldb) = _operand(src) or (None, 0), _operand(dst) or (None, 0)
    if trans_a != _NO_TRANS or trans_b != _NO_TRANS:
        return None
    fn, integer = found
    rows, cols = src.shape
    run = functools.partial(fn, _ROW_MAJOR, _TRANS, integer(rows), integer(cols), routine[1](1.0),
                            ctypes.c_void_p(src.ctypes.data), integer(lda), ctypes.c_void_p(dst.ctypes.data),
                            integer(ldb))
    run.operands = (src, dst)  # the arrays whose addresses it passes stay alive with it
    return run
