"""The rewrite engine (compiler/rewrite.py) and each rule table on hand-built graphs: a
rule fires where its pattern matches, not where a guard fails (a weight not constant,
a wrong dtype kind), where the tensor it would fold away has a second reader, is a graph
output or is kept, and it fires with commutative operands either way round."""

import numpy as np
import pytest

from pmx.compiler.ir import Graph, Node, Value
from pmx.compiler.passes.batch_norm_as_elementwise import EXPR, batch_norm_as_elementwise
from pmx.compiler.passes.fold_affine_relu import FOLDED, fold_affine_relu
from pmx.compiler.passes.fuse_activation import fuse_activation
from pmx.compiler.passes.fuse_conv_batchnorm import fuse_conv_batchnorm
from pmx.compiler.passes.fuse_elementwise import fuse_elementwise
from pmx.compiler.passes.negate_silu_weights import NEGATED_SILU, negate_silu_weights
from pmx.compiler.passes.pool_before_pointwise import pool_before_pointwise
from pmx.compiler.plan import PassContext
from pmx.compiler.rewrite import Any, In, Lit, N, V, apply_rules, match, rewrite_rule
from pmx.runtime import expr as E
from pmx.runtime.errors import PmxInternalError

X0, X1, X2 = E.at(0), E.at(1), E.at(2)


def const(name, shape, dtype="float32", fill=1.0):
    return Value(name, shape, dtype, data=np.full(shape, fill, dtype))


def weight(name, shape, dtype="float32", constant=True, seed=0):
    if not constant:
        return Value(name, shape, dtype)
    data = (np.random.default_rng(seed).random(shape) + 0.5).astype(dtype)
    return Value(name, shape, dtype, data=data)


def build(inputs, nodes, outputs):
    g = Graph("t")
    g.inputs = [v for v in inputs if not v.is_constant]
    for n in nodes:
        g.add_node(n)
    g.outputs = list(outputs)
    return g


def hits(ctx):
    return sum(n for _, _, n in ctx.rule_hits)


def fired(run, g):
    """How many rewrites the rule pass `run` made on `g`."""
    ctx = PassContext()
    run(g, ctx)
    return hits(ctx)


# --- the engine ----------------------------------------------------------------------


def _one_node(expr, n_inputs=2, dtype="float32"):
    xs = [Value(f"x{i}", (2, 3), dtype) for i in range(n_inputs)]
    y = Value("y", (2, 3), dtype)
    node = Node("elementwise", "e", xs, [y], expr=expr)
    return build(xs, [node], [y]), node


def test_commutative_calls_match_both_ways():
    pattern = N("elementwise", expr=E.call("add", E.call("mul", In("a"), Lit(2)), In("b")))
    for expr in (E.call("add", E.call("mul", X0, 2), X1), E.call("add", X1, E.call("mul", 2, X0))):
        g, node = _one_node(expr)
        m = match(g, pattern, node)
        assert m is not None and m.a is node.inputs[0] and m.b is node.inputs[1]
    g, node = _one_node(E.call("sub", E.call("mul", X0, 2), X1))
    assert match(g, N("elementwise", expr=E.call("sub", In("b"), Any("t"))), node) is None


@pytest.mark.parametrize("literal, matches", [(2, True), (2.0, False), (True, False), (-0.0, False)])
def test_literals_match_by_type_and_value(literal, matches):
    g, node = _one_node(E.call("mul", X0, literal), n_inputs=1)
    assert (match(g, N("elementwise", expr=E.call("mul", X0, 2)), node) is not None) == matches
    assert (match(g, N("elementwise", expr=E.call("mul", X0, Lit(2, 2.0))), node) is not None) == (
        matches or (type(literal) is float and literal == 2.0)
    )


def test_repeated_captures_must_agree():
    pattern = N("elementwise", expr=E.call("mul", In("x"), E.call("sigmoid", In("x"))))
    g, node = _one_node(E.call("mul", X0, E.call("sigmoid", X0)))
    assert match(g, pattern, node) is not None
    g, node = _one_node(E.call("mul", X0, E.call("sigmoid", X1)))
    assert match(g, pattern, node) is None


