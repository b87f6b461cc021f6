"""Linear algebra.

`linear`: inputs (x[..., in], weight[out, in], bias[out]?); y = x @ weight.T + bias. The
transposed weight is a view, BLAS reads it without a copy. node.expr: fused activation.
`matmul`: inputs (a, b) with numpy/torch broadcasting; node.expr: fused activation.
"""

import numpy as np

from pmx.runtime.kernels import register
from pmx.runtime.kernels.common import chain, epilogue, view_as


def linear_infer(node, shapes, dtypes):
    return [(tuple(shapes[0][:-1]) + (shapes[1][0],), dtypes[0])]


@register("linear", infer=linear_infer)
def make_linear(node, inputs, outputs):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    out = outputs[0]
    wt = w.T
    if x.ndim > 2 and x.flags.c_contiguous and out.flags.c_contiguous:
        # one GEMM over all leading dims instead of a batch of small ones
        x2, out2 = view_as(x, (int(np.prod(x.shape[:-1])), x.shape[-1])), view_as(out, (int(np.prod(out.shape[:-1])), out.shape[-1]))
    else:
        x2, out2 = x, out
    gemm = lambda: np.matmul(x2, wt, out=out2)  # noqa: E731
    bias = (lambda: np.add(out, b, out=out)) if b is not None else None
    return chain(gemm, bias, epilogue(node, out))


def matmul_infer(node, shapes, dtypes):
    a, b = shapes
    a2 = (1,) + tuple(a) if len(a) == 1 else tuple(a)
    b2 = tuple(b) + (1,) if len(b) == 1 else tuple(b)
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    shape = tuple(batch) + (a2[-2], b2[-1])
    if len(a) == 1:
        shape = shape[:-2] + shape[-1:]
    if len(b) == 1:
        shape = shape[:-1]
    return [(shape, np.result_type(dtypes[0], dtypes[1]))]


@register("matmul", infer=matmul_infer)
def make_matmul(node, inputs, outputs):
    a, b = inputs
    out = outputs[0]
    return chain(lambda: np.matmul(a, b, out=out), epilogue(node, out))
