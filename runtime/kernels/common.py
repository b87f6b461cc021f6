"""Helpers shared by kernel families."""

import numpy as np

from pmx.runtime import expr as E
from pmx.runtime import parallel


def view_as(a: np.ndarray, shape) -> np.ndarray:
    """Reshape that never copies: raises if `a` cannot be viewed as `shape`. Kernels write
    through these views, so a silent copy would lose the result."""
    v = a.view()
    v.shape = tuple(shape)
    return v


def epilogue(node, out, threads=None):
    """The fused activation of a conv/linear/matmul node (node.expr over @0 = the GEMM
    output), applied in place on `out` (split over `threads`, default all, when big);
    None when there is none."""
    if not node.expr:
        return None
    tree = E.parse(node.expr, 1)
    if node.variant.endswith("numexpr") and E.numexpr_supported(tree):
        return E.compile_numexpr(tree, [out], out)
    return split_expression(tree, [out], out, parallel.num_threads() if threads is None else threads)


def split_expression(tree, inputs, out, threads):
    """Callable evaluating `tree` into `out` on numpy, as one slab per thread along the
    first axis at least `threads` long when the tensor is big enough to pay for the
    dispatch. Each slab is the same expression over slices of out and of every input
    not broadcast along that axis (numpy's ufuncs release the GIL, so slabs overlap)."""
    axis = next((i for i, d in enumerate(out.shape) if d >= threads), None) if threads > 1 else None
    if axis is None or not parallel.worth_splitting(out.size):
        return E.compile_numpy(tree, inputs, out)
    parts = [E.compile_numpy(tree, [_slab(x, out, axis, lo, hi) for x in inputs], _slab(out, out, axis, lo, hi))
             for lo, hi in parallel.ranges(out.shape[axis], threads)]
    return parallel.split(parts)


def _slab(x, out, axis, lo, hi):
    """Rows lo:hi of x along out's `axis` (x broadcast there, or a scalar: x itself)."""
    if not isinstance(x, np.ndarray):
        return x
    k = axis - (out.ndim - x.ndim)  # x's axis under numpy's right-aligned broadcasting
    if k < 0 or x.shape[k] == 1:
        return x
    return x[(slice(None),) * k + (slice(lo, hi),)]


def chain(*fns):
    """One callable running fns in order (Nones dropped)."""
    fns = tuple(f for f in fns if f is not None)
    if not fns:
        return None
    if len(fns) == 1:
        return fns[0]
    if len(fns) == 2:
        a, b = fns
        return lambda: (a(), b())
    def run():
        for f in fns:
            f()
    return run


def padded_buffer(x_shape, pads, dtype, fill):
    """A buffer for the padded input with its borders set once to `fill`, and the view of
    its interior that receives the input on each run. pads = begins + ends per spatial dim."""
    nd = len(pads) // 2
    lead = tuple(x_shape[:-nd])
    spatial = x_shape[-nd:]
    shape = lead + tuple(s + pads[i] + pads[nd + i] for i, s in enumerate(spatial))
    # np.zeros gets already-zero pages from the OS: no fill pass at bind, no first touch
    buf = np.zeros(shape, dtype=dtype) if fill == 0 else np.full(shape, fill, dtype=dtype)
    interior = buf[(Ellipsis,) + tuple(slice(pads[i], pads[i] + s) for i, s in enumerate(spatial))]
    return buf, interior


def fill_border(buf, pads, sizes, mode):
    """Callable that fills the padding of `buf` (interior already written) for reflect,
    replicate and circular padding, one spatial dim at a time as np.pad does."""
    nd = len(pads) // 2
    steps = []
    for i in range(nd):
        axis = buf.ndim - nd + i
        b, e, n = pads[i], pads[nd + i], sizes[i]
        for j in range(b):
            if mode == "reflect":
                src = b + (b - j)
            elif mode == "replicate":
                src = b
            else:  # circular
                src = b + n - (b - j)
            steps.append((axis, j, src))
        for j in range(e):
            dst = b + n + j
            if mode == "reflect":
                src = b + n - 2 - j
            elif mode == "replicate":
                src = b + n - 1
            else:
                src = b + j
            steps.append((axis, dst, src))
    pairs = []
    for axis, dst, src in steps:
        idx_d = [slice(None)] * buf.ndim
        idx_s = [slice(None)] * buf.ndim
        idx_d[axis] = dst
        idx_s[axis] = src
        pairs.append((buf[tuple(idx_d)], buf[tuple(idx_s)]))

    def run():
        for d, s in pairs:
            np.copyto(d, s)

    return run


def conv_out_size(n, k, s, d, pb, pe):
    return (n + pb + pe - d * (k - 1) - 1) // s + 1
