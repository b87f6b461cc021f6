"""A conv, linear or matmul followed by an activation (any elementwise node over that
output alone: relu, clamp, sigmoid, silu, hardswish, gelu, ...) becomes one node whose
epilogue expression (node.expr over @0) runs in place on the GEMM output while it is in
cache (runtime/kernels/common.py). Chains fold in turn: conv -> mul(@0,2) -> relu gives
maximum(mul(@0,2),0)."""

from pmx.compiler.rewrite import N, V, rewrite_rule, rule_pass
from pmx.runtime import expr as E

GEMM_OPS = ("conv", "linear", "matmul")


@rewrite_rule(
    N(
        "elementwise",
        V("x", N(GEMM_OPS, name="gemm"), sole=True, kind="f"),
        arity=1,
        name="act",
        where=lambda act, m: act.outputs[0].shape == m.x.shape and act.outputs[0].dtype == m.x.dtype,
    )
)
def fuse_into_epilogue(graph, m):
    """Only where the activation is the GEMM output's sole reader and neither broadcasts
    nor changes dtype: the epilogue overwrites the output."""
    gemm, act = m.gemm, m.act
    gemm.expr = E.substitute(act.expr, {0: gemm.expr or E.at(0)})
    y = act.outputs[0]
    graph.remove_node(act)
    graph.set_outputs(gemm, [y])
    return True


fuse_activation = rule_pass("fuse_activation", [fuse_into_epilogue])
