"""Normalization: BatchNorm -> batch_norm with scale/shift folded in float64; LayerNorm /
RMSNorm -> layer_norm; GroupNorm and InstanceNorm -> group_norm (InstanceNorm with
tracked running statistics uses them in eval mode, so it is a batch_norm);
F.normalize -> lp_normalize.

Affine parameters may be weights (@weight) or operands ($weight), so a functional call
on computed tensors works too; absent ones are simply left out of the node's inputs
(a bias without a weight gets a constant weight of ones).
"""

import numpy as np

from pmx.compiler.canon import data_input, elementwise, fail, in_shape, make, param, rule, weight
from pmx.compiler.ir import Node
from pmx.runtime import expr as E


def per_channel(node, ctx, v, x, key):
    """A per-channel operand [C] shaped to broadcast along axis 1 of `x`: a constant is
    reshaped now, a graph tensor by a reshape node (it is only known at run time)."""
    c = x.shape[1]
    if tuple(in_shape(node, v)) not in ((c,), (1,)):
        fail(node, f"{key} {v.name} has shape {v.shape}, expected ({c},)")
    shape = (v.shape[0],) + (1,) * (len(x.shape) - 2)
    if v.is_constant:
        return ctx.const(f"{node.name}.{key}", v.data.reshape(shape))
    t = ctx.temp(node, shape, v.dtype, suffix=key)
    return make(node, "reshape", [v], dict(shape=shape), outputs=[t], name=f"{node.name}.{key}")


def _batch_norm_of_tensors(node, ctx, x, eps, stats):
    """Batch norm whose statistics or affine parameters are graph tensors (functional calls
    on inputs or computed values): (x - mean) / sqrt(var + eps) * weight + bias, per
    channel, evaluated at run time."""
    nodes, inputs = [], [x]
    for key, v in stats:
        if v is None:
            inputs.append(None)
            continue
        shaped = per_channel(node, ctx, v, x, key)
        if isinstance(shaped, Node):
            nodes.append(shaped)
            shaped = shaped.outputs[0]
        inputs.append(shaped)
    e = E.call("div", E.call("sub", E.at(0), E.at(1)), E.call("sqrt", E.call("add", E.at(2), float(eps))))
    if inputs[3] is not None:
        e = E.call("mul", e, E.at(3))
    if inputs[4] is not None:
        e = E.call("add", e, E.at(4 if inputs[3] is not None else 3))
    return nodes + [elementwise(node, e, [v for v in inputs if v is not None])]


def _folded_batch_norm(node, ctx, x, mean, var, gamma, beta, eps):
    if x.shape is None or len(x.shape) < 2:
        fail(node, f"input {x.shape} must have a channel axis 1")
    if any(v is not None and not v.is_constant for v in (mean, var, gamma, beta)):
        return _batch_norm_of_tensors(
            node, ctx, x, eps, [("mean", mean), ("var", var), ("weight", gamma), ("bias", beta)]
        )
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


