"""Options in, a Plan out (compiler/options.py, compiler/plan.py): a compile leaves the
Graph's own fields alone, the options cannot change under the passes, the writer stores
exactly the Plan it is given and refuses to write without one or with a stale one, and
pmx compile and pmx inspect count the unplanned sum the same way."""

import pathlib

import numpy as np
import pytest

from pmx.compiler.driver import compile_graph, compile_model
from pmx.compiler.ir import Graph, Node, Value
from pmx.compiler.options import CompileOptions
from pmx.compiler.passes import PIPELINE
from pmx.compiler.plan import Plan
from pmx.compiler.write import write
from pmx.runtime import InferenceSession
from pmx.runtime import expr as E
from pmx.runtime.cli import inspect_dict
from pmx.runtime.errors import PmxInternalError
from pmx.runtime.load import open_model

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"


def chain():
    """x -> exp -> reshape -> (tanh, neg) -> concat: a view, a concat and an in-place
    candidate, so every placement pass has something to place."""
    g = Graph("chain")
    x, a, b, c, d, y = (
        Value(n, s)
        for n, s in (("x", (2, 6)), ("a", (2, 6)), ("b", (4, 3)), ("c", (4, 3)), ("d", (4, 3)), ("y", (8, 3)))
    )
    g.inputs = [x]
    g.add_node(Node("elementwise", "exp", [x], [a], expr=E.call("exp", E.at(0))))
    g.add_node(Node("reshape", "view", [a], [b], attrs={"shape": (4, 3)}))
    g.add_node(Node("elementwise", "tanh", [b], [c], expr=E.call("tanh", E.at(0))))
    g.add_node(Node("elementwise", "neg", [b], [d], expr=E.call("neg", E.at(0))))
    g.add_node(Node("concat", "cat", [c, d], [y], attrs={"axis": 0}))
    g.outputs = [y]
    return g


def test_a_compile_sets_nothing_on_the_graph():
    g = chain()
    fields = set(vars(g))
    plan = compile_graph(g, CompileOptions(keep=["b"], verify=True, metadata={"k": "v"}))
    assert set(vars(g)) == fields == {"nodes", "_members", "inputs", "outputs", "kept", "source"}
    assert [v.name for v in g.kept] == ["b"]
    assert isinstance(plan, Plan)
    assert [name for name, _, _ in plan.pass_stats] == [p.name for p in PIPELINE]


def test_options_cannot_change_under_the_passes():
    dynamic, metadata = {"in0": {0: (1, 8)}}, {"k": "v"}
    options = CompileOptions(keep=["a"], disabled=["tune"], dynamic=dynamic, metadata=metadata)
    dynamic["in0"][0] = (1, 2)
    metadata["k"] = "w"
    assert options.dynamic["in0"][0] == (1, 8) and options.metadata["k"] == "v"
    assert options.keep == ("a",) and options.disabled == frozenset({"tune"})
    with pytest.raises(AttributeError):
        options.tune = True
    with pytest.raises(TypeError):
        options.dynamic["in0"][1] = (1, 4)
    with pytest.raises(TypeError):
        options.metadata["k"] = "w"


def test_the_file_stores_the_plan(tmp_path):
    g = chain()
    options = CompileOptions(metadata={"k": "v"})
    plan = compile_graph(g, options)
    assert plan.aliases, "the view and the concat inputs are aliased"
    path = tmp_path / "chain.pmx"
    write(g, plan, options, str(path))
    model = open_model(str(path))
    assert model.arena_size == plan.arena_size
    assert [n.name for n in model.nodes] == [n.name for n in plan.order]
    assert model.pass_stats == list(plan.pass_stats)
    assert dict(model.metadata) == {"k": "v"}
    index = {v.uid: i for i, v in enumerate(g.values())}
    for v in g.values():
        t = model.tensors[index[v.uid]]
        if v.uid in plan.aliases:
            target, offset, _ = plan.aliases[v.uid]
            assert (t.alias_of, t.alias_offset) == (index[target.uid], offset)
        elif not v.is_constant:
            assert t.arena_offset == plan.offsets[v.uid]
    x = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)
    (y,) = InferenceSession(str(path)).run(None, {"x": x})
    b = np.exp(x).reshape(4, 3)
    np.testing.assert_allclose(y, np.concatenate([np.tanh(b), -b]), rtol=1e-6)


def test_the_writer_refuses_to_write_without_a_plan_or_with_a_stale_one(tmp_path):
    g = chain()
    options = CompileOptions()
    plan = compile_graph(g, options)
    path = tmp_path / "refused.pmx"
    with pytest.raises(PmxInternalError, match="write\\(\\) needs the Plan the pipeline returned, got NoneType"):
        write(g, None, options, str(path))
    with pytest.raises(PmxInternalError, match="the plan orders other nodes than the graph has"):
        write(g, plan.replace(order=plan.order[1:]), options, str(path))
    with pytest.raises(PmxInternalError, match="tensor x has neither an arena offset nor an alias in the plan"):
        write(g, plan.replace(offsets={}), options, str(path))
    assert not path.exists() and not list(tmp_path.iterdir())


def test_compile_and_inspect_count_the_unplanned_sum_alike(tmp_path):
    """One definition (runtime/plan.py naive_bytes), with views, in-place writes and a kept
    tensor in the model."""
    out = str(tmp_path / "cnn.pmx")
    r = compile_model(str(EXAMPLE) + ".pnnx.param", output=out, keep=["18"])
    info = inspect_dict(open_model(out))
    assert info["kept"] == ["18"]
    assert info["naive_bytes"] == r.naive_bytes > info["arena_bytes"] == r.arena_bytes
