"""Normalization: BatchNorm -> batch_norm with scale/shift folded in float64."""

import numpy as np

from pmx.compiler.canon import data_input, fail, make, param, rule, weight


@rule("nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "F.batch_norm")
def batch_norm(node, ctx):
    x = data_input(node)
    mean = weight(node, "running_mean")
    var = weight(node, "running_var")
    gamma = weight(node, "weight", required=False)
    beta = weight(node, "bias", required=False)
    eps = float(param(node, "eps", 1e-5))
    for v in (mean, var, gamma, beta):
        if v is not None and not v.is_constant:
            fail(node, f"{v.name} must be a constant for inference-mode batch norm")
    c = mean.data.size
    if x.shape is None or len(x.shape) < 2 or x.shape[1] != c:
        fail(node, f"input {x.shape} must have {c} channels on axis 1")
    scale = 1.0 / np.sqrt(var.data.astype(np.float64) + eps)
    if gamma is not None:
        scale = scale * gamma.data.astype(np.float64)
    shift = -mean.data.astype(np.float64) * scale
    if beta is not None:
        shift = shift + beta.data.astype(np.float64)
    dtype = x.dtype if x.dtype in ("float32", "float64", "float16") else "float32"
    s = ctx.const(f"{node.name}.scale", scale.astype(dtype))
    t = ctx.const(f"{node.name}.shift", shift.astype(dtype))
    return [make(node, "batch_norm", [x, s, t])]
