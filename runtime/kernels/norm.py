"""Normalization.

`batch_norm`: inputs (x, scale[C], shift[C]) with scale = gamma / sqrt(var + eps) and
shift = beta - mean * scale precomputed by the compiler; channel axis 1.
"""

import numpy as np

from pmx.runtime.kernels import register


def same_as_input(node, shapes, dtypes):
    return [(tuple(shapes[0]), dtypes[0])]


@register("batch_norm", infer=same_as_input, inplace=True)
def make_batch_norm(node, inputs, outputs):
    x, scale, shift = inputs
    out = outputs[0]
    bshape = (1, scale.shape[0]) + (1,) * (x.ndim - 2)
    s, t = scale.reshape(bshape), shift.reshape(bshape)

    def run():
        np.multiply(x, s, out=out)
        np.add(out, t, out=out)

    return run
