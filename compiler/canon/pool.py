"""Pooling and windows: nn.*Pool* / F.*pool* -> max_pool, avg_pool, adaptive_avg_pool,
adaptive_max_pool (and *_indices with return_indices=True); LP pools and local response
norm in terms of those; Unfold / Fold -> unfold, fold."""

import math

from pmx.compiler.canon import data_input, elementwise, fail, ints, make, param, rule
from pmx.runtime import expr as E

_ABS = E.call("abs", E.at(0))


def _nd(node):
    return int(node.op.rstrip("d")[-1])


def _common(node, nd):
    kernel = ints(node, "kernel_size", nd)
    stride = param(node, "stride", None)
    stride = kernel if stride is None or stride == () else ints(node, "stride", nd)
    padding = ints(node, "padding", nd, 0)
    if any(2 * p > k for p, k in zip(padding, kernel)):
        fail(node, f"padding {padding} must be at most half the kernel {kernel} (as in torch)")
    return kernel, stride, padding + padding


def _is_output(ctx, v):
    return ctx.graph is not None and v in ctx.graph.outputs


def _unpacked(node, ctx):
    """The prim::TupleUnpack that reads a pool's one output (pnnx writes
    nn.AdaptiveMaxPool2d(return_indices=True) so), else None."""
    out = node.outputs[0]
    readers = out.consumers
    if (
        len(node.outputs) == 1
        and len(readers) == 1
        and readers[0].op == "prim::TupleUnpack"
        and len(readers[0].outputs) == 2
        and not _is_output(ctx, out)
    ):
        return readers[0]
    return None


def _pool_outputs(node, ctx):
    """(outputs, with_indices) of a max pool: with return_indices=True the values and the
    int64 indices, whether pnnx wrote them as two outputs or as one tuple a
    prim::TupleUnpack splits (its outputs are then taken over here); a pool whose indices
    nothing reads computes the values only (torch traces adaptive_max_pool2d with
    return_indices=True even when nothing reads them)."""
    if not param(node, "return_indices", False):
        return node.outputs[:1], False
    unpack = _unpacked(node, ctx)
    outputs = unpack.outputs if unpack is not None else node.outputs
    if len(outputs) < 2 or not (outputs[1].consumers or _is_output(ctx, outputs[1])):
        return outputs[:1], False
    outputs[1].dtype = "int64"
    return outputs[:2], True


@rule("prim::TupleUnpack")
def tuple_unpack(node, ctx):
    """A tuple an op's rule already split (a max pool's (values, indices)): that rule took
    over the outputs it produces; the ones it left are unused."""
    for v in node.outputs:
        if v.producer is node and (v.consumers or _is_output(ctx, v)):
            fail(
                node,
                "prim::TupleUnpack of a tuple pmx cannot split (pmx unpacks max pools' (values, indices) "
                "and packs built by prim::TupleConstruct)",
            )
    return []


@rule("nn.MaxPool1d", "nn.MaxPool2d", "nn.MaxPool3d", "F.max_pool1d", "F.max_pool2d", "F.max_pool3d")
def max_pool(node, ctx):
    nd = _nd(node)
    outputs, with_indices = _pool_outputs(node, ctx)
    kernel, stride, pads = _common(node, nd)
    attrs = dict(
        kernel=kernel,
        stride=stride,
        pads=pads,
        dilation=ints(node, "dilation", nd, 1),
        ceil_mode=bool(param(node, "ceil_mode", False)),
    )
    op = "max_pool_indices" if with_indices else "max_pool"
    return [make(node, op, [data_input(node)], attrs, outputs=outputs)]


