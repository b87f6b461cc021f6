"""Reshapes whose target a dynamic-shape export computes from tensor sizes.

pnnx exported with a second input shape writes `B, N, D = x.shape; y.reshape(B, N, 4, 16)`
as a size list, `pnnx.Expression expr=[size(@0,0),size(@0,1),4,16]`, read by the reshape.
pmx gives the reshape the tensors the sizes read as inputs (attr like_shape, one code per
target entry), so the target follows those tensors exactly at any size: compiled without
--shape, the '?' dims stay dynamic and each run re-plans at its own shape. Torch, run at
each shape, is the oracle."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers import export_pnnx, rel_error, torch_outputs

from pmx.compiler import compile_model, pnnx
from pmx.compiler.driver import compile_graph
from pmx.compiler.options import CompileOptions
from pmx.compiler.write import write
from pmx.runtime import InferenceSession, PmxCompileError, PmxFormatError, PmxInputError
from pmx.runtime import fileformat as ff

SIZES = [(1, 8), (3, 5), (2, 1)]


class SplitHeads(nn.Module):
    """The pattern of the report: a linear, then its features split into 4 heads of 16."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        return self.l(x).reshape(b, n, 4, 16).sum(-1)


class ViewHeads(SplitHeads):
    def forward(self, x):
        b, n, _ = x.shape
        return self.l(x).view(b, n, -1, 16).sum(-1)


class SelfAttention(nn.Module):
    """Multi-head self-attention written out: every reshape reads B, N and D of x."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        h = self.heads

        def split(t):
            return t.reshape(b, n, h, d // h).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        a = torch.softmax(q @ k.transpose(-2, -1) * (d // h) ** -0.5, dim=-1)
        return self.o((a @ v).transpose(1, 2).reshape(b, n, d))


class FlattenTokens(SplitHeads):
    """y.reshape(y.size(0), -1): the sizes come from the reshape's own input."""

    def forward(self, x):
        y = self.l(x)
        return y.reshape(y.size(0), -1)


class MergeTokens(nn.Module):
    """x.reshape(B, N * D): pnnx writes the product as mul(size(@0,1),64)."""

    def forward(self, x):
        b, n, d = x.shape
        return torch.relu(x.reshape(b, n * d))


class SizesOfTwo(nn.Module):
    """The batch from one input, the length from the other."""

    def forward(self, x, mask):
        return x.reshape(x.shape[0], mask.shape[1], -1).sum(-1) * mask


MODULES = {
    "split_heads": (SplitHeads, [(1, 8, 64)], [(2, 5, 64)]),
    "view_heads": (ViewHeads, [(1, 8, 64)], [(2, 5, 64)]),
    "attention": (SelfAttention, [(1, 8, 64)], [(2, 5, 64)]),
    "flatten_tokens": (FlattenTokens, [(1, 8, 64)], [(2, 5, 64)]),
    "merge_tokens": (MergeTokens, [(1, 8, 64)], [(2, 5, 64)]),
    "sizes_of_two": (SizesOfTwo, [(1, 8, 6), (1, 8)], [(2, 5, 6), (2, 5)]),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (module, path prefix of its '?'-dim export), exported once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cls, first, second = MODULES[name]
            torch.manual_seed(0)
            module = cls().eval()
            inputs = [torch.rand(*s) for s in first], [torch.rand(*s) for s in second]
            prefix = export_pnnx(tmp_path_factory.mktemp(name), module, *inputs)
            with open(prefix + ".pnnx.param") as f:
                assert "size(@0,0)" in f.read(), f"{name}: pnnx wrote no size list"
            cache[name] = module, prefix
        return cache[name]

    return get


def _compiled(exported, name, tmp_path, **kwargs):
    module, prefix = exported(name)
    path = tmp_path / f"{name}.pmx"
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(path), verify=True, **kwargs)
    return module, path, InferenceSession(str(path), verify=True)


