"""Helpers shared by kernel families. Those that take `ctx` (the binding's
bind.BindContext, first parameter) read the binding's pool or memory when the factory
calls them; the callables they return hold what they were given."""

import functools
import itertools
import math
import sys

import numpy as np

from pmx.runtime import blas, parallel
from pmx.runtime import expr as E


def expect_operand(shapes, dtypes, k, name, shape=None, dtype=None, kinds=None, optional=False):
    """For shape rules: raises ValueError unless input k (`name`) has `shape` (a tuple of
    ints; None: any), `dtype` (None: any) and a dtype of one of numpy's `kinds` ("iu":
    an integer). An absent input (None, or past the end) passes when `optional`. The
    loader runs the rules before any kernel binds, so a file whose operand lies about its
    shape or dtype is refused naming the node instead of failing inside a kernel."""
    if k >= len(shapes) or shapes[k] is None:
        if optional:
            return
        raise ValueError(f"{name} (input {k}) is absent")
    got, got_dtype = tuple(shapes[k]), np.dtype(dtypes[k])
    if shape is not None and got != tuple(shape):
        raise ValueError(f"{name} (input {k}) has shape {got}, expected {tuple(shape)}")
    if dtype is not None and got_dtype != np.dtype(dtype):
        raise ValueError(f"{name} (input {k}) is {got_dtype.name}, expected {np.dtype(dtype).name}")
    if kinds is not None and got_dtype.kind not in kinds:
        raise ValueError(f"{name} (input {k}) is {got_dtype.name}, expected {_KIND_NAMES.get(kinds, kinds)}")


_KIND_NAMES = {
    "iu": "an integer dtype",
    "b": "bool",
    "biu": "an integer or bool dtype",
    "fc": "a float or complex dtype",
}


def view_as(a: np.ndarray, shape) -> np.ndarray:
    """Reshape that never copies: raises if `a` cannot be viewed as `shape`. Kernels write
    through these views, so a silent copy would lose the result."""
    v = a.view()
    v.shape = tuple(shape)
    return v


# copy_rows leaves longer rows to numpy's float loop: rows of 784 and 12544 floats (the flat
# depthwise path's im2col at 28x28 and 112x112) lost in models, 0.28 -> 0.38 and 0.47 ->
# 0.71 ms per node, though a single-threaded copy alone was level.
ROW_COPY_MAX_BYTES = 1024


def copy_rows(dst, src):
    """Callable doing np.copyto(dst, src) (same shape and dtype). When the rows (last axis)
    are contiguous in both but lie apart in either (an im2col window, a padded
    buffer's interior, the valid part of a "wide" output), each row is copied as one
    item of a void dtype as wide as the row: numpy's loop then moves whole rows instead
    of running its strided float loop once per row, which short rows pay for: measured
    faster than the plain copy on 3x3 im2col windows and on 7x7 rows out of wider rows
    (docs/performance.md, "Kernel measurements")."""
    item = dst.itemsize
    if (
        dst.ndim >= 2
        and dst.shape == src.shape
        and dst.dtype == src.dtype
        and 1 < dst.shape[-1] * item <= ROW_COPY_MAX_BYTES
        and dst.strides[-1] == src.strides[-1] == item
        and (dst.strides[-2] != dst.shape[-1] * item or src.strides[-2] != src.shape[-1] * item)
    ):
        row = np.dtype((np.void, dst.shape[-1] * item))
        d, s = dst.view(row)[..., 0], src.view(row)[..., 0]
        return lambda: np.copyto(d, s)
    return lambda: np.copyto(dst, src)


