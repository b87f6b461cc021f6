"""A batch_norm no conv or linear absorbed (fuse_conv_batchnorm runs first) becomes an
elementwise node, add(mul(x, scale), shift), scale and shift shaped (C, 1, ...), so that
fuse_elementwise merges it with what follows (DenseNet's BN -> ReLU). The values are the
same: the kernel computed x * scale + shift in the input's dtype too."""

import numpy as np

from pmx.compiler.ir import Value
from pmx.compiler.rewrite import N, V, rewrite_rule, rule_pass
from pmx.runtime import expr as E

EXPR = E.call("add", E.call("mul", E.at(0), E.at(1)), E.at(2))


@rewrite_rule(
    N(
        "batch_norm",
        V("x", kind="f"),
        V("scale", const=True),
        V("shift", const=True),
        arity=3,
        name="bn",
        where=lambda bn, m: len(m.x.shape) >= 2 and m.scale.dtype == m.shift.dtype == m.x.dtype,
    )
)
def batch_norm_to_expression(graph, m):
    """Constant scale and shift of the input's float dtype, broadcast along axis 1."""
    bn, rank = m.bn, len(m.x.shape)
    for i, v in ((1, m.scale), (2, m.shift)):
        data = np.ascontiguousarray(v.data.reshape((-1,) + (1,) * (rank - 2)))
        graph.set_input(bn, i, Value(f"{bn.name}.{v.name}.bcast", data.shape, v.dtype, data=data))
    bn.op, bn.expr, bn.attrs, bn.variant = "elementwise", EXPR, {}, ""
    return True


batch_norm_as_elementwise = rule_pass("batch_norm_as_elementwise", [batch_norm_to_expression])
