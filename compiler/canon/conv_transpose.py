"""Transposed convolutions: nn.ConvTransposeNd / F.conv_transposeNd -> conv_transpose."""

from pmx.compiler.canon import data_input, fail, ints, make, param, rule, weight
from pmx.compiler.canon.conv import with_batch_of_one


@rule(
    "nn.ConvTranspose1d",
    "nn.ConvTranspose2d",
    "nn.ConvTranspose3d",
    "F.conv_transpose1d",
    "F.conv_transpose2d",
    "F.conv_transpose3d",
)
def conv_transpose(node, ctx):
    x = data_input(node)
    w = weight(node, "weight")
    nd = int(node.op[-2])
    if w.shape is not None and x.shape is not None and len(x.shape) == len(w.shape) - 1 == nd + 1:
        return with_batch_of_one(node, ctx, x, conv_transpose)  # unbatched input [C, *spatial]
    b = weight(node, "bias", required=False)
    if w.shape is None or len(w.shape) != nd + 2 or x.shape is None or len(x.shape) != nd + 2:
        fail(
            node,
            f"expected a {nd}-d transposed convolution input of rank {nd + 2} (or "
            f"{nd + 1} unbatched) and a weight of rank {nd + 2}, got input shape "
            f"{x.shape} and weight shape {w.shape}",
        )
    if w.shape[0] != x.shape[1]:
        fail(node, f"weight {w.shape} expects {w.shape[0]} input channels, input has {x.shape[1]}")
    groups = param(node, "groups", 1)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or x.shape[1] % groups:
        fail(node, f"groups={groups!r} must divide in_channels={x.shape[1]}")
    mode = param(node, "padding_mode", "zeros")
    if mode != "zeros":
        fail(node, f"padding_mode={mode!r}: transposed convolutions only support 'zeros' (as in torch)")
    stride = ints(node, "stride", nd, 1)
    dilation = ints(node, "dilation", nd, 1)
    padding = param(node, "padding", 0)
    if isinstance(padding, str):
        fail(node, f"padding={padding!r}: transposed convolutions take int paddings")
    padding = ints(node, "padding", nd, 0)
    output_padding = ints(node, "output_padding", nd, 0)
    if any(v < 0 for v in padding + output_padding) or any(v < 1 for v in stride + dilation):
        fail(
            node, f"invalid stride {stride}, padding {padding}, output_padding {output_padding} or dilation {dilation}"
        )
    if any(op >= max(s, d) for op, s, d in zip(output_padding, stride, dilation)):
        fail(node, f"output_padding {output_padding} must be smaller than stride {stride} or dilation {dilation}")
    if b is not None and tuple(b.shape) != (w.shape[1] * groups,):
        fail(node, f"bias shape {b.shape} does not match {w.shape[1] * groups} output channels")
    attrs = dict(stride=stride, pads=padding + padding, output_padding=output_padding, dilation=dilation, groups=groups)
    inputs = [x, w] + ([b] if b is not None else [])
    return [make(node, "conv_transpose", inputs, attrs)]