def copy_strided(dst, src, owner=None):
    """copy_rows(dst, src), except that a source stepping over every other item along
    its last axis (a stride-2 conv's im2col window, a phase of a stride-2 split) is read
    as pairs of items in one unsigned integer twice as wide, starting at each wanted
    item, and cast to the item-sized integer into dst: the cast keeps the low half, the
    wanted item, on a little-endian host. A contiguous cast of pairs instead of numpy's
    strided copy loop, measured faster on a stride-2 3x3 stem's im2col
    (docs/performance.md, "Kernel measurements"). Each pair reads one item past its own,
    so the pairs must lie inside `owner` (the C-contiguous array src views; found from
    src's bases when not given); where they would not, or the items are not 4 or 2
    bytes, copy_rows."""
    item = src.itemsize
    if (
        src.ndim >= 1
        and src.shape == dst.shape
        and src.dtype == dst.dtype
        and pairs_castable(src.dtype)
        and src.strides[-1] == 2 * item
        and dst.strides[-1] == item
        and src.size
    ):
        owner = root_array(src) if owner is None else owner
        if owner is not None:
            offset = src.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
            try:
                pairs = np.ndarray(src.shape, np.dtype(f"u{2 * item}"), owner, offset, src.strides)
            except (ValueError, TypeError):  # a pair would reach past the owner's end
                pairs = None
            if pairs is not None:
                target = dst.view(f"u{item}")
                return lambda: np.copyto(target, pairs, casting="unsafe")
    return copy_rows(dst, src)


def pairs_castable(dtype):
    """Whether copy_strided can read items of `dtype` as pairs: 2- or 4-byte native items
    on a little-endian host (the pair's low half is then its first item)."""
    return dtype.itemsize in (2, 4) and dtype.isnative and sys.byteorder == "little"


def root_array(a):
    """The C-contiguous array at the root of a's views, or None."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.flags.c_contiguous else None


# Variant suffix: the node's work is not split over the threads. `pmx compile --tune`
# no longer writes it (compiler/passes/tune.py says why); files that have it run as stored.
SINGLE_THREAD = "_1t"


def node_threads(ctx, node):
    """Threads a node's kernel may split its work over (1 for a `_1t` variant)."""
    return 1 if node.variant.endswith(SINGLE_THREAD) else ctx.threads


def gemm_node_threads(ctx, node):
    """Threads a node's kernel may split its BLAS calls over: node_threads when the pool
    splits GEMMs (BLAS on one thread), else 1 (BLAS's own threads share them)."""
    return 1 if node.variant.endswith(SINGLE_THREAD) else ctx.gemm_threads


def split_threads(ctx, node, elements):
    """Threads a node splits `elements` of work over: node_threads when the work pays
    for a dispatch (ctx.worth_splitting), else 1."""
    return node_threads(ctx, node) if ctx.worth_splitting(elements) else 1


def split_copy(ctx, dst, src, axis, threads):
    """Callable np.copyto(dst, src) split over `threads` along `axis` (of both)."""
    lead = (slice(None),) * axis
    return ctx.split(
        [
            lambda d=dst[lead + (slice(lo, hi),)], s=src[lead + (slice(lo, hi),)]: np.copyto(d, s)
            for lo, hi in parallel.ranges(dst.shape[axis], threads)
        ]
    )


def epilogue(ctx, node, out, threads=None):
    """The fused activation of a conv/linear/matmul node (node.expr over @0 = the GEMM
    output), applied in place on `out` (split over `threads`, default all, when big);
    None when there is none."""
    if not node.expr:
        return None
    tree = node.expr
    return split_expression(
        ctx, tree, [out], out, ctx.threads if threads is None else threads, expression_backend(node, tree)
    )


# Ops a float32 numpy pass computes in ~0.1 ns per element. An activation made only of
# these (ReLU, ReLU6, leaky ReLU, hardswish, hardsigmoid) is cheaper per element than
# the GIL: two threads calling numpy at once hand the GIL over at every call (two
# threads each calling np.add on 10,000 float32s: 7.5-7.9 us per pair of calls against
# 2.0-2.3 us per call on one thread).
CHEAP_OPS = E.names_with("cheap") | {"@", "#"}


def split_activated(ctx, node, out, parts):
    """One callable running `parts`, (work, the part of out it writes) pairs, over the
    threads, each followed by node's fused activation on its part while that is in
    cache; or, where epilogue_after_parts says so, the activation once on all of out
    after them. Every kernel that splits a node with an activation goes through here.
    node None or without an activation: the work alone."""
    works = [work for work, _ in parts]
    if node is None or not node.expr:
        return ctx.split(works)
    if len(parts) > 1 and epilogue_after_parts(ctx, node, out):
        return chain(ctx.split(works), epilogue(ctx, node, out, threads=1))
    return ctx.split([chain(work, epilogue(ctx, node, part, threads=1)) for work, part in parts])


