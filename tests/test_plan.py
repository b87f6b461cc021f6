"""The arena planner (runtime/plan.py) and the whole memory pipeline on random DAGs:
no two tensors alive at the same step share a byte, plans are deterministic, the arena
is never below the live-bytes lower bound, and random graphs with views, concats and
in-place writes compute what a plain numpy evaluation computes."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pmx.compiler.driver import compile_graph
from pmx.compiler.ir import Graph, Node, Value
from pmx.compiler.options import CompileOptions
from pmx.compiler.write import write
from pmx.runtime import InferenceSession
from pmx.runtime import expr as E
from pmx.runtime.plan import ALIGN, check_plan, lower_bound, plan_arena


@st.composite
def dag_buffers(draw):
    """Buffers from a random DAG: node i produces one tensor of random size, read by
    random later nodes; lifetime = producer step .. last reader (or the end)."""
    n = draw(st.integers(1, 40))
    sizes = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    last = list(range(n))
    for i in range(1, n):
        for j in draw(st.lists(st.integers(0, i - 1), max_size=3)):
            last[j] = max(last[j], i)
    for j in draw(st.lists(st.integers(0, n - 1), max_size=2)):  # graph outputs
        last[j] = n
    first = [-1 if draw(st.booleans()) and i == 0 else i for i in range(n)]
    return [(sizes[i], first[i], last[i]) for i in range(n)]


@settings(max_examples=150)
@given(dag_buffers())
def test_plan_never_overlaps_and_respects_lower_bound(buffers):
    offsets, arena = plan_arena(buffers)
    check_plan(buffers, offsets, arena)
    assert all(o % ALIGN == 0 for o in offsets)
    assert arena >= lower_bound(buffers)
    # brute force: every step, the live buffers' byte ranges are pairwise disjoint
    steps = {s for _, first, last in buffers for s in (first, last)}
    for s in steps:
        live = sorted((offsets[i], offsets[i] + b[0]) for i, b in enumerate(buffers) if b[1] <= s <= b[2] and b[0])
        for (_a0, a1), (b0, _b1) in itertools.pairwise(live):
            assert a1 <= b0


@settings(max_examples=50)
@given(dag_buffers())
def test_plan_is_deterministic(buffers):
    assert plan_arena(list(buffers)) == plan_arena(list(buffers))


@settings(max_examples=100)
@given(st.lists(st.tuples(st.integers(1, 1000), st.integers(0, 5)), min_size=1, max_size=12))
def test_chain_plans_to_lower_bound(items):
    """A chain (each tensor read only by the next node) needs two buffers at a time; the
    planner reaches the bound when sizes only grow or only shrink."""
    sizes = sorted(s for s, _ in items)
    buffers = [(s, i, i + 1) for i, s in enumerate(sizes)]
    _, arena = plan_arena(buffers)
    assert arena == lower_bound(buffers)


def test_checker_catches_overlap_and_out_of_arena():
    buffers = [(100, 0, 2), (100, 1, 3), (100, 4, 5)]
    with pytest.raises(AssertionError, match="overlap"):
        check_plan(buffers, [0, 64, 0], 256)
    with pytest.raises(AssertionError, match="outside"):
        check_plan(buffers, [0, 128, 0], 200)
    check_plan(buffers, [0, 128, 0], 256)  # disjoint in time may share bytes


# --- random graphs through the whole pipeline ------------------------------------------

UNARY = ["maximum(@0,0)", "tanh(@0)", "mul(@0,1.5)", "add(@0,-0.25)"]
BINARY = ["add(@0,@1)", "mul(@0,@1)", "sub(@0,@1)"]


def _eval(expr, args):
    a = args
    table = {
        "maximum(@0,0)": lambda: np.maximum(a[0], 0),
        "tanh(@0)": lambda: np.tanh(a[0]),
        "mul(@0,1.5)": lambda: a[0] * np.float32(1.5),
        "add(@0,-0.25)": lambda: a[0] + np.float32(-0.25),
        "add(@0,@1)": lambda: a[0] + a[1],
        "mul(@0,@1)": lambda: a[0] * a[1],
        "sub(@0,@1)": lambda: a[0] - a[1],
    }
    return table[expr]().astype(np.float32)


@st.composite
def random_graph(draw):
    """A random DAG of elementwise ops, reshapes and channel concats on (1, C, 4) tensors
    (batch 1, so concats alias), with random graph outputs; returns (graph, reference
    function feed -> outputs)."""
    g = Graph("random")
    x = Value("x", (1, 2, 4))
    g.inputs = [x]
    values = [x]
    steps = []
    n = draw(st.integers(1, 14))
    for i in range(n):
        kind = draw(st.sampled_from(["unary", "binary", "reshape", "concat"]))
        a = draw(st.sampled_from(values))
        if kind == "binary":
            same = [v for v in values if v.shape == a.shape]
            b = draw(st.sampled_from(same))
            expr = draw(st.sampled_from(BINARY))
            out = Value(f"v{i}", a.shape)
            g.add_node(Node("elementwise", f"n{i}", [a, b], [out], expr=E.parse(expr)))
            steps.append(("ew", expr, [a, b], out))
        elif kind == "unary":
            expr = draw(st.sampled_from(UNARY))
            out = Value(f"v{i}", a.shape)
            g.add_node(Node("elementwise", f"n{i}", [a], [out], expr=E.parse(expr)))
            steps.append(("ew", expr, [a], out))
        elif kind == "reshape":
            shape = (1, a.shape[1] * a.shape[2] // 4, 4) if a.shape[2] != 4 else (1, a.shape[1] * 2, 2)
            out = Value(f"v{i}", shape)
            g.add_node(Node("reshape", f"n{i}", [a], [out], dict(shape=shape)))
            steps.append(("reshape", None, [a], out))
        else:
            same = [v for v in values if v.shape[2] == a.shape[2]]
            parts = draw(st.lists(st.sampled_from(same), min_size=1, max_size=3))
            shape = (1, sum(p.shape[1] for p in parts), a.shape[2])
            out = Value(f"v{i}", shape)
            g.add_node(Node("concat", f"n{i}", parts, [out], dict(axis=1)))
            steps.append(("concat", None, parts, out))
        values.append(out)
    outs = draw(st.lists(st.sampled_from(values[1:]), min_size=1, max_size=3, unique_by=lambda v: v.uid))
    g.outputs = outs

    def reference(feed):
        env = {x.uid: feed}
        for kind, expr, ins, out in steps:
            args = [env[v.uid] for v in ins]
            if kind == "ew":
                env[out.uid] = _eval(expr, args)
            elif kind == "reshape":
                env[out.uid] = args[0].reshape(out.shape)
            else:
                env[out.uid] = np.concatenate(args, axis=1)
        return [env[v.uid] for v in outs]

    return g, reference


@settings(max_examples=40)
@given(random_graph(), st.booleans())
def test_random_graphs_run_correctly(tmp_path_factory, case, keep_one):
    g, reference = case
    keep = [g.nodes[0].outputs[0].name] if keep_one else []
    options = CompileOptions(verify=True, keep=keep)
    plan = compile_graph(g, options)
    buffers_ok = plan.arena_size >= plan.lower_bound
    assert buffers_ok
    path = tmp_path_factory.mktemp("rg") / "g.pmx"
    write(g, plan, options, str(path))
    sess = InferenceSession(str(path), verify=True)
    feed = np.random.default_rng(0).standard_normal((1, 2, 4)).astype(np.float32)
    got = sess.run(None, {"x": feed})
    for a, b in zip(got, reference(feed)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    got2 = sess.run(None, {"x": feed})  # the arena is reused: a second run is the same
    for a, b in zip(got, got2):
        np.testing.assert_array_equal(a, b)
