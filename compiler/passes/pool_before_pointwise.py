"""An average pool whose input is a 1x1 conv's output (stride 1, no padding, no fused
activation, no input scale) and whose only reader it is moves before the conv: the
conv then multiplies the pooled positions only. DenseNet's transitions (1x1 conv, then
a 2x2 average pool with stride 2) do a quarter of their GEMM.

Exact up to rounding: a 1x1 conv is an affine map per position, W y + b, and an
unpadded average pool is a per-channel weighted average with weights summing to 1
(partial windows of ceil mode included), so it commutes with the map and keeps the
bias. Does not fire on padded pools (with count_include_pad the border weights do not
sum to 1, which would scale the bias), on a divisor override, on a conv that is strided,
padded or wider than 1x1, or on a conv whose output anything else reads or that is a
graph output or kept.
"""

from pmx.compiler.ir import Value


def _pointwise_conv(node):
    a = node.attrs
    w = node.inputs[1] if len(node.inputs) > 1 else None
    return (node.op == "conv" and not node.expr and w is not None and w.shape is not None
            and all(k == 1 for k in w.shape[2:]) and all(s == 1 for s in a.get("stride", ()))
            and not any(a.get("pads", ())) and not (len(node.inputs) > 3 and node.inputs[3] is not None))


def _averaging_pool(node):
    a = node.attrs
    return (node.op == "avg_pool" and not any(a.get("pads", ())) and not a.get("divisor_override")
            and all(d == 1 for d in a.get("dilation", ())) and len(node.inputs) == 1 and len(node.outputs) == 1)


def pool_before_pointwise(graph) -> bool:
    changed = False
    for pool in list(graph.nodes):
        if not _averaging_pool(pool) or pool.inputs[0] is None:
            continue
        y = pool.inputs[0]
        conv = y.producer
        if conv is None or not _pointwise_conv(conv) or graph.sole_reader(y) is not pool or conv.inputs[0] is None:
            continue
        x, z = conv.inputs[0], pool.outputs[0]
        if x.shape is None or z.shape is None or x.dtype != y.dtype:
            continue
        pooled = Value(f"{pool.name}.before_{conv.name}", tuple(x.shape[:2]) + tuple(z.shape[2:]), x.dtype)
        graph.set_input(pool, 0, x)
        graph.set_outputs(pool, [pooled])
        graph.set_input(conv, 0, pooled)
        graph.set_outputs(conv, [z])
        # the pool now runs first: keep the node list topological for the checks after
        graph.nodes.remove(pool)
        graph.nodes.insert(graph.nodes.index(conv), pool)
        changed = True
    return changed
