"""The rewrite engine: local rewrites are rules, a small pattern graph plus a rewrite
function, kept in tables and run to a fixpoint by one worklist driver (as tinygrad's
PatternMatcher and graph_rewrite, and pnnx's GraphRewriterPass).

A node pattern `N` gives the op (or ops), patterns for the node's inputs, output and
expression tree, and a guard. A value pattern `V` carries the guards every rule needs as
flags (constant, dtype kind, sole reader, not a graph output or kept) and optionally the
pattern of the value's producer. An expression pattern is a tree (runtime/expr/tree.py) whose
leaves may capture an input (`In`), any subtree (`Any`) or a literal of given types
(`Lit`); a plain literal matches by type and value (1, 1.0 and True are different
literals), and calls of commutative functions are tried with their operands both ways.

A match is a `Match` of captures by name. The rewrite function gets the graph and the
match, edits through the Graph's methods and returns True; a falsy return declines, and
the next match is tried.
"""

from collections import defaultdict, deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from pmx.compiler.ir import Node
from pmx.runtime import expr as E
from pmx.runtime.errors import PmxInternalError

COMMUTATIVE = E.names_with("commutative")


class Match(dict):
    """Captures by name, also readable as attributes (m.conv)."""

    __getattr__ = dict.__getitem__


class V(NamedTuple):
    """A value: guards as flags; `of` is the pattern its producer must match."""

    name: str | None = None
    of: "N | None" = None
    const: bool | None = None  # constant (True) or computed (False)
    kind: str | None = None  # numpy dtype kind, e.g. "f"
    sole: bool = False  # read by the matched reader only; not a graph output or kept
    internal: bool = False  # not a graph output or kept
    opt: bool = False  # may be absent (None, or past the node's inputs)
    where: Callable | None = None  # further guard on the value


class N:
    """A node: op (a name or a tuple of names), patterns of its first inputs (None: any),
    `some`: a pattern one of its inputs must match (tried in order), `out`: its output's
    pattern, `expr`: its expression's pattern, `arity`: its exact number of inputs,
    `outs`: of outputs (None: any), `where(node, match)`: a guard on the rest."""

    __slots__ = ("arity", "expr", "inputs", "name", "ops", "out", "outs", "some", "where")

    def __init__(self, op, *inputs, some=None, out=None, expr=None, name=None, arity=None, outs=1, where=None):
        self.ops = (op,) if isinstance(op, str) else tuple(op)
        self.inputs, self.some, self.out, self.expr = inputs, some, out, expr
        self.name, self.arity, self.outs, self.where = name, arity, outs, where


def In(name, value=None):
    """Expression leaf: an input, its Value captured as `name` and matched by `value`."""
    return ("@?", name, value)


def Any(name):
    """Expression leaf: any subtree, captured as `name`."""
    return ("*?", name)


def Lit(*values):
    """Expression leaf: a literal equal in type and value to one of `values`."""
    return ("#?", values)


class Rule(NamedTuple):
    name: str
    pattern: N
    rewrite: Callable


def rewrite_rule(pattern):
    """Decorator: the function is the rewrite of a rule matching `pattern`."""
    return lambda fn: Rule(fn.__name__, pattern, fn)


# --- matching: every way a pattern matches, as a list of Matches, so that a failed guard
# or a declined rewrite moves on to the next


def _bind(m, name, x):
    if name is None:
        return m
    if name in m:
        same = m[name] is x or (isinstance(x, tuple) and _same_tree(m[name], x))
        return m if same else None
    m = Match(m)
    m[name] = x
    return m


def _same_literal(a, b):
    """One type and one value, exactly: 1, 1.0 and True differ, so do 0.0 and -0.0."""
    return type(a) is type(b) and repr(a) == repr(b)