def _matches_torch(sess, module, shapes):
    inputs = tuple(torch.rand(*s) for s in shapes)
    got = sess.run(None, {arg.name: x.numpy() for arg, x in zip(sess.get_inputs(), inputs)})
    want = torch_outputs(module, inputs)
    assert [g.shape for g in got] == [w.shape for w in want], shapes
    assert max(rel_error(g, w) for g, w in zip(got, want)) <= 1e-4, shapes


@pytest.mark.parametrize("name", ["split_heads", "view_heads", "attention", "flatten_tokens", "merge_tokens"])
def test_compiles_without_shape_and_runs_at_any_size(exported, tmp_path, name):
    module, path, sess = _compiled(exported, name, tmp_path)
    assert sess.get_inputs()[0].shape == [None, None, 64]
    for b, n in SIZES:
        _matches_torch(sess, module, [(b, n, 64)])
    # a runtime that would ignore the like inputs must refuse the file (fileformat.py)
    assert ff.unpack_preamble(path.read_bytes()[: ff.PREAMBLE_SIZE])["version"] == 3


def test_sizes_read_from_two_tensors(exported, tmp_path):
    module, _, sess = _compiled(exported, "sizes_of_two", tmp_path)
    for b, n in SIZES:
        _matches_torch(sess, module, [(b, n, 6), (b, n)])
    with pytest.raises(PmxInputError, match=r"Tensor\.reshape"):  # torch refuses these sizes too
        sess.run(None, {"in0": np.zeros((2, 5, 6), np.float32), "in1": np.zeros((2, 4), np.float32)})


def test_the_shape_the_message_advised_works(exported, tmp_path):
    """--shape in0=1x8x64 fixes both '?' dims; a range keeps them dynamic within it."""
    module, _, sess = _compiled(exported, "split_heads", tmp_path, shape="in0=1x8x64")
    assert sess.get_inputs()[0].shape == [1, 8, 64]
    _matches_torch(sess, module, [(1, 8, 64)])
    module, _, sess = _compiled(exported, "split_heads", tmp_path, shape="in0=1..4x1..16x64")
    for b, n in SIZES:
        _matches_torch(sess, module, [(b, n, 64)])
    with pytest.raises(PmxInputError, match=r"1\.\.16"):
        sess.run(None, {"in0": np.zeros((1, 17, 64), np.float32)})


def _compiled_graph(exported, name):
    _, prefix = exported(name)
    graph = pnnx.load(prefix + ".pnnx.param", prefix + ".pnnx.bin")
    options = CompileOptions()
    return graph, compile_graph(graph, options), options


def test_the_target_follows_the_sizes_exactly(exported):
    """mark_dynamic_dims leaves the target alone (no dyn_shape guess): it copies dims 0 and 1
    of the tensor the sizes read and keeps 4 and 16."""
    graph, _, _ = _compiled_graph(exported, "split_heads")
    (reshape,) = [n for n in graph.nodes if n.op == "reshape"]
    assert reshape.attrs["like_shape"] == (-2, -3, 4, 16) and "dyn_shape" not in reshape.attrs
    assert reshape.inputs[1] is graph.inputs[0]


def _forged(compiled, tmp_path, like_shape):
    """The compiled graph written with the reshape's like_shape replaced, as a forger would."""
    graph, plan, options = compiled
    j, node = next((j, n) for j, n in enumerate(graph.nodes) if n.op == "reshape")
    saved = node.attrs["like_shape"]
    node.attrs["like_shape"] = like_shape
    try:
        path = tmp_path / "forged.pmx"
        write(graph, plan, options, str(path), check_loads=False)
    finally:
        node.attrs["like_shape"] = saved
    return path, j


def test_like_codes_past_the_like_tensors_dims_are_refused_at_load(exported, tmp_path):
    compiled = _compiled_graph(exported, "split_heads")
    path, j = _forged(compiled, tmp_path, (-5, -3, 4, 16))  # the like tensor has 3 dims: -2..-4
    with pytest.raises(PmxFormatError, match=rf"node {j} \(reshape .*attribute 'like_shape' is \(-5, -3, 4, 16\)"):
        InferenceSession(str(path))


