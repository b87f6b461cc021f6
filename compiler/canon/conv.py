"""Convolutions: nn.ConvNd / F.convNd -> conv."""

from pmx.compiler.canon import data_input, fail, ints, make, out_shape, param, rule, weight
from pmx.compiler.ir import Node

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _keeps_size(node, nd):
    x, y = data_input(node).shape, node.outputs[0].shape
    return x is not None and y is not None and tuple(x[2:]) == tuple(y[2:]) and len(y) == nd + 2


def conv_pads(node, nd, kernel, dilation):
    """Padding parameter (int, tuple, 'same', 'valid') -> begins + ends."""
    p = param(node, "padding", 0)
    if p == () and _keeps_size(node, nd):
        # pnnx drops the pads of a 1-d 'same' conv with a non-zeros padding_mode
        # (padding=()); the recorded output size says it was 'same'
        p = "same"
    if p == "valid":
        return (0,) * (2 * nd)
    if p == "same":
        if any(s != 1 for s in ints(node, "stride", nd, 1)):
            fail(node, "padding='same' needs stride 1 (as in torch)")
        total = [dilation[i] * (kernel[i] - 1) for i in range(nd)]
        begins = tuple(t // 2 for t in total)
        return begins + tuple(t - b for t, b in zip(total, begins))
    if isinstance(p, str):
        fail(node, f"padding={p!r}: expected an int, a tuple, 'same' or 'valid'")
    if isinstance(p, tuple) and len(p) == 2 * nd:
        # 'same' with a non-zeros padding_mode: pnnx writes torch's F.pad-order pads
        # (last dim first, begin/end pairs), which may be asymmetric
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in p):
            fail(node, f"padding={p!r}: expected non-negative ints")
        pairs = [p[2 * i : 2 * i + 2] for i in range(nd)][::-1]
        return tuple(b for b, _ in pairs) + tuple(e for _, e in pairs)
    pads = ints(node, "padding", nd, 0)
    if any(v < 0 for v in pads):
        fail(node, f"negative padding {pads}")
    return pads + pads


def with_batch_of_one(node, ctx, x, convert):
    """Run rule `convert` on a copy of `node` whose input `x` gets a leading batch axis of
    one (and its output too), between reshapes: torch's unbatched call is exactly that."""
    bx = ctx.temp(node, (1,) + tuple(x.shape), x.dtype, suffix="batched")
    outs = [
        ctx.temp(node, (1,) + tuple(out_shape(node, i)), v.dtype, suffix="batched_out")
        for i, v in enumerate(node.outputs)
    ]
    inputs = [bx if v is x else v for v in node.inputs]
    copy = Node(node.op, node.name, inputs, outs, node.attrs, input_names=node.input_names, line=node.line)
    nodes = [make(node, "reshape", [x], dict(shape=bx.shape), outputs=[bx], name=f"{node.name}.batch")]
    nodes += convert(copy, ctx)
    for o, v in zip(outs, node.outputs):
        nodes.append(make(node, "reshape", [o], dict(shape=tuple(o.shape[1:])), outputs=[v], name=f"{v.name}.unbatch"))
    return nodes


@rule("nn.Conv1d", "nn.Conv2d", "nn.Conv3d", "F.conv1d", "F.conv2d", "F.conv3d")
def conv(node, ctx):
    x = data_input(node)
    w = weight(node, "weight")
    if w.shape is not None and x.shape is not None and len(x.shape) == len(w.shape) - 1 == int(node.op[-2]) + 1:
        return with_batch_of_one(node, ctx, x, conv)  # unbatched input [C, *spatial]
    b = weight(node, "bias", required=False)
    if w.shape is None:
        fail(node, "weight has no shape")
    nd = len(w.shape) - 2
    if nd != int(node.op[-2]) or x.shape is None or len(x.shape) != nd + 2:
        fail(
            node,
            f"expected a {node.op[-2]}-d convolution input of rank {int(node.op[-2]) + 2}, got input shape {x.shape} and weight shape {w.shape}",
        )
    kernel = tuple(w.shape[2:])
    dilation = ints(node, "dilation", nd, 1)
    stride = ints(node, "stride", nd, 1)
    groups = param(node, "groups", 1)
    mode = param(node, "padding_mode", "zeros")
    if mode not in PADDING_MODES:
        fail(node, f"padding_mode={mode!r}: expected one of {', '.join(PADDING_MODES)}")
    if not isinstance(groups, int) or groups < 1 or x.shape[1] % groups or w.shape[0] % groups:
        fail(node, f"groups={groups!r} must divide in_channels={x.shape[1]} and out_channels={w.shape[0]}")
    if w.shape[1] * groups != x.shape[1]:
        fail(node, f"weight {w.shape} expects {w.shape[1] * groups} input channels, input has {x.shape[1]}")
    pads = conv_pads(node, nd, kernel, dilation)
    inputs = [x, w] + ([b] if b is not None else [])
    attrs = dict(stride=stride, pads=pads, dilation=dilation, groups=groups, padding_mode=mode)
    return [make(node, "conv", inputs, attrs)]
