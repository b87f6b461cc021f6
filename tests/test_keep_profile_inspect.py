"""--keep, run() on a subset of outputs, --profile, inspect (--json), --no-opt/--disable
and --verify naming the pass that broke the graph."""

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pmx.compiler import cli
from pmx.compiler import passes as P
from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession
from pmx.runtime.errors import PmxCompileError, PmxError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        a = F.relu(self.c1(x))
        b = torch.sigmoid(self.c2(a)) * a
        return self.fc(b.mean((2, 3))).softmax(-1)


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    m = Net().eval()
    x = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return m, x


@pytest.fixture(scope="module")
def prefix(exporter, net):
    return exporter("keep_net", *net[:1], (net[1],))


def _names(prefix):
    """pnnx's operand names: the conv outputs are the first two non-input operands."""
    from pmx.compiler import pnnx

    g = pnnx.load(prefix + ".pnnx.param", prefix + ".pnnx.bin")
    conv = [n for n in g.nodes if n.op == "nn.Conv2d"]
    relu = conv[0].outputs[0].consumers[0]
    return conv[0].outputs[0].name, relu.outputs[0].name


def test_keep_returns_intermediates_and_runs_only_needed_nodes(prefix, net, tmp_path):
    m, x = net
    conv_out, relu_out = _names(prefix)
    out = str(tmp_path / "k.pmx")
    assert (
        cli.main(["compile", prefix + ".pnnx.param", "-o", out, "--keep", conv_out, "--keep", relu_out, "--verify"])
        == 0
    )
    sess = InferenceSession(out)
    feed = {sess.get_inputs()[0].name: x.numpy()}
    with torch.no_grad():
        want_conv = m.c1(x).numpy()
        want_relu = F.relu(m.c1(x)).numpy()
        want_y = m(x).numpy()
    got_conv, got_relu = sess.run([conv_out, relu_out], feed)
    np.testing.assert_allclose(got_conv, want_conv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_relu, want_relu, rtol=1e-5, atol=1e-5)
    (y,) = sess.run(None, feed)
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-6)
    # kept tensors are not fused away: conv and relu stay separate nodes
    ops = [n.op for n in sess.model.nodes]
    assert ops.count("conv") == 2
    binding = sess._binding()
    assert len(sess._steps_for(binding, [sess._fetchable[conv_out]])) == 1
    assert len(sess._steps_for(binding, [sess._fetchable[relu_out]])) == 2
    assert len(sess._steps_for(binding, list(sess.model.outputs))) == len([s for s in binding.steps if s])
    # a fresh InferenceSession asked only for the kept tensor computes it without running the rest
    fresh = InferenceSession(out)
    (only,) = fresh.run([relu_out], feed)
    np.testing.assert_allclose(only, want_relu, rtol=1e-5, atol=1e-5)


def test_pmx_run_prints_and_saves_kept_tensors_and_inspect_lists_them(prefix, net, tmp_path, capsys):
    m, x = net
    conv_out, _ = _names(prefix)
    out = str(tmp_path / "k.pmx")
    assert cli.main(["compile", prefix + ".pnnx.param", "-o", out, "--keep", conv_out, "-q"]) == 0
    assert cli.main(["inspect", out]) == 0
    assert f"kept    {conv_out}" in capsys.readouterr().out
    np.save(tmp_path / "x.npy", x.numpy())
    saved = tmp_path / "saved"
    assert cli.main(["run", out, "--input", f"in0={tmp_path / 'x.npy'}", "--save", str(saved), "--repeat", "0"]) == 0
    assert f"{conv_out}: shape" in capsys.readouterr().out
    with torch.no_grad():
        np.testing.assert_allclose(np.load(saved / f"{conv_out}.npy"), m.c1(x).numpy(), rtol=1e-5, atol=1e-5)
    assert (saved / "out0.npy").exists()


def test_keep_unknown_name_is_an_error(prefix, tmp_path, capsys):
    assert cli.main(["compile", prefix + ".pnnx.param", "-o", str(tmp_path / "u.pmx"), "--keep", "nope"]) == 1
    assert "--keep nope" in capsys.readouterr().err