@rule("nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "F.batch_norm")
def batch_norm(node, ctx):
    x = data_input(node)
    if param(node, "training", False) is True:
        fail(node, "training=True uses batch statistics; pmx compiles inference (training=False)")
    return _folded_batch_norm(
        node,
        ctx,
        x,
        weight(node, "running_mean"),
        weight(node, "running_var"),
        weight(node, "weight", required=False),
        weight(node, "bias", required=False),
        float(param(node, "eps", 1e-5)),
    )


def _affine_inputs(node, ctx, shape, dtype):
    """[weight, bias] / [weight] / [] as the kernels take them, checked against `shape`."""
    w = weight(node, "weight", required=False)
    b = weight(node, "bias", required=False)
    for v, key in ((w, "weight"), (b, "bias")):
        if v is not None and tuple(in_shape(node, v)) != tuple(shape):
            fail(node, f"{key} has shape {v.shape}, expected {tuple(shape)}")
    if b is not None and w is None:
        w = ctx.const(f"{node.name}.ones", np.ones(shape, dtype))
    return [v for v in (w, b) if v is not None]


def _float_input(node):
    x = data_input(node)
    if np.dtype(x.dtype).kind != "f":
        fail(node, f"input {x.name} has dtype {x.dtype}; normalization needs a floating-point tensor")
    in_shape(node, x)
    return x


@rule("nn.LayerNorm", "F.layer_norm", "nn.RMSNorm", "F.rms_norm")
def layer_norm(node, ctx):
    x = _float_input(node)
    shape = param(node, "normalized_shape")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    k = len(shape)
    if k == 0 or k > len(x.shape) or tuple(x.shape[len(x.shape) - k :]) != shape:
        fail(node, f"normalized_shape={shape} does not match the trailing dims of input {x.shape}")
    rms = node.op in ("nn.RMSNorm", "F.rms_norm")
    eps = param(node, "eps", 1e-5)
    if eps is None:  # RMSNorm's default: the dtype's machine epsilon
        eps = float(np.finfo(x.dtype).eps)
    affine = _affine_inputs(node, ctx, shape, x.dtype)
    if rms and len(affine) > 1:
        fail(node, "RMSNorm has no bias")
    if len(node.outputs) > 3 or (rms and len(node.outputs) > 1):
        fail(node, f"{len(node.outputs)} outputs: layer_norm gives the result, the mean and the inverse std")
    attrs = dict(axes=k, eps=float(eps), rms=int(rms))
    normalized = make(node, "layer_norm", [x] + affine, attrs, outputs=node.outputs[:1])
    return [normalized, *_layer_norm_statistics(node, ctx, x, k, float(eps))]


def _layer_norm_statistics(node, ctx, x, k, eps):
    """The mean and inverse standard deviation over the last k dims, kept as size-1 dims,
    for the outputs past the first (torch's native_layer_norm; ONNX LayerNormalization's
    Mean and InvStdDev): the population variance, as the normalization uses."""
    if len(node.outputs) < 2:
        return []
    axes = tuple(range(len(x.shape) - k, len(x.shape)))
    kept = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    mean = node.outputs[1]
    square = ctx.temp(node, tuple(x.shape), x.dtype, "centered_square")
    variance = ctx.temp(node, kept, x.dtype, "variance")
    rstd = node.outputs[2] if len(node.outputs) > 2 else ctx.temp(node, kept, x.dtype, "rstd")
    centered = E.call("sub", E.at(0), E.at(1))
    return [
        make(node, "reduce_mean", [x], dict(axes=axes, keepdim=True), outputs=[mean], name=f"{node.name}.mean"),
        elementwise(node, E.call("mul", centered, centered), [x, mean], outputs=[square], name=f"{node.name}.sq"),
        make(node, "reduce_mean", [square], dict(axes=axes, keepdim=True), outputs=[variance], name=f"{node.name}.var"),
        elementwise(
            node, E.call("rsqrt", E.call("add", E.at(0), eps)), [variance], outputs=[rstd], name=f"{node.name}.rstd"
        ),
    ]


@rule("nn.GroupNorm", "F.group_norm")
def group_norm(node, ctx):
    x = _float_input(node)
    if len(x.shape) < 2:
        fail(node, f"input {x.shape} needs a channel axis 1")
    groups = param(node, "num_groups")
    c = x.shape[1]
    if not isinstance(groups, int) or groups <= 0 or c % groups:
        fail(node, f"num_groups={groups!r} must divide the {c} channels")
    affine = _affine_inputs(node, ctx, (c,), x.dtype)
    return [make(node, "group_norm", [x] + affine, dict(groups=groups, eps=float(param(node, "eps", 1e-5))))]


@rule("nn.InstanceNorm1d", "nn.InstanceNorm2d", "nn.InstanceNorm3d", "F.instance_norm")
def instance_norm(node, ctx):
    x = _float_input(node)
    if len(x.shape) < 3:
        fail(node, f"input {x.shape} must be batched [N, C, ...] (unbatched instance norm is not supported)")
    eps = float(param(node, "eps", 1e-5))
    mean = weight(node, "running_mean", required=False)
    var = weight(node, "running_var", required=False)
    # nn.InstanceNorm* in eval mode normalizes with the running statistics when it tracks
    # them; F.instance_norm does so only with use_input_stats=False.
    if node.op == "F.instance_norm":
        use_running = param(node, "use_input_stats", True) is False
    else:
        use_running = bool(param(node, "track_running_stats", False)) and mean is not None
    if use_running:
        if mean is None or var is None:
            fail(node, "use_input_stats=False needs running_mean and running_var")
        return _folded_batch_norm(
            node, ctx, x, mean, var, weight(node, "weight", required=False), weight(node, "bias", required=False), eps
        )
    c = x.shape[1]
    affine = _affine_inputs(node, ctx, (c,), x.dtype)
    # groups 0: a group per channel however many channels a run has (a dynamic channel dim)
    return [make(node, "group_norm", [x] + affine, dict(groups=0, eps=eps))]


@rule("F.normalize")
def normalize(node, ctx):
    x = _float_input(node)
    dim = param(node, "dim", 1)
    p = param(node, "p", 2.0)
    if not isinstance(dim, int) or not -len(x.shape) <= dim < len(x.shape):
        fail(node, f"dim={dim!r} out of range for input of rank {len(x.shape)}")
    if isinstance(p, str) and p in ("inf", "Inf"):
        p = float("inf")
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not p > 0:
        fail(node, f"p={p!r} must be a positive number")
    return [
        make(node, "lp_normalize", [x], dict(axis=dim % len(x.shape), p=float(p), eps=float(param(node, "eps", 1e-12))))
    ]