def test_value_flags():
    x, y, z = Value("x", (2, 3)), Value("y", (2, 3)), Value("z", (2, 3))
    i = Value("i", (2, 3), "int32")
    a = Node("elementwise", "a", [x], [y], expr=E.call("exp", X0))
    b = Node("elementwise", "b", [y, i], [z], expr=E.call("add", X0, X1))
    g = build([x, i], [a, b], [z])
    sole = N("elementwise", V("y", N("elementwise", name="p"), sole=True))
    assert match(g, sole, b).p is a
    assert match(g, N("elementwise", None, V(kind="i")), b) is not None
    assert match(g, N("elementwise", None, V(kind="f")), b) is None
    assert match(g, N("elementwise", V(const=True)), b) is None
    g.keep([y])
    assert match(g, sole, b) is None
    assert match(g, N("elementwise", V(internal=True)), b) is None


def _chain(length):
    x = Value("x", (4,))
    vs = [x]
    nodes = []
    for i in range(length):
        vs.append(Value(f"v{i}", (4,)))
        nodes.append(Node("elementwise", f"n{i}", [vs[-2]], [vs[-1]], expr=E.call("neg", X0)))
    return build([x], nodes, [vs[-1]])


@rewrite_rule(
    N(
        "elementwise",
        V(of=N("elementwise", name="p", expr=E.call("neg", X0)), sole=True),
        name="n",
        expr=E.call("neg", X0),
    )
)
def cancel_double_negation(graph, m):
    """neg(neg(x)) -> exp(log(x)), one pair at a time."""
    graph.remove_node(m.p)
    graph.set_input(m.n, 0, m.p.inputs[0])
    m.n.expr = E.call("exp", E.call("log", X0))
    return True


@rewrite_rule(N("elementwise", expr=E.call("exp", X0), name="n"))
def exp_to_log(graph, m):
    """Undone by log_to_exp: together they never end."""
    m.n.expr = E.call("log", X0)
    return True


@rewrite_rule(N("elementwise", expr=E.call("log", X0), name="n"))
def log_to_exp(graph, m):
    m.n.expr = E.call("exp", X0)
    return True


def test_driver_reaches_a_fixpoint_and_counts_hits():
    g = _chain(6)
    assert apply_rules(g, "cancel", [cancel_double_negation]) == {"cancel_double_negation": 3}
    assert [n.expr for n in g.nodes] == [E.call("exp", E.call("log", X0))] * 3
    g.verify()


def test_driver_stops_a_rule_set_that_never_ends():
    g, _ = _one_node(E.call("exp", X0), n_inputs=1)
    with pytest.raises(PmxInternalError, match="rule set flip did not reach a fixpoint in 50 rewrites"):
        apply_rules(g, "flip", [exp_to_log, log_to_exp], max_hits=50)
    g, _ = _one_node(E.call("exp", X0), n_inputs=1)
    with pytest.raises(PmxInternalError, match="rule set flip did not reach a fixpoint in 80 rewrites"):
        apply_rules(g, "flip", [exp_to_log, log_to_exp])  # the default bound: 16 per node + 64


def test_declined_rewrite_tries_the_next_match():
    seen = []

    @rewrite_rule(N("elementwise", expr=E.call("add", In("a"), In("b"))))
    def record(graph, m):
        seen.append((m.a.name, m.b.name))  # and declines

    g, _ = _one_node(E.call("add", X0, X1))
    assert apply_rules(g, "decline", [record]) == {"record": 0}
    assert seen == [("x0", "x1"), ("x1", "x0")]


# --- the rules: each builder returns (graph, the tensor a rewrite folds away, pass) ---------


def conv_bn(kind="f", constant=True, order=0):
    dt = "float32" if kind == "f" else "int32"
    x, y, z = Value("x", (1, 3, 4, 4), dt), Value("y", (1, 4, 4, 4), dt), Value("z", (1, 4, 4, 4), dt)
    w = weight("w", (4, 3, 1, 1), dt, constant)
    conv = Node("conv", "c", [x, w, const("b", (4,), dt)], [y], attrs={"stride": (1, 1), "pads": (0, 0, 0, 0)})
    bn = Node("batch_norm", "bn", [y, const("s", (4,), dt, 2), const("t", (4,), dt)], [z])
    return build([x, w], [conv, bn], [z]), y, fuse_conv_batchnorm