def _same_tree(a, b):
    """Expression trees equal node by node, their literals by _same_literal."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return _same_literal(a, b)


def _may_match(p, node):
    """The cheap part of a node pattern (op, counts, the ops of input producers, the
    expression's root), where most candidates fail."""
    if node is None or node.op not in p.ops:
        return False
    if (p.arity is not None and len(node.inputs) != p.arity) or (p.outs is not None and len(node.outputs) != p.outs):
        return False
    for i, q in enumerate(p.inputs):
        v = node.inputs[i] if i < len(node.inputs) else None
        if q is not None and (
            (v is None and not q.opt)
            or (v is not None and q.of is not None and (v.producer is None or v.producer.op not in q.of.ops))
        ):
            return False
    return p.expr is None or (node.expr is not None and (p.expr[0] in _LEAVES or node.expr[0] == p.expr[0]))


_LEAVES = ("@?", "*?", "#?", "#", "@")


def match_node(graph, p, node, m):
    """Every Match of node pattern p at `node` extending m, as a list (usually of one)."""
    if not _may_match(p, node):
        return []
    ms = [_bind(m, p.name, node)]
    for i, q in enumerate(p.inputs):
        if q is not None:
            v = node.inputs[i] if i < len(node.inputs) else None
            ms = [m2 for m1 in ms for m2 in match_value(graph, q, v, node, m1)]
    if p.some is not None:
        ms = [m2 for m1 in ms for v in node.inputs for m2 in match_value(graph, p.some, v, node, m1)]
    if p.out is not None:
        ms = [m2 for m1 in ms for m2 in match_value(graph, p.out, node.outputs[0], None, m1)]
    if p.expr is not None:
        ms = [m2 for m1 in ms for m2 in match_tree(graph, p.expr, node.expr, node, m1)]
    return [m1 for m1 in ms if p.where(node, m1)] if p.where is not None else ms


def match_value(graph, p, v, reader, m):
    """Every Match of value pattern p at v (read by `reader`) extending m."""
    if p is None:
        return [m]
    if v is None:
        return [m] if p.opt and (m := _bind(m, p.name, None)) is not None else []
    if (
        (p.of is not None and (v.producer is None or v.producer.op not in p.of.ops))
        or (p.const is not None and v.is_constant != p.const)
        or (p.kind and np.dtype(v.dtype).kind not in p.kind)
        or (p.sole and graph.sole_reader(v) is not reader)
        or (p.internal and (v in graph.outputs or v in graph.kept))
        or (p.where is not None and not p.where(v))
        or (m := _bind(m, p.name, v)) is None
    ):
        return []
    return [m] if p.of is None else match_node(graph, p.of, v.producer, m)


def match_tree(graph, p, t, node, m):
    """Every Match of expression pattern p at tree t (of `node`) extending m."""
    head = p[0]
    if head == "@?":
        if t[0] != "@" or t[1] >= len(node.inputs):
            return []
        v = node.inputs[t[1]]
        return [m2 for m1 in match_value(graph, p[2], v, node, m) if (m2 := _bind(m1, p[1], v)) is not None]
    if head == "*?":
        return [m] if (m := _bind(m, p[1], t)) is not None else []
    if head in ("#?", "#"):
        return [m] if t[0] == "#" and any(_same_literal(t[1], x) for x in (p[1] if head == "#?" else p[1:])) else []
    if head == "@":
        return [m] if t == p else []
    if t[0] != head or len(t) != len(p):
        return []
    out = []
    for args in [t[1:]] + ([t[:0:-1]] if head in COMMUTATIVE and len(t) == 3 else []):
        ms = [m]
        for q, a in zip(p[1:], args):
            ms = [m2 for m1 in ms for m2 in match_tree(graph, q, a, node, m1)]
        out += ms
    return out


def match(graph, pattern, node):
    """The first Match of `pattern` anchored at `node`, else None."""
    return next(iter(match_node(graph, pattern, node, Match())), None)


def fits(graph, pattern, value, reader=None):
    """Whether `value`, read by `reader`, matches the value pattern."""
    return bool(match_value(graph, pattern, value, reader, Match()))


# --- the driver -------------------------------------------------------------------------


def apply_rules(graph, name, rules, max_hits=None):
    """Run `rules` over the graph until none fires: every node is tried once, in order; a
    node where a rule fired is tried again at once, and the matched nodes' neighbours are
    queued again. Returns {rule name: hits}. More than `max_hits` hits (default: 16 per
    node) means a rule undoes another: PmxInternalError."""
    by_op = defaultdict(list)
    for r in rules:
        for op in r.pattern.ops:
            by_op[op].append(r)
    hits = dict.fromkeys((r.name for r in rules), 0)
    budget = max_hits if max_hits is not None else 16 * len(graph.nodes) + 64
    queue = deque(n for n in graph.nodes if n.op in by_op)
    queued = {n.uid for n in queue}
    total = 0
    while queue:
        node = queue.popleft()
        queued.discard(node.uid)
        while graph.has_node(node):
            fired = _fire(graph, by_op.get(node.op, ()), node)
            if fired is None:
                break
            r, m = fired
            hits[r.name] += 1
            total += 1
            if total > budget:
                raise PmxInternalError(
                    f"rule set {name} did not reach a fixpoint in {budget} rewrites "
                    f"(rule {r.name} keeps firing, last at {node.where()})"
                )
            touched = [node] + [x for x in m.values() if isinstance(x, Node) and x is not node]
            for x in touched:
                if graph.has_node(x):
                    for y in [v.producer for v in x.inputs if v is not None] + [
                        c for v in x.outputs for c in v.consumers
                    ]:
                        if y is not None and y is not node and y.uid not in queued and y.op in by_op:
                            queue.append(y)
                            queued.add(y.uid)
    return hits


def _fire(graph, rules, node):
    for r in rules:
        for m in match_node(graph, r.pattern, node, Match()):
            if r.rewrite(graph, m):
                return r, m
    return None


def rule_pass(name, rules):
    """A pipeline pass that runs `rules` to a fixpoint and records their hits in the
    compile's context."""

    def run(graph, ctx):
        hits = apply_rules(graph, name, rules)
        ctx.rule_hits.extend((name, r, n) for r, n in hits.items())

    run.__name__ = run.__qualname__ = name
    run.rules = tuple(rules)
    return run