def epilogue_after_parts(ctx, node, out):
    """Whether a kernel split over the threads runs node's activation once on all of `out`
    after its parts instead of inside each: cheap arithmetic (CHEAP_OPS) on a tensor an
    elementwise node would not split either (ctx.worth_splitting). A transcendental
    activation (SiLU: exp costs far more per element than cheap arithmetic) keeps its
    share of the cores. After the parts measured faster than in each part on
    MobileNetV3-small (hardswish) and level within noise on ShuffleNetV2, MobileNetV2 and
    EfficientNet-B0 (docs/performance.md, "Kernel measurements")."""
    if not node.expr or ctx.worth_splitting(out.size):
        return False
    return _only_cheap(E.desugar(node.expr))


def _only_cheap(tree):
    return tree[0] in CHEAP_OPS and all(_only_cheap(a) for a in tree[1:] if isinstance(a, tuple))


def expression_backend(node, tree):
    """E.compile_numexpr when the node's variant asks for numexpr and numexpr can run the
    tree, else None (numpy: split_expression's default)."""
    return E.compile_numexpr if node.variant.endswith("numexpr") and E.numexpr_supported(tree) else None


def split_expression(ctx, tree, inputs, out, threads, backend=None):
    """Callable evaluating `tree` into `out` with `backend` (E.compile_numpy, or
    E.compile_numexpr), as one slab per thread along the first axis at least `threads`
    long when the tensor is big enough to pay for the dispatch. Each slab is the same
    expression over slices of out and of every input not broadcast along that axis
    (numpy's ufuncs and numexpr release the GIL, so slabs overlap).

    numexpr work follows the InferenceSession's thread count, though pmx never sets
    numexpr's process-wide count: with numexpr on one thread, its program runs in slabs
    on the InferenceSession's threads; with numexpr's pool exactly `threads` strong, whole
    on that pool; otherwise (numexpr sized for the whole machine, not for a container's
    quota or this InferenceSession) the expression runs on numpy, in slabs."""
    if backend is not None:
        numexpr_threads = E.numexpr_threads()
        if numexpr_threads > 1 and numexpr_threads == threads:
            threads = 1  # numexpr's own threads share the program out
        elif numexpr_threads > 1:
            backend = None
    # numpy's temporaries come from the binding's shared pool (BindContext.temporary_array)
    backend = backend or functools.partial(E.compile_numpy, empty=ctx.temporary_array)
    axis = next((i for i, d in enumerate(out.shape) if d >= threads), None) if threads > 1 else None
    if axis is None or not ctx.worth_splitting(out.size):
        return backend(tree, inputs, out)
    axis -= out.ndim
    parts = [
        backend(tree, [along(x, axis, lo, hi) for x in inputs], along(out, axis, lo, hi))
        for lo, hi in parallel.ranges(out.shape[axis], threads)
    ]
    return ctx.split(parts)


def along(x, axis, lo, hi):
    """x restricted to lo:hi along `axis` (negative: counted from the end, where numpy
    aligns broadcast dims); x whole where it broadcasts along that axis or lacks it, and
    None or a scalar as it is. Every split of work into thread parts cuts its operands
    with this."""
    if not isinstance(x, np.ndarray) or -axis > x.ndim or x.shape[axis] == 1:
        return x
    return x[(Ellipsis, slice(lo, hi)) + (slice(None),) * (-axis - 1)]


# GEMMs: split only products of at least this many multiply-adds (~0.15 ms on one core),
# as measured with worker threads (gemm_split_minimum)
GEMM_SPLIT_MIN_MACS = 3 << 19
# ...except that products of a matrix by a matrix split from this many with threads too
MATRIX_SPLIT_MIN_MACS = 3 << 17
GEMM_SPLIT_MIN_COLUMNS = 512
GEMM_SPLIT_MIN_ROWS = 64


def product(a, b, out, bias=None):
    """Callable computing out = a @ b + bias (bias broadcast against out, or None) through
    pmx's BLAS (runtime/blas.py). With a bias, BLAS accumulates onto it where it can (the
    bias copied into out, then the GEMM with beta = 1), else the product and an add."""
    if bias is None:
        return blas.matmul(a, b, out)
    accumulate = blas.gemm(a, b, out, accumulate=True)
    if accumulate is None:
        multiply = blas.matmul(a, b, out)
        return lambda: (multiply(), np.add(out, bias, out=out))
    return lambda: (np.copyto(out, bias), accumulate())