def test_profile_prints_nodes_by_time(prefix, tmp_path, capsys):
    out = str(tmp_path / "p.pmx")
    compile_model(prefix + ".pnnx.param", output=out)
    assert cli.main(["run", out, "--random", "--profile", "--repeat", "3", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    table = text[text.index("\nop ") + 1 :]
    lines = table.splitlines()[1:]
    rows = lines[: next(i for i, line in enumerate(lines) if line.startswith("run "))]
    sess = InferenceSession(out)
    assert len(rows) == len(sess.model.nodes)
    overhead = next(line for line in lines if line.startswith("run "))
    assert 0 <= float(overhead.split("framework overhead ")[1].split("%")[0]) <= 100
    ms = [float(line.split()[-2]) for line in rows]
    assert ms == sorted(ms, reverse=True)


def test_inspect_json_and_text(prefix, tmp_path, capsys):
    out = str(tmp_path / "i.pmx")
    r = compile_model(prefix + ".pnnx.param", output=out)
    assert cli.main(["inspect", out, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"nodes", "arena_bytes", "lower_bound_bytes", "naive_bytes"} <= set(info)
    assert info["nodes"] == r.ops_out
    assert info["arena_bytes"] == r.arena_bytes
    assert info["lower_bound_bytes"] == r.lower_bound_bytes
    assert info["naive_bytes"] == r.naive_bytes
    assert info["lower_bound_bytes"] <= info["arena_bytes"] <= info["naive_bytes"]
    names = [p["name"] for p in info["passes"]]
    assert names == [p.name for p in P.PIPELINE]
    fused = {p["name"]: (p["nodes_before"], p["nodes_after"]) for p in info["passes"]}
    assert fused["fuse_activation"][1] < fused["fuse_activation"][0]
    assert cli.main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "fuse_activation" in text and "lower bound" in text


def test_no_opt_and_disable(prefix, net, tmp_path, capsys):
    m, x = net
    results = {}
    for flag in ([], ["--no-opt"], ["--disable", "fuse_activation", "--disable", "write_inplace"]):
        out = str(tmp_path / f"n{len(results)}.pmx")
        assert cli.main(["compile", prefix + ".pnnx.param", "-o", out, "--verify", *flag]) == 0
        sess = InferenceSession(out)
        (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            np.testing.assert_allclose(y, m(x).numpy(), rtol=1e-4, atol=1e-6)
        results[" ".join(flag)] = sess.model
    assert len(results["--no-opt"].nodes) > len(results[""].nodes)
    assert len(results["--disable fuse_activation --disable write_inplace"].nodes) > len(results[""].nodes)
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:  # an unknown pass name is a usage error
        cli.main(["compile", prefix + ".pnnx.param", "-o", str(tmp_path / "x.pmx"), "--disable", "nonsense"])
    assert usage.value.code == 2 and "nonsense" in capsys.readouterr().err


def test_verify_names_the_pass_that_broke_the_graph(prefix, tmp_path, monkeypatch):
    def break_graph(graph, ctx):
        graph.remove_node(graph.nodes[1])  # its output is still read downstream
        return True

    pipeline = list(P.PIPELINE)
    pipeline.insert(5, P.Pass("break_graph", break_graph))
    monkeypatch.setattr(P, "PIPELINE", pipeline)
    with pytest.raises(PmxCompileError, match="after pass break_graph"):
        compile_model(prefix + ".pnnx.param", output=str(tmp_path / "b.pmx"), verify=True)


def test_verify_checks_aliases_after_each_pass(prefix, tmp_path, monkeypatch):
    def bad_alias(graph, ctx):
        x = graph.inputs[0]
        y = graph.nodes[0].outputs[0]
        ctx.aliases[x.uid] = (y, 0, None)  # x -> y -> x: a loop
        ctx.aliases[y.uid] = (x, 0, None)
        return True

    pipeline = list(P.PIPELINE)
    pipeline.insert(len(pipeline) - 1, P.Pass("bad_alias", bad_alias, keeps_nodes=True))
    monkeypatch.setattr(P, "PIPELINE", pipeline)
    with pytest.raises(PmxCompileError, match="alias check failed after pass bad_alias"):
        compile_model(prefix + ".pnnx.param", output=str(tmp_path / "a.pmx"), verify=True)


def test_a_misordered_pipeline_is_refused_naming_both_passes(monkeypatch):
    shipped = list(P.PIPELINE)
    pipeline = list(shipped)
    names = [p.name for p in pipeline]
    i, j = names.index("fuse_activation"), names.index("fuse_conv_batchnorm")
    pipeline[i], pipeline[j] = pipeline[j], pipeline[i]
    with pytest.raises(PmxError, match="pass fuse_activation must run after fuse_conv_batchnorm, but comes before it"):
        P.check_pipeline(pipeline)
    monkeypatch.setattr(P, "PIPELINE", pipeline)
    with pytest.raises(PmxError, match="fuse_activation must run after fuse_conv_batchnorm"):
        P.run_pipeline(None, None)  # refused before any pass runs
    late = list(shipped)
    late.insert(len(late) - 1, P.Pass("fold_again", P.fold_constants, optional=True, after=("order",)))
    with pytest.raises(PmxError, match="pass fold_again changes the node list after placement pass alias_views"):
        P.check_pipeline(late)
    with pytest.raises(PmxError, match="pass infer_shapes must follow canonicalize, which is not in the pipeline"):
        P.check_pipeline([p for p in shipped if p.name != "canonicalize"])


def test_every_ordering_comment_of_the_pipeline_is_a_constraint():
    """The pipeline as shipped passes its checks, and each pass but the first is tied to
    an earlier one, so no pass's place rests on a comment alone."""
    P.check_pipeline(P.PIPELINE)
    assert all(p.after for p in P.PIPELINE[1:])


def test_a_placement_pass_that_changes_the_nodes_is_refused(prefix, tmp_path, monkeypatch):
    def drop_last(graph, ctx):
        graph.remove_node(graph.nodes[-1])
        return True

    pipeline = list(P.PIPELINE)
    pipeline.insert(len(pipeline) - 1, P.Pass("drop_last", drop_last, keeps_nodes=True))
    monkeypatch.setattr(P, "PIPELINE", pipeline)
    with pytest.raises(PmxError, match="pass drop_last changed the node list"):
        compile_model(prefix + ".pnnx.param", output=str(tmp_path / "d.pmx"))


def test_framework_overhead_is_the_part_of_each_run_outside_the_kernels(prefix, tmp_path):
    from pmx.runtime.overhead import framework_overhead

    out = str(tmp_path / "o.pmx")
    compile_model(prefix + ".pnnx.param", output=out)
    sess = InferenceSession(out)
    feed = {
        i.name: np.random.default_rng(0).standard_normal([d or 1 for d in i.shape]).astype(np.float32)
        for i in sess.get_inputs()
    }
    got = framework_overhead(sess, feed, repeat=5)
    assert 0 < got.kernel_ms < got.wall_ms and 0 <= got.overhead < 1
    # a model with no node: every microsecond of a run is overhead
    (tmp_path / "z.pnnx.param").write_text("7767517\n2 1\npnnx.Input in 0 1 x #x=(2)f32\npnnx.Output out 1 0 x\n")
    (tmp_path / "z.pnnx.bin").write_bytes(b"")
    compile_model(str(tmp_path / "z.pnnx.param"), str(tmp_path / "z.pnnx.bin"), str(tmp_path / "z.pmx"))
    empty = framework_overhead(InferenceSession(str(tmp_path / "z.pmx")), {"in0": np.ones(2, np.float32)}, repeat=5)
    assert empty.kernel_ms == 0 and empty.overhead == 1.0


def test_keeping_a_size_list_is_refused_naming_it(tmp_path):
    """A size list of a dynamic-shape export becomes its reshape's target, not a tensor."""
    from paramgraph import write_lines

    from pmx.runtime import PmxCompileError

    lines = [
        "pnnx.Input in0 0 1 x #x=(?,8)f32",
        "pnnx.Expression sizes 1 1 x s expr=[size(@0,0),2,4] #x=(?,8)f32",
        "Tensor.reshape r 2 1 x s y $input=x $shape=s #x=(?,8)f32 #y=(?,2,4)f32",
        "pnnx.Output out 1 0 y",
    ]
    param = write_lines(tmp_path, lines)
    with pytest.raises(PmxCompileError, match=r"m\.pnnx\.param: --keep s: a list of sizes"):
        compile_model(str(param), output=str(tmp_path / "m.pmx"), keep=["s"])
