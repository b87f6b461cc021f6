"""A conv or linear whose epilogue is SiLU gets negated weights and bias and the epilogue
`div(@0,sub(-1,exp(@0)))` over z = -y: z / (-1 - exp(z)) = y / (1 + exp(-y)), three numpy
passes instead of four (negate, exp, add 1, divide). Bit-identical: negating every
weight and the bias negates each product and sum exactly (rounding is symmetric)."""

import numpy as np

from pmx.compiler.ir import Value
from pmx.compiler.rewrite import N, V, rewrite_rule, rule_pass
from pmx.runtime import expr as E

SILU = E.call("mul", E.at(0), E.call("sigmoid", E.at(0)))
NEGATED_SILU = E.call("div", E.at(0), E.call("sub", -1, E.call("exp", E.at(0))))


@rewrite_rule(
    N(
        ("conv", "linear"),
        None,
        V("w", const=True, kind="f", sole=True),
        V("b", const=True, kind="f", sole=True, opt=True),
        expr=SILU,
        name="gemm",
    )
)
def negate_weights(graph, m):
    """Only weights no other node reads: the file would hold both."""
    for i, v in ((1, m.w), (2, m.b)):
        if v is not None:
            graph.set_input(m.gemm, i, Value(f"{v.name}.neg", v.shape, v.dtype, data=np.negative(v.data)))
    m.gemm.expr = NEGATED_SILU
    return True


negate_silu_weights = rule_pass("negate_silu_weights", [negate_weights])