def gemm(ctx, a, b, out, threads=None, activation=None, rows_first=False, bias=None):
    """Callable computing np.matmul(a, b, out=out), split over the threads when the
    product is big enough: along out's first batch axis longer than 1, else its columns
    (each thread reads half of b: a linear layer's weights), else its rows; with
    `rows_first`, rows before columns. A 1x1 conv's rows are its output channels, and
    the kernels after it (depthwise, elementwise, the next 1x1 conv) split by channel
    too, so each core then reads what it just wrote: per node inside models, 2 threads,
    rows measured faster than columns on the 1x1 convs of MobileNetV2, SqueezeNet and
    DenseNet. Linear layers keep columns: ViT-B/16's 3072->768 was slower with rows. The
    split happens only where BLAS runs on one thread (ctx.gemm_threads); otherwise BLAS's
    own threads share the product.
    `bias` (broadcast against out, or None) is added to each part with its product
    (`product`); `activation` (a node with a fused activation, or None) is applied as
    split_activated does. Measured on this 2-core machine with BLAS on one thread (idle
    machine): a two-way split is faster than one thread from ~4M multiply-adds up and
    loses on vectors (GEMVs). Between 1.5M and 4M (GEMM_SPLIT_MIN_MACS, was 4M) splits
    lost when timed alone but won inside models, per node, on 1x1 convs with bias
    (ShuffleNetV2, MobileNetV3-small); at 1.1M (24->58 at 28x28) it lost
    (docs/performance.md, "Kernel measurements")."""
    threads = threads or ctx.gemm_threads
    plan = _gemm_split(a, b, out, threads, rows_first)
    if plan is None:
        return split_activated(ctx, activation, out, [(product(a, b, out, bias), out)])
    (axis_a, axis_b, axis_out), length = plan
    parts = []
    for lo, hi in parallel.ranges(length, threads):
        pa, pb, po = (
            x if axis is None else along(x, axis, lo, hi) for x, axis in ((a, axis_a), (b, axis_b), (out, axis_out))
        )
        parts.append((product(pa, pb, po, None if bias is None else along(bias, axis_out, lo, hi)), po))
    return split_activated(ctx, activation, out, parts)


def gemm_split_minimum(vector):
    """The fewest multiply-adds worth splitting a product over the threads; `vector`: a
    matrix-vector product (one output row or column). Matrix products split from
    MATRIX_SPLIT_MIN_MACS, vectors only from GEMM_SPLIT_MIN_MACS: a GEMV reads its
    weights once, at the memory's speed, and a second thread only adds its hand-off
    (docs/performance.md has the measurements)."""
    return GEMM_SPLIT_MIN_MACS if vector else min(MATRIX_SPLIT_MIN_MACS, GEMM_SPLIT_MIN_MACS)


def _gemm_split(a, b, out, threads, rows_first=False):
    """((axis of a, of b, of out), length) to split along, axes counted from the end
    (None: that operand is whole in every part); None when the product is too small to
    pay for the dispatch or has a vector operand."""
    macs = math.prod(out.shape) * a.shape[-1]
    if threads < 2 or min(a.ndim, b.ndim) < 2 or macs < gemm_split_minimum(1 in out.shape[-2:]):
        return None
    for i, d in enumerate(out.shape[:-2]):
        if d > 1:
            axis = i - out.ndim
            return (axis, axis, axis), d
    rows = ((-2, None, -2), out.shape[-2]) if out.shape[-2] >= GEMM_SPLIT_MIN_ROWS else None
    columns = ((None, -1, -1), out.shape[-1]) if out.shape[-1] >= GEMM_SPLIT_MIN_COLUMNS else None
    return (rows or columns) if rows_first else (columns or rows)


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


def padded_shape(x_shape, pads):
    """x_shape with each of its last len(pads) // 2 dims grown by its pads (begins, then
    ends); the pad op's shape rule too, so a pad may be negative."""
    nd = len(pads) // 2
    lead = len(x_shape) - nd
    return tuple(x_shape[:lead]) + tuple(x_shape[lead + i] + pads[i] + pads[nd + i] for i in range(nd))