@rule("nn.AvgPool1d", "nn.AvgPool2d", "nn.AvgPool3d", "F.avg_pool1d", "F.avg_pool2d", "F.avg_pool3d")
def avg_pool(node, ctx):
    nd = _nd(node)
    kernel, stride, pads = _common(node, nd)
    divisor = param(node, "divisor_override", None)
    attrs = dict(
        kernel=kernel,
        stride=stride,
        pads=pads,
        dilation=(1,) * nd,
        ceil_mode=bool(param(node, "ceil_mode", False)),
        count_include_pad=bool(param(node, "count_include_pad", True)),
        divisor_override=int(divisor) if divisor else 0,
    )
    return [make(node, "avg_pool", [data_input(node)], attrs)]


def _adaptive(op):
    def fn(node, ctx):
        nd = _nd(node)
        outputs, with_indices = _pool_outputs(node, ctx) if op == "adaptive_max_pool" else (node.outputs, False)
        size = param(node, "output_size")
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size,) * nd
        if (
            not isinstance(size, tuple)
            or len(size) != nd
            or not all(s is None or (isinstance(s, int) and s >= 0) for s in size)
        ):
            fail(node, f"output_size={size!r}: expected {nd} positive ints (or None)")
        x = data_input(node)
        # None (keep the input's size) stays 0, as pnnx writes it: the kernel takes the size
        # the input has when it runs, so a dynamic dim passes through (AdaptiveAvgPool2d((1, None)))
        size = tuple(s or 0 for s in size)
        return [make(node, op + "_indices" if with_indices else op, [x], dict(output_size=size), outputs=outputs)]

    return fn


rule(
    "nn.AdaptiveAvgPool1d",
    "nn.AdaptiveAvgPool2d",
    "nn.AdaptiveAvgPool3d",
    "F.adaptive_avg_pool1d",
    "F.adaptive_avg_pool2d",
    "F.adaptive_avg_pool3d",
)(_adaptive("adaptive_avg_pool"))
rule(
    "nn.AdaptiveMaxPool1d",
    "nn.AdaptiveMaxPool2d",
    "nn.AdaptiveMaxPool3d",
    "F.adaptive_max_pool1d",
    "F.adaptive_max_pool2d",
    "F.adaptive_max_pool3d",
)(_adaptive("adaptive_max_pool"))


