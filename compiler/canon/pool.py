"""Pooling: nn.*Pool* / F.*pool* -> max_pool, avg_pool, adaptive_avg_pool, adaptive_max_pool."""

from pmx.compiler.canon import data_input, fail, ints, make, param, rule


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


def _values_only(node, ctx):
    """Outputs of a max pool: torch traces adaptive_max_pool2d with return_indices=True even
    when nothing reads the indices; those are dropped, used ones are refused."""
    if not param(node, "return_indices", False):
        return None
    indices = node.outputs[1:]
    if any(v.consumers or v in ctx.graph.outputs for v in indices):
        fail(node, "return_indices=True is not supported (the indices are used)")
    return node.outputs[:1]


@rule("nn.MaxPool1d", "nn.MaxPool2d", "nn.MaxPool3d", "F.max_pool1d", "F.max_pool2d", "F.max_pool3d")
def max_pool(node, ctx):
    nd = _nd(node)
    outputs = _values_only(node, ctx)
    kernel, stride, pads = _common(node, nd)
    attrs = dict(kernel=kernel, stride=stride, pads=pads, dilation=ints(node, "dilation", nd, 1),
                 ceil_mode=bool(param(node, "ceil_mode", False)))
    return [make(node, "max_pool", [data_input(node)], attrs, outputs=outputs)]


@rule("nn.AvgPool1d", "nn.AvgPool2d", "nn.AvgPool3d", "F.avg_pool1d", "F.avg_pool2d", "F.avg_pool3d")
def avg_pool(node, ctx):
    nd = _nd(node)
    kernel, stride, pads = _common(node, nd)
    divisor = param(node, "divisor_override", None)
    attrs = dict(kernel=kernel, stride=stride, pads=pads, dilation=(1,) * nd,
                 ceil_mode=bool(param(node, "ceil_mode", False)),
                 count_include_pad=bool(param(node, "count_include_pad", True)),
                 divisor_override=int(divisor) if divisor else 0)
    return [make(node, "avg_pool", [data_input(node)], attrs)]


def _adaptive(op):
    def fn(node, ctx):
        nd = _nd(node)
        outputs = _values_only(node, ctx)
        size = param(node, "output_size")
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size,) * nd
        if not isinstance(size, tuple) or len(size) != nd or not all(s is None or (isinstance(s, int) and s >= 0) for s in size):
            fail(node, f"output_size={size!r}: expected {nd} positive ints (or None)")
        x = data_input(node)
        # pnnx writes None (keep the input size) as 0
        size = tuple(x.shape[-nd + i] if not s else s for i, s in enumerate(size))
        return [make(node, op, [x], dict(output_size=size), outputs=outputs)]
    return fn


rule("nn.AdaptiveAvgPool1d", "nn.AdaptiveAvgPool2d", "nn.AdaptiveAvgPool3d", "F.adaptive_avg_pool1d",
     "F.adaptive_avg_pool2d", "F.adaptive_avg_pool3d")(_adaptive("adaptive_avg_pool"))
rule("nn.AdaptiveMaxPool1d", "nn.AdaptiveMaxPool2d", "nn.AdaptiveMaxPool3d", "F.adaptive_max_pool1d",
     "F.adaptive_max_pool2d", "F.adaptive_max_pool3d")(_adaptive("adaptive_max_pool"))
