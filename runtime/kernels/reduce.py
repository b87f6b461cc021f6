"""Reductions and softmax.

`reduce_mean`, `reduce_sum`, `reduce_max`, `reduce_min`, `reduce_prod`: attrs axes (tuple;
empty = all), keepdim. `softmax`, `log_softmax`: attrs axis.
"""

import math

import numpy as np

from pmx.runtime import blas, parallel
from pmx.runtime.kernels.attr_specs import AXES, AXIS, FLAG, NUMBER, optional
from pmx.runtime.kernels.common import split_threads, view_as
from pmx.runtime.kernels.registry import register, rows_off_axis

# axes absent or (): all of them
REDUCE_ATTRS = dict(axes=optional(AXES), keepdim=optional(FLAG))


# Reductions torch refuses over no elements ("Expected reduction dim to have non-zero
# size"): they have no identity. The others give one: sum 0, prod 1, mean and the
# statistics nan, logsumexp -inf.
NO_IDENTITY = ("reduce_max", "reduce_min", "argmax", "argmin")


def check_not_empty(node, x, axes):
    """Raises ValueError (as torch does) when `node` reduces over no elements and its op
    has no identity (NO_IDENTITY, and norms with p = +-inf)."""
    empty = any(x[a] == 0 for a in axes)
    no_identity = node.op in NO_IDENTITY or (node.op == "reduce_norm" and abs(node.attrs.get("p", 2.0)) == math.inf)
    if empty and no_identity:
        raise ValueError(
            f"{node.op} over dims {list(axes)} of input {tuple(x)}: no elements to reduce (torch raises too)"
        )


def reduce_infer(node, shapes, dtypes):
    x = shapes[0]
    axes = _axes(node.attrs.get("axes"), len(x))
    check_not_empty(node, x, axes)
    keep = node.attrs.get("keepdim", False)
    shape = tuple((1 if i in axes else d) for i, d in enumerate(x) if keep or i not in axes)
    dtype = dtypes[0]
    if node.op in ("reduce_sum", "reduce_prod") and np.dtype(dtype).kind in "biu":  # torch sums uint8 in int64 too
        dtype = np.dtype("int64")
    return [(shape, dtype)]


def _axes(axes, ndim):
    if axes is None or axes == ():
        return tuple(range(ndim))
    return tuple(sorted(a % ndim for a in axes))


# Longest rows reduced by a GEMV: BLAS sums a row in a few float32 accumulators, whose
# rounding grows with the length faster than np.add.reduce's pairwise summation does.
# Measured against float64 on signed data: equal to np.mean's error up to ~200 values,
# 2-4x it from ~800 on. Global pooling rows (7x7 to 64x64) stay under the limit; longer
# rows are cut into equal chunks no longer than this (_chunked_sum).
ROWS_GEMV_MAX_LENGTH = 1 << 12


def _trailing_reduction(kind, x, out, lead):
    """Callable reducing all axes of `x` from `lead` on into `out` ("mean", "sum", "max"
    or "min"), as one call on x seen as a (rows, positions) matrix: sum as a GEMV with a
    vector of ones (mean: then divided by positions), max and min as np.maximum/minimum.reduce
    along the rows. None when that does not apply (non-contiguous operands, another
    output dtype, long rows that no chunk length divides (_chunked_sum), integer sums,
    empty rows); the caller then reduces with np.mean & co. np.mean/np.max over several axes
    go through Python-level wrappers and numpy's generic reduction: measured slower on one
    thread on global pools' shapes (docs/performance.md, "Kernel measurements")."""
    if not (x.flags.c_contiguous and out.flags.c_contiguous) or x.dtype != out.dtype:
        return None
    rows, positions = math.prod(x.shape[:lead]), math.prod(x.shape[lead:])
    if rows * positions == 0:
        return None
    x2, o1 = view_as(x, (rows, positions)), view_as(out, (rows,))
    if kind in ("max", "min"):
        fn = np.maximum if kind == "max" else np.minimum
        return lambda: fn.reduce(x2, axis=1, out=o1)
    if x.dtype not in (np.float32, np.float64):
        return None  # float16 sums would overflow and round; integers sum in int64
    total = _chunked_sum(x2, o1)
    if total is None or kind == "sum":
        return total
    # the sum divided by the count: a GEMV with weights 1/positions rounds every term by
    # the inexact 1/n, which cancellation magnifies (the mean of [-0.718, 0.505, 0.209]
    # was off by 1.1e-5 of itself; dividing the sum, as torch does, rounds once)
    return lambda: (total(), np.divide(o1, positions, out=o1))


