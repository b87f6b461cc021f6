"""An average pool whose input is a 1x1 conv's output moves before the conv, which then
multiplies the pooled positions only (DenseNet's transitions: a quarter of the GEMM).
Exact up to rounding: a 1x1 conv is an affine map per position, and an unpadded average
pool a per-channel average with weights summing to 1 (ceil mode's partial windows too),
so they commute and the bias stays."""

from pmx.compiler.ir import Value
from pmx.compiler.rewrite import N, V, rewrite_rule, rule_pass


def _pointwise(conv, m):
    """Stride 1, unpadded, 1x1, no epilogue, no input scale."""
    a, w = conv.attrs, m.w
    return (
        not conv.expr
        and w.shape is not None
        and all(k == 1 for k in w.shape[2:])
        and all(s == 1 for s in a.get("stride", ()))
        and not any(a.get("pads", ()))
        and not (len(conv.inputs) > 3 and conv.inputs[3] is not None)
        and m.x.dtype == m.y.dtype
    )


def _averaging(pool, m):
    """Unpadded (with count_include_pad the border weights would not sum to 1, scaling the
    bias), no divisor override, no dilation."""
    a = pool.attrs
    return (
        not any(a.get("pads", ()))
        and not a.get("divisor_override")
        and all(d == 1 for d in a.get("dilation", ()))
        and m.x.shape is not None
        and pool.outputs[0].shape is not None
    )


CONV = N("conv", V("x"), V("w"), name="conv", where=_pointwise)


@rewrite_rule(N("avg_pool", V("y", CONV, sole=True), arity=1, name="pool", where=_averaging))
def pool_first(graph, m):
    """The conv's output has no other reader."""
    pool, conv, x, z = m.pool, m.conv, m.x, m.pool.outputs[0]
    pooled = Value(f"{pool.name}.before_{conv.name}", tuple(x.shape[:2]) + tuple(z.shape[2:]), x.dtype)
    graph.set_input(pool, 0, x)
    graph.set_outputs(pool, [pooled])
    graph.set_input(conv, 0, pooled)
    graph.set_outputs(conv, [z])
    graph.move_before(pool, conv)
    return True


pool_before_pointwise = rule_pass("pool_before_pointwise", [pool_first])
