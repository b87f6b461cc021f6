"""The rewrite engine (compiler/rewrite.py) on hand-built graphs: patterns, guards,
commutative operands, the fixpoint driver and its bound."""

import numpy as np
import pytest

from pmx.compiler.ir import Graph, Node, Value
from pmx.compiler.rewrite import Any, In, Lit, N, V, apply_rules, match, rule
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
    g.kept = []
    return g


def hits(g):
    return sum(n for _, _, n in g.rule_hits)


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
        matches or (type(literal) is float and literal == 2.0))


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
    g.kept = [y]
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


@rule(N("elementwise", V(of=N("elementwise", name="p", expr=E.call("neg", X0)), sole=True), name="n",
        expr=E.call("neg", X0)))
def cancel_double_negation(graph, m):
    """neg(neg(x)) -> exp(log(x)), one pair at a time."""
    graph.remove_node(m.p)
    graph.set_input(m.n, 0, m.p.inputs[0])
    m.n.expr = E.call("exp", E.call("log", X0))
    return True


@rule(N("elementwise", expr=E.call("exp", X0), name="n"))
def exp_to_log(graph, m):
    """Undone by log_to_exp: together they never end."""
    m.n.expr = E.call("log", X0)
    return True


@rule(N("elementwise", expr=E.call("log", X0), name="n"))
def log_to_exp(graph, m):
    m.n.expr = E.call("exp", X0)
    return True


def test_driver_reaches_a_fixpoint_and_counts_hits():
    g = _chain(6)
    assert apply_rules(g, "cancel", [cancel_double_negation]) == 3
    assert g.rule_hits == [("cancel", "cancel_double_negation", 3)]
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

    @rule(N("elementwise", expr=E.call("add", In("a"), In("b"))))
    def record(graph, m):
        seen.append((m.a.name, m.b.name))  # and declines

    g, _ = _one_node(E.call("add", X0, X1))
    assert apply_rules(g, "decline", [record]) == 0
    assert seen == [("x0", "x1"), ("x1", "x0")] and g.rule_hits == [("decline", "record", 0)]