def test_like_codes_that_lose_elements_are_refused_at_load(exported, tmp_path):
    compiled = _compiled_graph(exported, "split_heads")
    path, j = _forged(compiled, tmp_path, (-2, -3, 4, 8))
    with pytest.raises(PmxFormatError, match=rf"node {j} .*cannot reshape"):
        InferenceSession(str(path))


# --- size lists pmx cannot follow: refused naming the node and the entry -----------------


def _compile_text(tmp_path, expr, out_shape):
    """A reshape of x (2, 5, 8) to the size list `expr`, as pnnx writes it."""
    import zipfile

    lines = [
        "pnnx.Input in0 0 1 x #x=(2,5,8)f32",
        f"pnnx.Expression sizes 1 1 x s expr={expr} #x=(2,5,8)f32",
        f"Tensor.reshape r 2 1 x s y $input=x $shape=s #x=(2,5,8)f32 #y={out_shape}f32",
        "pnnx.Output out 1 0 y",
    ]
    (tmp_path / "m.pnnx.param").write_text("\n".join(["7767517", "4 3", *lines]) + "\n")
    with zipfile.ZipFile(tmp_path / "m.pnnx.bin", "w"):
        pass
    compile_model(str(tmp_path / "m.pnnx.param"), output=str(tmp_path / "m.pmx"), verify=True)
    return InferenceSession(str(tmp_path / "m.pmx"))


@pytest.mark.parametrize(
    "expr, message",
    [
        ("[size(@0,0),-1,mul(size(@0,1),2)]", "entries '-1', 'mul(size(@0,1),2)' all need inferring"),
        ("[size(@0,0),@0]", "entry '@0' is not an int, size(@k,dim) or arithmetic on those"),
        ("[size(@0,0),size(@0,3),8]", "entry 'size(@0,3)' reads dim 3 of a rank-3 tensor"),
        ("[size(@0,0),-2,8]", "entry '-2' is not a size"),
        ("[size(@0,0),7,8]", "cannot reshape (2, 5, 8) (80 elements) to (2, 7, 8)"),
    ],
)
def test_size_lists_pmx_cannot_follow_name_node_and_entry(tmp_path, expr, message):
    with pytest.raises(PmxCompileError) as e:
        _compile_text(tmp_path, expr, "(2,5,8)")
    assert "Tensor.reshape 'r'" in str(e.value) and message in str(e.value), str(e.value)


def test_a_computed_entry_is_inferred(tmp_path):
    sess = _compile_text(tmp_path, "[size(@0,0),mul(size(@0,1),size(@0,2))]", "(2,40)")
    x = np.arange(80, dtype=np.float32).reshape(2, 5, 8)
    np.testing.assert_array_equal(sess.run(None, {"in0": x})[0], x.reshape(2, 40))
    np.testing.assert_array_equal(sess.run(None, {"in0": x[:1]})[0], x[:1].reshape(1, 40))