def _number(node, key, default=None):
    v = param(node, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(node, f"{key}={v!r} must be a number")
    return v


def _positive(node, key, n, default=None):
    v = ints(node, key, n) if default is None else ints(node, key, n, default)
    if min(v) < 1:
        fail(node, f"{key}={v} must be positive")
    return v


@rule("F.lp_pool1d", "F.lp_pool2d", "nn.LPPool1d", "nn.LPPool2d")
def lp_pool(node, ctx):
    """(sum over the window of x^p)^(1/p) as torch computes it: avg_pool of x^p (no
    padding; ceil_mode windows divide by their clipped size) times the kernel's size,
    then ^(1/p); p = +-inf are max pools of |x| (negated for -inf)."""
    nd = _nd(node)
    x = data_input(node)
    p = _number(node, "norm_type")
    kernel = _positive(node, "kernel_size", nd)
    stride = param(node, "stride", None)
    stride = kernel if stride is None or stride == () else _positive(node, "stride", nd)
    ceil_mode = bool(param(node, "ceil_mode", False))
    geometry = dict(kernel=kernel, stride=stride, pads=(0,) * (2 * nd), dilation=(1,) * nd, ceil_mode=ceil_mode)
    shape = node.outputs[0].shape
    powered = ctx.temp(node, x.shape, x.dtype, "pow")
    pooled = ctx.temp(node, shape, x.dtype, "pool")
    if math.isinf(p):
        magnitude = elementwise(
            node, _ABS if p > 0 else E.call("neg", _ABS), [x], outputs=[powered], name=node.name + ".abs"
        )
        if p > 0:
            return [magnitude, make(node, "max_pool", [powered], geometry)]
        return [
            magnitude,
            make(node, "max_pool", [powered], geometry, outputs=[pooled], name=node.name + ".max"),
            elementwise(node, E.call("neg", E.at(0)), [pooled]),
        ]
    if p == 0:
        fail(node, "norm_type=0 is not a norm (torch divides by it)")
    attrs = dict(geometry, count_include_pad=True, divisor_override=0)
    return [
        elementwise(node, E.call("pow", E.at(0), p), [x], outputs=[powered], name=node.name + ".pow"),
        make(node, "avg_pool", [powered], attrs, outputs=[pooled], name=node.name + ".avg"),
        elementwise(node, E.call("pow", E.call("mul", E.at(0), math.prod(kernel)), 1.0 / p), [pooled]),
    ]


@rule("F.local_response_norm", "nn.LocalResponseNorm")
def local_response_norm(node, ctx):
    """x / (k + alpha * mean of x^2 over `size` channels)^beta, torch's formula: the mean
    is an avg_pool with a (size, 1) window over (N, 1, C, rest) with size // 2 zero
    channels before and (size - 1) // 2 after (always divided by size)."""
    x = data_input(node)
    if x.shape is None or len(x.shape) < 3:
        fail(node, f"local_response_norm needs an input of rank 3 or more, found shape {x.shape}")
    size = param(node, "size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        fail(node, f"size={size!r} must be a positive int")
    alpha, beta, k = (
        float(_number(node, key, default)) for key, default in (("alpha", 1e-4), ("beta", 0.75), ("k", 1.0))
    )
    n, c = x.shape[:2]
    grid = (n, 1, c, math.prod(x.shape[2:]))
    square = ctx.temp(node, x.shape, x.dtype, "sq")
    flat, mean, back = (ctx.temp(node, s, x.dtype, t) for s, t in ((grid, "flat"), (grid, "mean"), (x.shape, "back")))
    attrs = dict(
        kernel=(size, 1),
        stride=(1, 1),
        pads=(size // 2, 0, (size - 1) // 2, 0),
        dilation=(1, 1),
        ceil_mode=False,
        count_include_pad=True,
        divisor_override=0,
    )
    return [
        elementwise(node, E.call("mul", E.at(0), E.at(0)), [x], outputs=[square], name=node.name + ".sq"),
        make(node, "reshape", [square], dict(shape=grid), outputs=[flat], name=node.name + ".flat"),
        make(node, "avg_pool", [flat], attrs, outputs=[mean], name=node.name + ".mean"),
        make(node, "reshape", [mean], dict(shape=tuple(x.shape)), outputs=[back], name=node.name + ".back"),
        elementwise(
            node,
            E.call("div", E.at(0), E.call("pow", E.call("add", E.call("mul", E.at(1), alpha), k), beta)),
            [x, back],
        ),
    ]


def _window_attrs(node):
    return dict(
        kernel=_positive(node, "kernel_size", 2),
        stride=_positive(node, "stride", 2, 1),
        pads=ints(node, "padding", 2, 0) * 2,
        dilation=_positive(node, "dilation", 2, 1),
    )


@rule("F.unfold", "nn.Unfold")
def unfold(node, ctx):
    x = data_input(node)
    attrs = _window_attrs(node)
    if x.shape is None or len(x.shape) not in (3, 4) or min(attrs["pads"]) < 0:
        fail(
            node,
            f"unfold takes a 3-d or 4-d input and non-negative padding, found shape {x.shape}, "
            f"padding {attrs['pads'][:2]}",
        )
    return [make(node, "unfold", [x], attrs)]


@rule("F.fold", "nn.Fold")
def fold(node, ctx):
    x = data_input(node)
    attrs = dict(_window_attrs(node), output_size=_positive(node, "output_size", 2))
    if x.shape is None or len(x.shape) not in (2, 3) or min(attrs["pads"]) < 0:
        fail(
            node,
            f"fold takes a 2-d or 3-d input and non-negative padding, found shape {x.shape}, "
            f"padding {attrs['pads'][:2]}",
        )
    return [make(node, "fold", [x], attrs)]