def _chunked_sum(x2, o1):
    """Callable writing the row sums of the C-contiguous (rows, positions) matrix `x2`
    into `o1`: a GEMV with a vector of ones, rows longer than ROWS_GEMV_MAX_LENGTH cut
    into k equal chunks (a (rows * k, positions / k) view) whose k sums per row are then
    added pairwise by np.add.reduce. None when only chunks shorter than 64 would divide
    the rows (a prime length): the caller's float64 path then sums them. EfficientNet-B0's first squeeze-and-excitation pool (32x112x112, rows of
    12544 = 4 x 3136) measured faster this way than in np.mean's float64 path (one thread;
    docs/performance.md, "Kernel measurements")."""
    rows, positions = x2.shape
    fewest = -(-positions // ROWS_GEMV_MAX_LENGTH)
    chunks = (
        1 if fewest == 1 else next((k for k in range(fewest, positions // 64 + 1) if positions % k == 0), None)
    )  # chunks of 64 or more
    if chunks is None:
        return None
    ones = np.ones(positions // chunks, x2.dtype)
    if chunks == 1:
        return blas.matmul(x2, ones, o1)
    parts = np.empty((rows, chunks), x2.dtype)
    pieces, flat_parts = view_as(x2, (rows * chunks, positions // chunks)), view_as(parts, (rows * chunks,))
    sum_pieces = blas.matmul(pieces, ones, flat_parts)
    return lambda: (sum_pieces(), np.add.reduce(parts, axis=1, out=o1))


REDUCERS = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def reduction(kind, x, out, axes):
    """Callable reducing `axes` of x into `out` (the reduced shape, kept dims or not),
    `kind` one of REDUCERS: one GEMV or ufunc reduce for trailing axes
    (_trailing_reduction), else np.mean & co, with float16/32 sums and means accumulated
    in float64. The reduce ops and global adaptive pooling use it."""
    fn = REDUCERS[kind]
    if math.prod(x.shape[a] for a in axes) == 0:  # each output reduces no element
        if kind in ("max", "min"):
            raise ValueError(f"{kind} over no elements (the reduce ops' shape rule refuses it, as torch does)")
        identity = {"mean": np.nan, "sum": 0, "prod": 1}[kind]
        return lambda: out.fill(identity)
    lead = x.ndim - len(axes)
    if kind != "prod" and axes == tuple(range(lead, x.ndim)):
        fast = _trailing_reduction(kind, x, out, lead)
        if fast is not None:
            return fast
    kept_shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    if kind in ("mean", "sum") and x.dtype in (np.float16, np.float32):
        # accumulated in a float64 buffer, then rounded once: a float32 mean of many
        # signed values near zero (a whole tensor's) was off by 5e-5 of itself, and
        # numpy reducing into a float32 `out` rounds its partial sums to float32
        acc = np.empty(kept_shape, np.float64)
        acc_as_out = acc.reshape(out.shape)
        return lambda: (fn(x, axis=axes, keepdims=True, out=acc), np.copyto(out, acc_as_out, casting="same_kind"))
    target = out.reshape(kept_shape)  # reduce with keepdims into a view of out: no copy
    if not np.shares_memory(target, out):
        return lambda: np.copyto(out, fn(x, axis=axes))
    return lambda: fn(x, axis=axes, keepdims=True, out=target)


def _make_reduce(kind):
    def make(node, inputs, outputs, ctx):
        x = inputs[0]
        return reduction(kind, x, outputs[0], _axes(node.attrs.get("axes"), x.ndim))

    return make


for _kind in REDUCERS:
    register(f"reduce_{_kind}", infer=reduce_infer, attrs=REDUCE_ATTRS, rows=rows_off_axis("axes"))(_make_reduce(_kind))


def same_as_input(node, shapes, dtypes):
    return [(tuple(shapes[0]), dtypes[0])]


@register(
    "softmax", infer=same_as_input, inplace=True, attrs=dict(axis=AXIS), float_input=True, rows=rows_off_axis("axis")
)
def make_softmax(node, inputs, outputs, ctx):
    return _softmax_parts(ctx, node, inputs[0], outputs[0], log=False)


@register(
    "log_softmax",
    infer=same_as_input,
    inplace=True,
    attrs=dict(axis=AXIS),
    float_input=True,
    rows=rows_off_axis("axis"),
)
def make_log_softmax(node, inputs, outputs, ctx):
    return _softmax_parts(ctx, node, inputs[0], outputs[0], log=True)


def _softmax_parts(ctx, node, x, out, log):
    """(log_)softmax along node's axis, split over the threads along the longest other
    axis (the exp is costly per element on one core): two threads over the last axis
    measured faster than one on attention's score shapes (docs/performance.md, "Kernel
    measurements")."""
    axis = node.attrs["axis"] % x.ndim
    make = _log_softmax if log else _softmax
    if x.ndim == 1:
        return make(x, out, axis)
    along = max((i for i in range(x.ndim) if i != axis), key=lambda i: x.shape[i])
    parts = []
    for lo, hi in parallel.ranges(x.shape[along], split_threads(ctx, node, x.size)):
        part = (slice(None),) * along + (slice(lo, hi),)
        parts.append(make(x[part], out[part], axis))
    return ctx.split(parts)


def _softmax(x, out, axis):
    red_shape = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
    peak = np.empty(red_shape, x.dtype)
    total = np.empty(red_shape, x.dtype)

    def run():
        np.max(x, axis=axis, keepdims=True, out=peak)
        np.subtract(x, peak, out=out)
        np.exp(out, out=out)
        np.sum(out, axis=axis, keepdims=True, out=total)
        np.divide(out, total, out=out)

    return run


def _log_softmax(x, out, axis):
    red_shape = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
    peak = np.empty(red_shape, x.dtype)
    total = np.empty(red_shape, x.dtype)
    scratch = np.empty(x.shape, x.dtype)

    def run():
        np.max(x, axis=axis, keepdims=True, out=peak)
        np.subtract(x, peak, out=out)
        np.exp(out, out=scratch)
        np.sum(scratch, axis=axis, keepdims=True, out=total)
        np.log(total, out=total)
        np.subtract(out, total, out=out)

    return run


# --- index outputs, statistics, norms ----------------------------------------------------
# argmax/argmin: attrs axis, keepdim -> int64 (first occurrence, as torch).
# reduce_var/reduce_std: attrs axes, keepdim, correction (divisor N - correction).
# reduce_norm: attrs axes, keepdim, p (float; inf/-inf for max/min of |x|, 0 counts nonzeros).
# reduce_logsumexp: attrs axes, keepdim.


def arg_infer(node, shapes, dtypes):
    x = shapes[0]
    axis = node.attrs["axis"] % len(x)
    check_not_empty(node, x, (axis,))
    keep = node.attrs.get("keepdim", False)
    shape = tuple(1 if i == axis else d for i, d in enumerate(x) if keep or i != axis)
    return [(shape, np.dtype("int64"))]


def _make_arg(fn):
    def make(node, inputs, outputs, ctx):
        x, out = inputs[0], outputs[0]
        axis = node.attrs["axis"] % x.ndim
        keep = bool(node.attrs.get("keepdim", False))
        return lambda: fn(x, axis=axis, out=out, keepdims=keep)

    return make


ARG_ATTRS = dict(axis=AXIS, keepdim=optional(FLAG))
register("argmax", infer=arg_infer, attrs=ARG_ATTRS, rows=rows_off_axis("axis"))(_make_arg(np.argmax))
register("argmin", infer=arg_infer, attrs=ARG_ATTRS, rows=rows_off_axis("axis"))(_make_arg(np.argmin))


def float_reduce_infer(node, shapes, dtypes):
    ((shape, dtype),) = reduce_infer(node, shapes, dtypes)
    return [(shape, dtype if np.dtype(dtype).kind == "f" else np.dtype("float32"))]


def _keepdims_target(x, out, axes):
    """`out` seen with the reduced axes kept as size 1 (same bytes)."""
    return view_as(out, tuple(1 if i in axes else d for i, d in enumerate(x.shape)))


def _statistic(sqrt):
    def make(node, inputs, outputs, ctx):
        x, out = inputs[0], outputs[0]
        axes = _axes(node.attrs.get("axes"), x.ndim)
        target = _keepdims_target(x, out, axes)
        count = math.prod([x.shape[a] for a in axes])
        divisor = count - node.attrs.get("correction", 1.0)
        mean = np.empty(target.shape, out.dtype)
        dev = np.empty(x.shape, out.dtype)

        def run():
            np.mean(x, axis=axes, keepdims=True, out=mean)
            np.subtract(x, mean, out=dev)
            np.square(dev, out=dev)
            np.sum(dev, axis=axes, keepdims=True, out=target)
            with np.errstate(divide="ignore", invalid="ignore"):
                np.divide(target, divisor if divisor > 0 else 0.0, out=target)
            if sqrt:
                np.sqrt(target, out=target)

        return run

    return make


STATISTIC_ATTRS = dict(REDUCE_ATTRS, correction=optional(NUMBER))
register("reduce_var", infer=float_reduce_infer, attrs=STATISTIC_ATTRS, rows=rows_off_axis("axes"))(_statistic(False))
register("reduce_std", infer=float_reduce_infer, attrs=STATISTIC_ATTRS, rows=rows_off_axis("axes"))(_statistic(True))


@register(
    "reduce_norm", infer=float_reduce_infer, attrs=dict(REDUCE_ATTRS, p=optional(NUMBER)), rows=rows_off_axis("axes")
)
def make_reduce_norm(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    axes = _axes(node.attrs.get("axes"), x.ndim)
    target = _keepdims_target(x, out, axes)
    p = float(node.attrs.get("p", 2.0))
    scratch = np.empty(x.shape, out.dtype)
    kw = dict(axis=axes, keepdims=True, out=target)
    if p == 2.0:
        return lambda: (np.square(x, out=scratch), np.sum(scratch, **kw), np.sqrt(target, out=target))
    if p == 1.0:
        return lambda: (np.absolute(x, out=scratch), np.sum(scratch, **kw))
    if p == np.inf:
        return lambda: (np.absolute(x, out=scratch), np.max(scratch, **kw))
    if p == -np.inf:
        return lambda: (np.absolute(x, out=scratch), np.min(scratch, **kw))
    if p == 0.0:
        return lambda: (np.not_equal(x, 0, out=scratch, casting="unsafe"), np.sum(scratch, **kw))
    return lambda: (
        np.absolute(x, out=scratch),
        np.power(scratch, p, out=scratch),
        np.sum(scratch, **kw),
        np.power(target, 1.0 / p, out=target),
    )


@register("reduce_logsumexp", infer=float_reduce_infer, attrs=REDUCE_ATTRS, rows=rows_off_axis("axes"))
def make_reduce_logsumexp(node, inputs, outputs, ctx):
    x, out = inputs[0], outputs[0]
    axes = _axes(node.attrs.get("axes"), x.ndim)
    target = _keepdims_target(x, out, axes)
    if math.prod(x.shape[a] for a in axes) == 0:  # log of an empty sum, as torch gives
        return lambda: target.fill(-np.inf)
    peak = np.empty(target.shape, out.dtype)
    finite = np.empty(target.shape, bool)
    scratch = np.empty(x.shape, out.dtype)

    def run():
        np.max(x, axis=axes, keepdims=True, out=peak)
        # an all -inf (or inf) slice: shift by 0 so the result is -inf (inf), not nan
        np.isfinite(peak, out=finite)
        np.logical_not(finite, out=finite)
        np.copyto(peak, 0, where=finite)
        np.subtract(x, peak, out=scratch)
        np.exp(scratch, out=scratch)
        np.sum(scratch, axis=axes, keepdims=True, out=target)
        np.log(target, out=target)
        np.add(target, peak, out=target)

    return run