# Reshapes whose targets are numbers, as pnnx writes them (hand-written .param lines), where
# a planned size coincides with a literal: a '?' planned at 1, or a batch traced at 1.
# Each case: lines, the torch function they compute, and input shapes to run (the '?'
# dims and the default batch dynamic).
COINCIDING = {
    "tokens_back": (
        [
            "pnnx.Input in0 0 1 x #x=(?,2,4)f32",
            "Tensor.reshape r0 1 1 x a shape=(-1,4) $input=x #x=(?,2,4)f32 #a=(?,4)f32",
            "F.relu relu 1 1 a b $input=a #a=(?,4)f32 #b=(?,4)f32",
            "Tensor.reshape r1 1 1 b c shape=(-1,2,4) $input=b #b=(?,4)f32 #c=(?,2,4)f32",
            "pnnx.Output out 1 0 c",
        ],
        lambda x: x.reshape(-1, 4).relu().reshape(-1, 2, 4),
        [(4, 2, 4), (3, 2, 4), (1, 2, 4)],
    ),
    "unsqueeze_then_sum": (
        [
            "pnnx.Input in0 0 1 x #x=(?,3)f32",
            "torch.unsqueeze u 1 1 x a dim=0 $input=x #x=(?,3)f32 #a=(1,?,3)f32",
            "torch.sum s 1 1 a b dim=(1) keepdim=False $input=a #a=(1,?,3)f32 #b=(1,3)f32",
            "pnnx.Output out 1 0 b",
        ],
        lambda x: x[None].sum(1),
        [(1, 3), (3, 3)],
    ),
    "flatten_then_pairs": (
        [
            "pnnx.Input in0 0 1 x #x=(?,2)f32",
            "torch.flatten f 1 1 x a end_dim=-1 start_dim=0 $input=x #x=(?,2)f32 #a=(?)f32",
            "Tensor.reshape r 1 1 a b shape=(-1,2) $input=a #a=(?)f32 #b=(?,2)f32",
            "pnnx.Output out 1 0 b",
        ],
        lambda x: x.flatten().view(-1, 2),
        [(2, 2), (3, 2), (1, 2)],
    ),
    "gpt2_conv1d_at_batch_1": (  # B, T, C = x.shape; lin(x.view(-1, C)).view(B, T, C), traced at B = 1
        [
            "pnnx.Input in0 0 1 x #x=(1,2,4)f32",
            "Tensor.reshape r0 1 1 x a shape=(2,4) $input=x #x=(1,2,4)f32 #a=(2,4)f32",
            "pnnx.Expression e 1 1 a b expr=mul(@0,3) #a=(2,4)f32 #b=(2,4)f32",
            "Tensor.reshape r1 1 1 b c shape=(1,2,4) $input=b #b=(2,4)f32 #c=(1,2,4)f32",
            "pnnx.Output out 1 0 c",
        ],
        lambda x: (x.reshape(-1, 4) * 3).reshape(x.shape[0], 2, 4),
        [(1, 2, 4), (3, 2, 4)],
    ),
}


@pytest.mark.parametrize("name", sorted(COINCIDING))
def test_a_size_that_coincides_with_a_literal_is_not_taken_for_it(tmp_path, name):
    from paramgraph import compile_lines

    lines, fn, shapes = COINCIDING[name]
    sess = compile_lines(tmp_path, lines)
    for shape in shapes:
        x = torch.rand(*shape)
        (got,) = sess.run(None, {"in0": x.numpy()})
        want = fn(x).numpy()
        assert got.shape == want.shape, shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_batch_merged_with_another_dynamic_dim_is_fixed_not_guessed(tmp_path):
    """x.view(-1, C) ... view(B, T, 32) of a fixed-shape export, with T asked dynamic: the
    merged B * T cannot be split back into both, so the default batch is fixed (a note
    names the reshape) and T follows; before, B's growth went into T."""
    from paramgraph import write_lines

    lines = [
        "pnnx.Input in0 0 1 x #x=(1,8,16)f32",
        "Tensor.reshape r0 1 1 x a shape=(8,16) $input=x #x=(1,8,16)f32 #a=(8,16)f32",
        "pnnx.Expression e 1 1 a b expr=mul(@0,2) #a=(8,16)f32 #b=(8,16)f32",
        "Tensor.reshape r1 1 1 b c shape=(1,8,16) $input=b #b=(8,16)f32 #c=(1,8,16)f32",
        "pnnx.Output out 1 0 c",
    ]
    result = compile_model(str(write_lines(tmp_path, lines)), output=str(tmp_path / "m.pmx"), dynamic="in0:1")
    assert result.dynamic["in0"] == [(1, 1), (1, -1), (16, 16)]
    assert any(
        "in0 dim 0 fixed: reshape 'r1'" in n and "cannot follow in0:0, in0:1 together" in n for n in result.notes
    )
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    x = torch.rand(1, 13, 16)
    np.testing.assert_allclose(sess.run(None, {"in0": x.numpy()})[0], (x * 2).numpy(), rtol=1e-6)
    with pytest.raises(PmxInputError, match=r"expected shape \[1, 1\.\., 16\]"):
        sess.run(None, {"in0": torch.rand(2, 8, 16).numpy()})
