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


SINGLE_THREAD = "_1t"  # variant suffix: the node's work is not split over the threads


def node_threads(node):
    """Threads a node's kernel may split its work over (1 for a `_1t` variant)."""
    return 1 if node.variant.endswith(SINGLE_THREAD) else parallel.num_threads()


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
    axis -= out.ndim
    parts = [E.compile_numpy(tree, [along(x, axis, lo, hi) for x in inputs], along(out, axis, lo, hi))
             for lo, hi in parallel.ranges(out.shape[axis], threads)]
    return parallel.split(parts)


def along(x, axis, lo, hi):
    """x restricted to lo:hi along `axis` (negative: counted from the end, where numpy
    aligns broadcast dims); x whole where it broadcasts along that axis or lacks it, and
    None or a scalar as it is. Every split of work into thread parts cuts its operands
    with this."""
    if not isinstance(x, np.ndarray) or -axis > x.ndim or x.shape[axis] == 1:
        return x
    return x[(Ellipsis, slice(lo, hi)) + (slice(None),) * (-axis - 1)]


# GEMMs: split only products of at least this many multiply-adds (~0.15 ms on one core)
GEMM_SPLIT_MIN_MACS = 1 << 22
GEMM_SPLIT_MIN_COLUMNS = 512
GEMM_SPLIT_MIN_ROWS = 64


def gemm(a, b, out, threads=None, post=None):
    """Callable computing np.matmul(a, b, out=out), split over the threads when the
    product is big enough: along out's first batch axis longer than 1, else its columns
    (each thread reads half of b: a linear layer's weights, a conv's im2col columns),
    else its rows. BLAS itself runs single-threaded inside run()
    (parallel.blas_single_threaded), so this is where GEMMs get the other cores.
    `post(part, cut)` may return a callable to run on each part of out right after its
    product (bias, activation: while the part is in cache); cut = (axis, lo, hi) says
    which part, or is None for the whole (`along(x, *cut)` cuts an operand that
    broadcasts against out). Measured on this 2-core machine with BLAS on one thread
    (idle machine): a two-way split takes 0.50-0.65x the time of one thread from ~4M
    multiply-adds up (e.g. 512x4608 @ 4608x49: 3.24 -> 1.63 ms; 960x160 @ 160x49: 0.19 ->
    0.12 ms) and loses below (a GEMV of 1.3M: 0.08 -> 0.14)."""
    threads = threads or parallel.num_threads()
    post = post or (lambda part, cut: None)
    plan = _gemm_split(a, b, out, threads)
    if plan is None:
        return chain(lambda: np.matmul(a, b, out=out), post(out, None))
    (axis_a, axis_b, axis_out), length = plan
    parts = []
    for lo, hi in parallel.ranges(length, threads):
        pa, pb, po = (x if axis is None else along(x, axis, lo, hi) for x, axis in
                      ((a, axis_a), (b, axis_b), (out, axis_out)))
        parts.append(chain(lambda pa=pa, pb=pb, po=po: np.matmul(pa, pb, out=po), post(po, (axis_out, lo, hi))))
    return parallel.split(parts)


def _gemm_split(a, b, out, threads):
    """((axis of a, of b, of out), length) to split along, axes counted from the end
    (None: that operand is whole in every part); None when the product is too small to
    pay for the dispatch or has a vector operand."""
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


def gemm_post(node, bias):
    """post(part, cut) for `gemm`: add the part's share of `bias` (shaped to broadcast
    against the GEMM's out), then the node's fused activation, in place; None when the
    node has neither."""
    if bias is None and not node.expr:
        return None

    def post(part, cut):
        add_bias = None
        if bias is not None:
            share = bias if cut is None else along(bias, *cut)
            add_bias = lambda: np.add(part, share, out=part)  # noqa: E731
        return chain(add_bias, epilogue(node, part, threads=1))

    return post


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
