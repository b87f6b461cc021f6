"""prepack_weights: store weights in the layout the chosen kernel wants, so the runtime
neither transforms nor copies them.

A `conv` whose variant is "winograd" (choose_kernels' rule or --tune) becomes a
`conv_winograd` node (runtime/kernels/winograd.py) reading u[4, 4, K, C] = G g G^T,
computed here in float64 from the 3x3 weight. The original weight stays in the file
only if another node still reads it (dead-code-free: the writer stores what nodes read).
u takes 16/9 of the weight's bytes.
"""

from pmx.compiler.ir import Value
from pmx.runtime.kernels.winograd import transform_weights

WINOGRAD = "winograd"


def winograd_applies(node) -> bool:
    """Whether `node` is a conv F(2x2, 3x3) can compute: 2-D, 3x3, stride 1, dilation 1,
    one group, zero padding, a constant float weight and known 4-D input."""
    if node.op != "conv" or len(node.inputs) < 2:
        return False
    x, w = node.inputs[0], node.inputs[1]
    a = node.attrs
    return (
        w is not None
        and w.is_constant
        and w.shape is not None
        and len(w.shape) == 4
        and tuple(w.shape[2:]) == (3, 3)
        and str(w.dtype) in ("float32", "float64")
        and x is not None
        and x.shape is not None
        and len(x.shape) == 4
        and x.dtype == w.dtype
        and tuple(a.get("stride", (1, 1))) == (1, 1)
        and tuple(a.get("dilation", (1, 1))) == (1, 1)
        and a.get("groups", 1) == 1
        and a.get("padding_mode", "zeros") == "zeros"
        and len(node.inputs) <= 3
        and all(p >= 0 for p in a["pads"])
    )


def packed(node, variant, weight):
    """(op, weight array) the runtime runs `node` with under `variant`: conv_winograd and
    the transformed weight for a Winograd conv, else the node's op and `weight` as they
    are. prepack_weights stores this; --tune times candidates with it."""
    if node.op == "conv" and variant.startswith(WINOGRAD) and winograd_applies(node):
        return "conv_winograd", transform_weights(weight)
    return node.op, weight


def prepack_weights(graph, ctx):
    for node in graph.nodes:
        if not winograd_applies(node):
            continue
        w = node.inputs[1]
        op, data = packed(node, node.variant, w.data)
        if op != node.op:  # the variant is Winograd
            graph.set_input(node, 1, Value(f"{node.name}.weight_winograd", data.shape, w.dtype, data=data))
            node.op = op
            node.attrs = {"pads": tuple(node.attrs["pads"])}