def gemm_act(kind="f", constant=True, order=0):
    dt = "float32" if kind == "f" else "int32"
    x, y, z = Value("x", (2, 3), dt), Value("y", (2, 4), dt), Value("z", (2, 4), dt)
    lin = Node("linear", "l", [x, weight("w", (4, 3), dt)], [y])
    act = Node("elementwise", "r", [y], [z], expr=E.call("maximum", X0, 0))
    return build([x], [lin, act], [z]), y, fuse_activation


def silu(kind="f", constant=True, order=0):
    dt = "float32" if kind == "f" else "int32"
    x, y = Value("x", (2, 3), dt), Value("y", (2, 4), dt)
    w = weight("w", (4, 3), dt, constant)
    sig = E.call("sigmoid", X0)
    expr = E.call("mul", X0, sig) if order == 0 else E.call("mul", sig, X0)
    return (
        build([x, w], [Node("linear", "l", [x, w, const("b", (4,), dt)], [y], expr=expr)], [y]),
        None,
        negate_silu_weights,
    )


AFFINE_RELUS = [
    E.call("maximum", E.call("add", E.call("mul", X0, X1), X2), 0),
    E.call("maximum", 0, E.call("add", X2, E.call("mul", X1, X0))),
    E.call("maximum", E.call("add", E.call("mul", X0, X1), X2), 0.0),
]


def affine_relu(kind="f", constant=True, order=0):
    dt = "float32" if kind == "f" else "int32"
    x, y, z = Value("x", (1, 4, 3, 3), dt), Value("y", (1, 4, 3, 3), dt), Value("z", (1, 5, 3, 3), dt)
    s = weight("s", (4, 1, 1), dt, constant)
    node = Node("elementwise", "bnrelu", [x, s, const("t", (4, 1, 1), dt, 0.5)], [y], expr=AFFINE_RELUS[order])
    conv = Node("conv", "c", [y, weight("w", (5, 4, 1, 1), dt)], [z], attrs={"groups": 1, "pads": (0, 0, 0, 0)})
    return build([x, s], [node, conv], [z]), y, fold_affine_relu


def pool_conv(kind="f", constant=True, order=0):
    x, y, z = Value("x", (1, 3, 4, 4)), Value("y", (1, 5, 4, 4)), Value("z", (1, 5, 2, 2))
    if kind != "f":
        y.dtype = "float64"  # the conv changes dtype: the pool may not move before it
    conv = Node("conv", "c", [x, weight("w", (5, 3, 1, 1))], [y], attrs={"stride": (1, 1), "pads": (0, 0, 0, 0)})
    pool = Node("avg_pool", "p", [y], [z], attrs={"kernel": (2, 2), "stride": (2, 2), "pads": (0, 0, 0, 0)})
    return build([x], [conv, pool], [z]), y, pool_before_pointwise


def elementwise_pair(kind="f", constant=True, order=0):
    x, u, v, y = Value("x", (2, 3)), Value("u", (2, 3)), Value("v", (2, 3)), Value("y", (2, 3))
    if kind != "f":
        v.dtype = "float64"  # the producer changes dtype on write: it stays apart
    p = Node("elementwise", "p", [x], [v], expr=E.call("exp", X0))
    c = Node("elementwise", "c", [v, u] if order == 0 else [u, v], [y], expr=E.call("sub", X0, X1))
    return build([x, u], [p, c], [y]), v, fuse_elementwise


def batch_norm(kind="f", constant=True, order=0):
    dt = "float32" if kind == "f" else "int32"
    x, y = Value("x", (1, 4, 3, 3), dt), Value("y", (1, 4, 3, 3), dt)
    s = weight("s", (4,), dt, constant)
    return (
        build([x, s], [Node("batch_norm", "bn", [x, s, const("t", (4,), dt)], [y])], [y]),
        None,
        batch_norm_as_elementwise,
    )