def padded_buffer(ctx, x_shape, pads, dtype, fill, shared_as=None):
    """A buffer for the padded input with its borders set once to `fill`, and the view of
    its interior that receives the input on each run. pads = begins + ends per spatial dim.
    With `shared_as` (what else decides the positions its node writes, such as a padding
    mode that rewrites the border), nodes of one binding with the same geometry share it
    (BindContext.persistent_buffer)."""
    nd = len(pads) // 2
    spatial = x_shape[-nd:]
    shape = padded_shape(x_shape, pads)
    key = None if shared_as is None else ("padded", tuple(x_shape), tuple(pads), shared_as)
    buf = ctx.persistent_buffer(key, shape, dtype, fill)
    interior = buf[(Ellipsis,) + tuple(slice(pads[i], pads[i] + s) for i, s in enumerate(spatial))]
    return buf, interior


def runs_of(mask):
    """The True positions of `mask` (over one slot: the flat layout a padded buffer repeats
    per image and channel) as (start, period, count, length) families: `count` runs of
    `length` positions, `period` apart, from `start`. Consecutive runs of one length at
    one spacing make one family, so a padded 2-D plane's border takes three (the top
    rows and the first left pad, the pads between rows, the last right pad and the
    bottom rows)."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).view(np.int8)))
    families = []
    for start, end in zip(edges[::2].tolist(), edges[1::2].tolist()):
        if families:
            first, period, count, length = families[-1]
            if length == end - start and (count == 1 or start - (first + (count - 1) * period) == period):
                families[-1] = (first, start - first if count == 1 else period, count + 1, length)
                continue
        families.append((start, 0, 1, end - start))
    return families


# restore_stale's cost model, float32 on this 2-core VM (fills of 96 and 576 channels): a
# strided family of runs of one item fills at ~1 ns per run (numpy drops the length-1
# axis), longer runs at ~4 ns per run plus ~0.2 per item, and a whole contiguous slot
# at ~0.08 ns per item (576 channels of 9x9 phases: 15 us).
RESTORE_NS_PER_SINGLE = 1.0
RESTORE_NS_PER_RUN = 4.0
RESTORE_NS_PER_RUN_ITEM = 0.2
RESTORE_NS_PER_ITEM = 0.08


def _families_ns(slot_count, families):
    return sum(
        slot_count
        * count
        * (RESTORE_NS_PER_SINGLE if length == 1 else RESTORE_NS_PER_RUN + RESTORE_NS_PER_RUN_ITEM * length)
        for _, _, count, length in families
    )


def restore_stale(slots, families, value):
    """Callable writing `value` at the positions `families` (runs_of) of every slot of
    `slots` (..., slot length; the last axis contiguous): the border of a padded scratch
    buffer, which holds stale data from other nodes until then.
    One fill per family, or one fill of the whole slots where that costs less (many
    short runs: the phases of small maps). This replaced a buffer per geometry kept
    from run to run: those held 14 MB on MobileNetV2, which with its weights and arena
    overflowed the cache each run, so every copy into them wrote to cold memory."""
    if not families:
        return None
    value = slots.dtype.type(value)
    if (
        _families_ns(math.prod(slots.shape[:-1]), families) + 1000 * (len(families) - 1)
        > RESTORE_NS_PER_ITEM * slots.size
    ):
        return lambda: slots.fill(value)
    item = slots.itemsize
    views = tuple(
        np.lib.stride_tricks.as_strided(
            slots[..., start:], slots.shape[:-1] + (count, length), slots.strides[:-1] + (period * item, item)
        )
        for start, period, count, length in families
    )

    def run():
        for v in views:
            v.fill(value)

    return run


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


def check_border_pads(mode, pads, sizes):
    """torch's limits for padding copied from the input (fill_border): reflect pads
    shorter than the dim they pad, circular ones at most as long. Raises ValueError."""
    nd = len(sizes)
    for i, n in enumerate(sizes):
        for p in (pads[i], pads[nd + i]):
            if (mode == "reflect" and p >= n) or (mode == "circular" and p > n):
                raise ValueError(f"{mode} padding {tuple(pads)} is too large for spatial size {tuple(sizes)}")


def conv_out_size(n, k, s, d, pb, pe):
    return (n + pb + pe - d * (k - 1) - 1) // s + 1


def expect_output_positions(x, spatial, window):
    """Raise ValueError where a window op (conv or pool over input shape `x`) would have no
    output position along some spatial dim, as torch refuses it. (conv_transpose is left
    out: torch gives some of its empty outputs and refuses others.)"""
    if min(spatial, default=1) < 1:
        raise ValueError(f"input {tuple(x)} is too small for {window}: output positions {tuple(spatial)}")


# --- phase-split padded input ----------------------------------------------------------


class Phases:
    """Geometry of an input padded and split into stride phases, flattened per channel,
    so that every kernel tap is one contiguous slice of each channel's buffer at a fixed
    offset and a kernel computes a "wide" output (rows as long as the phase rows, the
    extra columns discarded). The depthwise conv (kernels/conv.py) and max pooling
    (kernels/pool.py) run on it.

    For stride s and dilation d along a dim, tap t reads padded rows t*d + s*y: phase
    (t*d) % s at phase row (t*d)//s + y. Each phase holds ceil(P/s) rows of the padded
    size P. Per channel, all phases lie one after another, each flattened, followed by
    a margin so the last tap's slice of the wide output stays inside the buffer.
    The taps reading one phase form a regular grid (along a dim, every s/gcd(s, d)-th
    tap, at phase rows d/gcd(s, d) apart), so one strided view copies a whole grid's
    columns: `grids` holds (first buffer offset, buffer step per dim, first tap per dim,
    tap step per dim, taps per dim) for each.
    With `shared_padding` (the padding is one constant, as zeros or max pooling's lowest
    value) and stride 1 along the last dim, consecutive rows share their padding columns:
    a row is the input row plus max(left, right) padding, not both, since a tap reading
    past a row's end reads the next row's left padding, and one reading before its start
    the previous row's right padding (the wide output must still fit: rows at least as
    long as the output's). 5x5 "same" convs read 18% fewer columns at 7x7, 11% at 14x14.
    Built once per shape by `phases` (scratch sizing and make() both ask)."""

    def __init__(self, x_shape, kernel, out_shape, stride, dilation, pads, shared_padding=False):
        nd = len(kernel)
        self.n, self.c = x_shape[:2]
        self.k = tuple(kernel)
        self.stride, self.dilation, self.pads = stride, dilation, pads
        self.in_spatial, self.out_spatial = tuple(x_shape[2:]), tuple(out_shape[2:])
        self.padded = tuple(self.in_spatial[i] + pads[i] + pads[nd + i] for i in range(nd))
        if shared_padding and stride[-1] == 1:
            row = max(self.in_spatial[-1] + max(pads[nd - 1], pads[-1]), self.out_spatial[-1])
            self.padded = self.padded[:-1] + (row,)
        self.rows = tuple(-(-self.padded[i] // stride[i]) for i in range(nd))  # per phase
        self.phase_size = math.prod(self.rows)
        row_strides = tuple(math.prod(self.rows[i + 1 :]) for i in range(nd))
        self.wide = self.out_spatial[:1] + self.rows[1:]
        self.length = math.prod(self.wide)  # wide output elements per channel
        self.phases = list(np.ndindex(*stride))
        self.taps = []  # flat offset of each kernel tap's slice in a channel's buffer
        for tap in np.ndindex(*self.k):
            r = tuple(tap[i] * dilation[i] for i in range(nd))
            phase = self.phases.index(tuple(r[i] % stride[i] for i in range(nd)))
            offset = sum((r[i] // stride[i]) * row_strides[i] for i in range(nd))
            self.taps.append(phase * self.phase_size + offset)
        stored = len(self.phases) * self.phase_size
        self.per_channel = stored + max(0, max(self.taps) + self.length - stored)
        self.grids = []
        runs = [_tap_runs(self.k[i], stride[i], dilation[i]) for i in range(nd)]
        for combo in itertools.product(*runs):
            phase = self.phases.index(tuple(r[0] for r in combo))
            first = tuple(r[1] for r in combo)
            offset = phase * self.phase_size + sum(
                (first[i] * dilation[i] // stride[i]) * row_strides[i] for i in range(nd)
            )
            steps = tuple((combo[i][2] * dilation[i] // stride[i]) * row_strides[i] for i in range(nd))
            self.grids.append((offset, steps, first, tuple(r[2] for r in combo), tuple(r[3] for r in combo)))


def _tap_runs(k, s, d):
    """Per phase of one dim: (phase, first tap, tap step, taps) of the taps reading it."""
    runs = []
    for p in range(s):
        taps = [t for t in range(k) if t * d % s == p]
        if taps:
            runs.append((p, taps[0], s // math.gcd(s, d), len(taps)))
    return runs


@functools.lru_cache(maxsize=256)
def _phases_cached(x_shape, kernel, out_shape, stride, dilation, pads, shared_padding):
    return Phases(x_shape, kernel, out_shape, stride, dilation, pads, shared_padding)


def phases(x_shape, kernel, out_shape, stride, dilation, pads, shared_padding=False):
    """The Phases of this geometry (memoized)."""
    return _phases_cached(
        tuple(x_shape), tuple(kernel), tuple(out_shape), tuple(stride), tuple(dilation), tuple(pads), shared_padding
    )


def _valid_reads(g):
    """Boolean mask over one channel's phase buffer (g: Phases) of the positions some
    valid output reads: a tap's slice at a valid position of the wide output (the other
    positions reach only the discarded columns)."""
    valid = np.zeros(g.wide, bool)
    valid[tuple(slice(0, o) for o in g.out_spatial)] = True
    positions = np.flatnonzero(valid)
    read = np.zeros(g.per_channel, bool)
    for t in g.taps:
        read[t + positions] = True
    return read


def phase_scratch(g, x_shape, dtype, mode="zeros"):
    """The (shape, dtype) scratch requests of phase_buffer, in order."""
    padded = [] if mode == "zeros" else [(padded_shape(x_shape, g.pads), dtype)]
    return [((g.n, g.c, g.per_channel), dtype)] + padded


def phase_buffer(ctx, x, g, mode="zeros", fill=0):
    """(buffer, fill(channel slice) -> callable): the phase-split padded input of x (g:
    its Phases) in scratch, and for each channel slice the callable that writes `fill`
    (zeros for a conv, the lowest value for max pooling) where the copy does not reach
    but a valid output reads, then copies those channels of x into their phases. With
    "zeros" each phase takes its rows straight from x; other padding modes build the
    padded input first (a second scratch array) and split that, and `fill` then covers
    only what lies past the padded size."""
    nd = len(g.k)
    buf = ctx.scratch_array((g.n, g.c, g.per_channel), x.dtype)
    phase_views = [
        view_as(buf[:, :, p * g.phase_size : (p + 1) * g.phase_size], (g.n, g.c) + g.rows) for p in range(len(g.phases))
    ]
    if mode == "zeros":
        src_spatial, begins, padded = x.shape[2:], g.pads[:nd], None
    else:
        padded = ctx.scratch_array(padded_shape(x.shape, g.pads), x.dtype)
        src_spatial, begins = padded.shape[2:], (0,) * nd
    stale = _valid_reads(g)  # less what the copies below write
    pairs = []
    for k, (phase, dst) in enumerate(zip(g.phases, phase_views)):
        d_idx, s_idx = [], []
        for i in range(nd):
            # padded row p = phase + stride*q lies in src at p - begin; keep q whose row exists
            r, s, begin, size = phase[i], g.stride[i], begins[i], src_spatial[i]
            q0 = max(0, -(-(begin - r) // s))
            q1 = min(g.rows[i], (begin + size - 1 - r) // s + 1)
            d_idx.append(slice(q0, max(q0, q1)))
            s_idx.append(slice(r + s * q0 - begin, r + s * max(q0, q1) - begin, s) if q1 > q0 else slice(0, 0))
        pairs.append((dst, tuple(d_idx), tuple(s_idx)))
        view_as(stale[k * g.phase_size : (k + 1) * g.phase_size], g.rows)[tuple(d_idx)] = False
    families = runs_of(stale)

    def fill_channels(ch):
        src = x if padded is None else padded
        steps = [restore_stale(buf[:, ch], families, fill)]
        if padded is not None:
            inside = tuple(slice(b, b + n) for b, n in zip(g.pads[:nd], x.shape[2:]))
            steps += [
                copy_rows(padded[(slice(None), ch) + inside], x[:, ch]),
                fill_border(padded[:, ch], g.pads, g.in_spatial, mode),
            ]
        steps += [copy_strided(dst[(slice(None), ch) + di], src[(slice(None), ch) + si]) for dst, di, si in pairs]
        return chain(*steps)

    return buf, fill_channels
