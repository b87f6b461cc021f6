"""Reductions and softmax.

`reduce_mean`, `reduce_sum`, `reduce_max`, `reduce_min`, `reduce_prod`: attrs axes (tuple;
empty = all), keepdim. `softmax`, `log_softmax`: attrs axis.
"""

import numpy as np

from pmx.runtime.kernels import register


def reduce_infer(node, shapes, dtypes):
    x = shapes[0]
    axes = _axes(node.attrs.get("axes"), len(x))
    keep = node.attrs.get("keepdim", False)
    shape = tuple((1 if i in axes else d) for i, d in enumerate(x) if keep or i not in axes)
    dtype = dtypes[0]
    if node.op in ("reduce_sum", "reduce_prod") and np.dtype(dtype).kind in "bi":
        dtype = np.dtype("int64")
    return [(shape, dtype)]


def _axes(axes, ndim):
    if axes is None or axes == ():
        return tuple(range(ndim))
    return tuple(sorted(a % ndim for a in axes))


def _make_reduce(fn):
    def make(node, inputs, outputs):
        x, out = inputs[0], outputs[0]
        axes = _axes(node.attrs.get("axes"), x.ndim)
        keep = node.attrs.get("keepdim", False)
        target = out
        if not keep:  # reduce with keepdims into a view of out: same bytes, no copy
            target = out.reshape(tuple(1 if i in axes else d for i, d in enumerate(x.shape)))
            if not np.shares_memory(target, out):
                target = out
                return lambda: np.copyto(out, fn(x, axis=axes))
        return lambda: fn(x, axis=axes, keepdims=True, out=target)

    return make


for _name, _fn in (("reduce_mean", np.mean), ("reduce_sum", np.sum), ("reduce_max", np.max),
                   ("reduce_min", np.min), ("reduce_prod", np.prod)):
    register(_name, infer=reduce_infer)(_make_reduce(_fn))


def same_as_input(node, shapes, dtypes):
    return [(tuple(shapes[0]), dtypes[0])]


@register("softmax", infer=same_as_input, inplace=True)
def make_softmax(node, inputs, outputs):
    x, out = inputs[0], outputs[0]
    axis = node.attrs["axis"] % x.ndim
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


@register("log_softmax", infer=same_as_input, inplace=True)
def make_log_softmax(node, inputs, outputs):
    x, out = inputs[0], outputs[0]
    axis = node.attrs["axis"] % x.ndim
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