RULES = {
    "fuse_conv_batchnorm": conv_bn,
    "fuse_activation": gemm_act,
    "negate_silu_weights": silu,
    "fold_affine_relu": affine_relu,
    "pool_before_pointwise": pool_conv,
    "fuse_elementwise": elementwise_pair,
    "batch_norm_as_elementwise": batch_norm,
}
ORDERS = {"negate_silu_weights": 2, "fold_affine_relu": 3, "fuse_elementwise": 2}
# rules without a weight guard: kept for every weight; without a kind guard (no other dtype built)
NO_CONST_GUARD = {"fuse_activation", "pool_before_pointwise", "fuse_elementwise"}


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_fires(name):
    for order in range(ORDERS.get(name, 1)):
        g, _, run = RULES[name](order=order)
        before = len(g.nodes)
        ctx = PassContext()
        run(g, ctx)
        assert hits(ctx) == 1 and ctx.rule_hits[0][0] == name, f"{name} order {order}"
        g.verify()
        assert len(g.nodes) <= before


# rules whose match folds no intermediate tensor away (no reader, output or kept guard)
FOLDS_NOTHING = {"negate_silu_weights", "batch_norm_as_elementwise"}
GUARDS = [
    (name, variant)
    for name in sorted(RULES)
    for variant in ("second_reader", "output", "kept", "not_constant", "wrong_kind")
    if not (variant == "not_constant" and name in NO_CONST_GUARD)
    and not (variant in ("second_reader", "output", "kept") and name in FOLDS_NOTHING)
]


def test_every_rule_but_the_listed_folds_a_tensor():
    """FOLDS_NOTHING is exactly the rules whose graph has no folded tensor, so the guard
    cases left out above are the ones that cannot apply."""
    assert {name for name in RULES if RULES[name]()[1] is None} == FOLDS_NOTHING


@pytest.mark.parametrize("name,variant", GUARDS)
def test_rule_does_not_fire(name, variant):
    g, v, run = RULES[name](constant=variant != "not_constant", kind="i" if variant == "wrong_kind" else "f")
    if variant in ("second_reader", "output", "kept"):
        if variant == "second_reader":
            w = Value("other", v.shape, v.dtype)
            g.add_node(Node("elementwise", "other", [v], [w], expr=E.call("neg", X0)))
            g.outputs.append(w)
        elif variant == "output":
            g.outputs.append(v)
        else:
            g.keep([v])
    nodes = [(n.op, n.expr, list(n.inputs)) for n in g.nodes]
    assert fired(run, g) == 0
    assert [(n.op, n.expr, list(n.inputs)) for n in g.nodes] == nodes


RESULTS = {
    "fuse_conv_batchnorm": lambda g: np.array_equal(g.nodes[0].inputs[2].data, np.full(4, 3.0)),
    "fuse_activation": lambda g: g.nodes[0].expr == E.call("maximum", X0, 0),
    "batch_norm_as_elementwise": lambda g: g.nodes[0].op == "elementwise" and g.nodes[0].expr == EXPR,
    "negate_silu_weights": lambda g: g.nodes[0].expr == NEGATED_SILU and (g.nodes[0].inputs[1].data < 0).all(),
    "pool_before_pointwise": lambda g: (
        [n.op for n in g.nodes] == ["avg_pool", "conv"] and g.nodes[0].outputs[0].shape == (1, 3, 2, 2)
    ),
    "fuse_elementwise": lambda g: (
        [n.name for n in g.nodes] == ["c"] and g.nodes[0].expr == E.call("sub", E.call("exp", X0), X1)
    ),
}


@pytest.mark.parametrize("name", sorted(set(RULES) & set(RESULTS)))
def test_rule_result(name):
    """What each rewrite leaves, on the graphs above."""
    g, _, run = RULES[name]()
    assert fired(run, g)
    assert RESULTS[name](g)


def test_fold_affine_relu_result():
    g, _, run = affine_relu()
    scale = g.nodes[0].inputs[1].data.reshape(-1)
    assert fired(run, g)
    assert g.nodes[0].expr == FOLDED
    np.testing.assert_allclose(g.nodes[0].inputs[1].data.reshape(-1), -0.5 / scale, rtol=1e-6)
