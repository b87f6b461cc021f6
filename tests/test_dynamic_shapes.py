"""Inputs of other shapes than the one the model was exported with: compile once, run
other batch sizes and image sizes, compare with torch run at those shapes."""

import json
import pathlib

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import rel_error, torch_outputs
from hypothesis import given, settings
from hypothesis import strategies as st

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession, PmxCompileError, PmxInputError


class FullyConv(nn.Module):
    """Residual + SE + global pool: takes any batch and any image size >= 8."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.se = nn.Linear(16, 16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        y = y + F.hardswish(self.c2(y))
        s = torch.sigmoid(self.se(y.mean((2, 3))))
        y = y * s.view(y.shape[0], 16, 1, 1)
        y = F.max_pool2d(y, 2, ceil_mode=True)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


class FlattenHead(nn.Module):
    """view(1, -1) before a Linear: the batch follows, the spatial size is fixed."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        y = F.relu(self.c(x))
        return self.fc(y.reshape(y.shape[0], -1))


class TokenMixer(nn.Module):
    """A transformer block on a fixed number of tokens: batch is dynamic."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, n, 3, 4, 4).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1)
        y = (a @ v).transpose(1, 2).reshape(b, n, c)
        return x + self.proj(y)


@pytest.fixture(scope="module")
def compiled(exporter, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("dyn")
    cache = {}

    def get(name, module, example, **kwargs):
        key = (name, repr(sorted(kwargs.items())))
        if key not in cache:
            torch.manual_seed(0)
            prefix = exporter(f"dyn_{name}", module, (example,))
            path = out_dir / f"{name}_{len(cache)}.pmx"
            compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(path), verify=True, **kwargs)
            cache[key] = InferenceSession(str(path))
        return cache[key]

    return get


def _check(sess, module, x, tol=1e-4):
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    want = torch_outputs(module, (x,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert rel_error(g, w) <= tol


MODELS = {}


def model(name):
    if name not in MODELS:
        torch.manual_seed(0)
        MODELS[name] = {"fullyconv": FullyConv, "flatten": FlattenHead, "tokens": TokenMixer}[name]().eval()
    return MODELS[name]


def test_batch_is_dynamic_by_default(compiled):
    m = model("fullyconv")
    sess = compiled("fullyconv", m, torch.rand(1, 3, 32, 32))
    assert sess.get_inputs()[0].shape == [None, 3, 32, 32]
    for batch in (1, 2, 5):
        _check(sess, m, torch.rand(batch, 3, 32, 32))


def test_spatial_dims_on_request(compiled):
    m = model("fullyconv")
    sess = compiled("fullyconv", m, torch.rand(1, 3, 32, 32), dynamic={"in0": {0: (1, -1), 2: (8, 512), 3: (8, 512)}})
    assert sess.get_inputs()[0].shape == [None, 3, None, None]
    for shape in ((1, 3, 32, 32), (2, 3, 48, 40), (3, 3, 17, 65), (1, 3, 8, 8)):
        _check(sess, m, torch.rand(*shape))


def test_plan_is_cached_per_shape(exporter, tmp_path):
    """One plan per input shape, made at its first run. Batches run whole here: in
    chunks (the default with several threads where pmx's own BLAS runs on one), a batch
    of 3 runs as chunks of 2 and 1 rows, shapes other batches planned already."""
    from pmx.runtime import SessionOptions

    prefix = exporter("dyn_fullyconv", model("fullyconv"), (torch.rand(1, 3, 32, 32),))
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "m.pmx"))
    options = SessionOptions()
    options.add_session_config_entry("pmx.batch_chunk_rows", "0")
    sess = InferenceSession(str(tmp_path / "m.pmx"), options)
    x = np.random.rand(4, 3, 32, 32).astype(np.float32)
    sess.run(None, {"in0": x})
    plans = sess.plans_built
    sess.run(None, {"in0": x})
    assert sess.plans_built == plans
    sess.run(None, {"in0": x[:3]})
    assert sess.plans_built == plans + 1


def test_flatten_follows_batch(compiled):
    m = model("flatten")
    sess = compiled("flatten", m, torch.rand(1, 3, 8, 8))
    for batch in (1, 2, 5):
        _check(sess, m, torch.rand(batch, 3, 8, 8))
    with pytest.raises(PmxInputError) as e:
        sess.run(None, {"in0": np.zeros((1, 3, 9, 9), np.float32)})
    msg = str(e.value)
    assert "in0" in msg and "[1, 3, 9, 9]" in msg and "3, 8, 8" in msg


def test_explicit_dynamic_dim_the_model_cannot_take_fails_compile(exporter, tmp_path):
    m = model("flatten")
    prefix = exporter("dyn_flatten", m, (torch.rand(1, 3, 8, 8),))
    with pytest.raises(PmxCompileError) as e:
        compile_model(
            prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "m.pmx"), dynamic={"in0": {2: (4, 64)}}
        )
    assert "in0" in str(e.value)


def test_transformer_block_batch(compiled):
    m = model("tokens")
    sess = compiled("tokens", m, torch.rand(1, 6, 16))
    for batch in (1, 2, 5):
        _check(sess, m, torch.rand(batch, 6, 16))


def test_range_is_enforced(compiled):
    m = model("fullyconv")
    sess = compiled("fullyconv", m, torch.rand(1, 3, 32, 32), dynamic={"in0": {0: (1, 4)}})
    _check(sess, m, torch.rand(4, 3, 32, 32))
    with pytest.raises(PmxInputError) as e:
        sess.run(None, {"in0": np.zeros((5, 3, 32, 32), np.float32)})
    assert "1..4" in str(e.value)


def test_static_flag_keeps_compiled_shape_only(compiled):
    m = model("fullyconv")
    sess = compiled("fullyconv", m, torch.rand(1, 3, 32, 32), auto_batch=False)
    assert sess.get_inputs()[0].shape == [1, 3, 32, 32]
    with pytest.raises(PmxInputError):
        sess.run(None, {"in0": np.zeros((2, 3, 32, 32), np.float32)})


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 4), h=st.integers(8, 40), w=st.integers(8, 40))
def test_random_allowed_shapes(compiled, batch, h, w):
    m = model("fullyconv")
    sess = compiled("fullyconv", m, torch.rand(1, 3, 32, 32), dynamic={"in0": {0: (1, -1), 2: (8, 512), 3: (8, 512)}})
    _check(sess, m, torch.rand(batch, 3, h, w))


def test_threads_with_different_shapes(compiled):
    import threading

    m = model("fullyconv")
    sess = compiled("fullyconv", m, torch.rand(1, 3, 32, 32), dynamic={"in0": {0: (1, -1), 2: (8, 512), 3: (8, 512)}})
    xs = [np.random.rand(b, 3, s, s).astype(np.float32) for b, s in ((1, 32), (2, 24), (3, 40), (1, 16))]
    expected = [sess.run(None, {"in0": x})[0] for x in xs]
    errors = []

    def work(k):
        for _ in range(5):
            for i in range(len(xs)):
                j = (i + k) % len(xs)
                if not np.array_equal(sess.run(None, {"in0": xs[j]})[0], expected[j]):
                    errors.append(j)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_cli_shape_ranges_and_static(exporter, tmp_path, capsys):
    from pmx.compiler.cli import main

    prefix = exporter("dyn_fullyconv", model("fullyconv"), (torch.rand(1, 3, 32, 32),))
    out = tmp_path / "m.pmx"
    assert main(["compile", prefix + ".pnnx.param", "-o", str(out), "--shape", "in0=1..8x3x16..64x?"]) == 0
    assert "in0 takes [1..8, 3, 16..64, 1..]" in capsys.readouterr().out
    assert InferenceSession(str(out)).get_inputs()[0].shape == [None, 3, None, None]
    assert main(["compile", prefix + ".pnnx.param", "-o", str(out), "--static"]) == 0
    assert InferenceSession(str(out)).get_inputs()[0].shape == [1, 3, 32, 32]
    with pytest.raises(SystemExit) as usage:  # a malformed value is a usage error
        main(["compile", prefix + ".pnnx.param", "-o", str(out), "--shape", "in0=0..8x3x32x32"])
    assert usage.value.code == 2 and "--shape" in capsys.readouterr().err
    assert main(["compile", prefix + ".pnnx.param", "-o", str(out), "--dynamic", "in9:0"]) == 1
    assert "in9" in capsys.readouterr().err


def test_compile_reports_fixed_dims(exporter, tmp_path, capsys):
    """A view that freezes the batch: the compile says which dim is fixed and why."""
    from pmx.compiler.cli import main

    class FrozenBatch(nn.Module):
        def forward(self, x):
            return x.view(3, 64).sum(0)

    prefix = exporter("dyn_frozen", FrozenBatch(), (torch.rand(1, 12, 4, 4),))
    out = tmp_path / "m.pmx"
    assert main(["compile", prefix + ".pnnx.param", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "in0 dim 0 fixed" in text and "reshape" in text and "line" in text
    assert InferenceSession(str(out)).get_inputs()[0].shape == [1, 12, 4, 4]


def _blocks():
    import test_e2e_cnn_blocks as cnn
    import test_e2e_transformers as tr

    def bn(cls):
        return lambda: cnn.randomize_bn(cls())

    def seeded(cls):
        return lambda: tr._seeded(cls())

    return {
        # name: (module factory, compiled example shape, extra shapes to run)
        "residual": (bn(cnn.Residual), (1, 4, 16, 16), [(2, 4, 16, 16), (5, 4, 16, 16)]),
        "depthwise_separable": (bn(cnn.DepthwiseSeparable), (1, 6, 12, 12), [(2, 6, 12, 12), (5, 6, 12, 12)]),
        "squeeze_excite": (bn(cnn.SqueezeExcite), (1, 8, 9, 9), [(2, 8, 9, 9), (5, 8, 9, 9)]),
        "shuffle_unit": (bn(cnn.ShuffleUnit), (1, 16, 8, 8), [(2, 16, 8, 8), (5, 16, 8, 8)]),
        "dense_block": (bn(cnn.DenseBlock), (1, 8, 10, 10), [(2, 8, 10, 10), (5, 8, 10, 10)]),
        "inception": (bn(cnn.Inception), (1, 8, 15, 15), [(2, 8, 15, 15), (5, 8, 15, 15)]),
        "mobilenet_v3_block": (bn(cnn.MobileNetV3Block), (1, 8, 16, 16), [(2, 8, 16, 16), (5, 8, 16, 16)]),
        "mbconv": (bn(cnn.MBConv), (1, 8, 10, 10), [(2, 8, 10, 10), (5, 8, 10, 10)]),
        "regnet_block": (bn(cnn.RegNetBlock), (1, 8, 14, 14), [(2, 8, 14, 14), (5, 8, 14, 14)]),
        "vit": (seeded(tr.ViT), (1, 3, 16, 16), [(2, 3, 16, 16), (5, 3, 16, 16)]),
        "convnext": (seeded(tr.ConvNeXtBlock), (1, 16, 9, 9), [(2, 16, 9, 9), (5, 16, 9, 9)]),
        "swin": (seeded(tr.SwinBlock), (1, 8, 8, 16), [(2, 8, 8, 16), (5, 8, 8, 16)]),
    }


@pytest.mark.parametrize("name", list(_blocks()))
def test_suite_blocks_at_other_batch_sizes(name, compiled):
    """The test-suite CNN and transformer blocks, compiled at batch 1, run at 1, 2 and 5."""
    factory, shape, others = _blocks()[name]
    torch.manual_seed(0)
    m = factory().eval()
    sess = compiled(f"block_{name}", m, torch.rand(*shape))
    assert sess.get_inputs()[0].shape[0] is None, f"{name}: batch should be dynamic"
    for s in [shape] + others:
        _check(sess, m, torch.rand(*s))


@pytest.mark.parametrize(
    "name,spatial",
    [
        ("residual", [(2, 4, 20, 24), (1, 4, 9, 31)]),
        ("dense_block", [(1, 8, 14, 12), (3, 8, 6, 6)]),
        ("mbconv", [(2, 8, 13, 7)]),
        ("convnext", [(1, 16, 12, 7), (2, 16, 5, 5)]),
    ],
)
def test_suite_blocks_at_other_image_sizes(name, spatial, compiled):
    factory, shape, _ = _blocks()[name]
    torch.manual_seed(0)
    m = factory().eval()
    sess = compiled(f"block_{name}", m, torch.rand(*shape), dynamic={"in0": {2: (4, 64), 3: (4, 64)}})
    assert sess.get_inputs()[0].shape == [None, shape[1], None, None]
    for s in spatial:
        _check(sess, m, torch.rand(*s))


class ChunkPool(nn.Module):
    """chunk + cat + pool + mean + view(x.size(0), -1): what pnnx writes with '?' dims."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = F.relu(self.c(x))
        a, b = torch.chunk(y, 2, 1)
        y = F.max_pool2d(torch.cat([b, a], 1), 2).mean((2, 3))
        return self.fc(torch.flatten(y.view(y.size(0), -1), 1))


@pytest.fixture(scope="module")
def question_mark_export(tmp_path_factory):
    """Exported with pnnx's second input shape, so the .param has '?' dims."""
    import contextlib
    import io
    import os

    import pnnx

    d = tmp_path_factory.mktemp("qdims")
    torch.manual_seed(0)
    m = ChunkPool().eval()
    cwd = os.getcwd()
    os.chdir(d)
    try:
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            pnnx.export(m, str(d / "model.pt"), (torch.rand(1, 3, 16, 16),), (torch.rand(2, 3, 24, 20),))
    finally:
        os.chdir(cwd)
    param = (d / "model.pnnx.param").read_text()
    assert "(?,3,?,?)" in param
    return m, str(d / "model")


def test_question_mark_dims_compile_with_a_planning_shape(question_mark_export, tmp_path):
    m, prefix = question_mark_export
    out = tmp_path / "q.pmx"
    compile_model(
        prefix + ".pnnx.param",
        prefix + ".pnnx.bin",
        str(out),
        verify=True,
        plan_shapes={"in0": (1, 3, 16, 16)},
        dynamic={"in0": {2: (8, 256), 3: (8, 256)}},
    )
    sess = InferenceSession(str(out))
    assert sess.get_inputs()[0].shape == [None, 3, None, None]
    for shape in ((1, 3, 16, 16), (2, 3, 24, 20), (3, 3, 9, 33)):
        _check(sess, m, torch.rand(*shape))


def test_question_mark_dims_with_static_and_no_planning_shape_say_how(question_mark_export, tmp_path):
    """--static promises the planned shapes, so a '?' dim needs a size there."""
    _, prefix = question_mark_export
    with pytest.raises(PmxCompileError) as e:
        compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "q.pmx"), auto_batch=False)
    assert "in0" in str(e.value) and "?x3x?x?" in str(e.value) and "--shape" in str(e.value)


@settings(max_examples=6, deadline=None)
@given(
    name=st.sampled_from(["residual", "dense_block", "mbconv", "convnext"]),
    batch=st.integers(1, 3),
    h=st.integers(6, 24),
    w=st.integers(6, 24),
)
def test_random_allowed_shapes_on_suite_blocks(compiled, name, batch, h, w):
    factory, shape, _ = _blocks()[name]
    torch.manual_seed(0)
    m = MODELS.get(f"block_{name}") or MODELS.setdefault(f"block_{name}", factory().eval())
    sess = compiled(f"block_{name}", m, torch.rand(*shape), dynamic={"in0": {2: (4, 64), 3: (4, 64)}})
    _check(sess, m, torch.rand(batch, shape[1], h, w))


@settings(max_examples=6, deadline=None)
@given(name=st.sampled_from(["vit", "swin", "regnet_block", "shuffle_unit"]), batch=st.integers(1, 6))
def test_random_batches_on_suite_blocks(compiled, name, batch):
    factory, shape, _ = _blocks()[name]
    torch.manual_seed(0)
    m = MODELS.get(f"block_{name}") or MODELS.setdefault(f"block_{name}", factory().eval())
    sess = compiled(f"block_{name}", m, torch.rand(*shape))
    _check(sess, m, torch.rand(batch, *shape[1:]))


# --- '?' dims without --shape: planned at a placeholder, dynamic, re-planned at run --------


def _export_at_two_shapes(directory, module, first, second):
    """pnnx.export with a second example input: the dims that differ are written '?'."""
    import contextlib
    import io
    import os

    import pnnx

    cwd = os.getcwd()
    os.chdir(directory)
    try:
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            pnnx.export(module, str(directory / "model.pt"), (first,), (second,))
    finally:
        os.chdir(cwd)
    return str(directory / "model")


class SeqMixer(nn.Module):
    """A conv and self-attention over a sequence of any length."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.ln = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        y = self.conv(x.transpose(1, 2)).transpose(1, 2)
        q, k, v = self.qkv(self.ln(y)).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(1, 2) * 0.25, -1)
        return self.out((a @ v + y).mean(1)), a @ v


class WidePool(nn.Module):
    """A 100x100 pool: the first placeholder size (64) is too small for it, 224 fits."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return F.avg_pool2d(F.relu(self.c(x)), 100, stride=10).flatten(1)


class WinogradPair(nn.Module):
    """Two 3x3 convs with 64 channels: at the placeholder size the rule picks Winograd."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(64, 64, 3, padding=1)
        self.b = nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x):
        return self.b(F.relu(self.a(x))) + x


@pytest.fixture(scope="module")
def two_shape_exports(tmp_path_factory):
    """name -> (module, prefix) of exports with '?' dims."""
    out = {}
    for name, cls, first, second, marker in [
        ("seq", SeqMixer, (1, 6, 16), (1, 9, 16), "(1,?,16)"),
        ("widepool", WidePool, (1, 3, 120, 120), (2, 3, 130, 140), "(?,3,?,?)"),
        ("winograd", WinogradPair, (1, 64, 12, 12), (1, 64, 10, 14), "(1,64,?,?)"),
    ]:
        torch.manual_seed(0)
        module = cls().eval()
        prefix = _export_at_two_shapes(tmp_path_factory.mktemp(name), module, torch.rand(*first), torch.rand(*second))
        with open(prefix + ".pnnx.param") as f:
            assert marker in f.read(), name
        out[name] = (module, prefix)
    return out


def _compile_without_shape(prefix, path, **kwargs):
    return compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(path), verify=True, **kwargs)


def test_question_mark_dims_compile_without_a_shape_and_run_at_other_shapes(question_mark_export, tmp_path):
    m, prefix = question_mark_export
    result = _compile_without_shape(prefix, tmp_path / "q.pmx")
    assert result.dynamic["in0"] == [(1, -1), (3, 3), (1, -1), (1, -1)]
    assert any("in0 dims 0, 2, 3 are '?'" in n and "placeholder" in n and "first run" in n for n in result.notes)
    sess = InferenceSession(str(tmp_path / "q.pmx"))
    assert sess.get_inputs()[0].shape == [None, 3, None, None]
    for shape in ((1, 3, 16, 16), (2, 3, 24, 20), (3, 3, 9, 33), (1, 3, 64, 64)):
        _check(sess, m, torch.rand(*shape))


def test_a_question_mark_sequence_length_compiles_without_a_shape(two_shape_exports, tmp_path):
    m, prefix = two_shape_exports["seq"]
    result = _compile_without_shape(prefix, tmp_path / "s.pmx")
    assert any("in0 dim 1 is '?'" in n for n in result.notes), result.notes
    sess = InferenceSession(str(tmp_path / "s.pmx"))
    assert sess.get_inputs()[0].shape == [None, None, 16]
    for shape in ((1, 6, 16), (1, 9, 16), (2, 1, 16), (1, 100, 16)):
        _check(sess, m, torch.rand(*shape))


def test_the_placeholder_falls_back_to_a_size_the_whole_graph_takes(two_shape_exports, tmp_path):
    m, prefix = two_shape_exports["widepool"]
    result = _compile_without_shape(prefix, tmp_path / "w.pmx")
    assert any("[1, 3, 224, 224]" in n for n in result.notes), result.notes  # 64 is smaller than the pool
    sess = InferenceSession(str(tmp_path / "w.pmx"))
    for shape in ((1, 3, 120, 120), (2, 3, 130, 140)):
        _check(sess, m, torch.rand(*shape))


def test_run_random_feeds_the_planned_shape_of_dynamic_dims(two_shape_exports, tmp_path, capsys):
    """pmx run --random: 1 for a '?' dim would be too small for the pool; the planned
    (placeholder) size fits."""
    from pmx.compiler.cli import main

    _, prefix = two_shape_exports["widepool"]
    _compile_without_shape(prefix, tmp_path / "w.pmx")
    assert main(["run", str(tmp_path / "w.pmx"), "--random", "--repeat", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"][0]["shape"] == [1, 3, 224, 224]


def test_kernels_chosen_at_the_placeholder_serve_other_shapes(two_shape_exports, tmp_path):
    m, prefix = two_shape_exports["winograd"]
    _compile_without_shape(prefix, tmp_path / "g.pmx")
    sess = InferenceSession(str(tmp_path / "g.pmx"))
    assert any(n.op == "conv_winograd" for n in sess.model.nodes)
    for shape in ((1, 64, 12, 12), (2, 64, 5, 7), (1, 64, 1, 1), (1, 64, 33, 40)):
        _check(sess, m, torch.rand(*shape))


def test_cli_says_question_mark_dims_are_dynamic_and_static_refuses(question_mark_export, tmp_path, capsys):
    from pmx.compiler.cli import main

    _, prefix = question_mark_export
    out = tmp_path / "q.pmx"
    assert main(["compile", prefix + ".pnnx.param", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "in0 takes [1.., 3, 1.., 1..]" in text and "placeholder" in text and "first run" in text
    assert main(["compile", prefix + ".pnnx.param", "-o", str(out), "--static"]) == 1
    err = capsys.readouterr().err
    assert "in0" in err and "?x3x?x?" in err and "--shape in0=" in err
    assert main(["compile", prefix + ".pnnx.param", "-o", str(out), "--static", "--shape", "in0=2x3x20x24"]) == 0
    assert InferenceSession(str(out)).get_inputs()[0].shape == [2, 3, 20, 24]


def test_a_fixed_size_on_a_question_mark_dim_fixes_it(question_mark_export, tmp_path, capsys):
    from pmx.compiler.cli import main

    m, prefix = question_mark_export
    out = tmp_path / "q.pmx"
    assert main(["compile", prefix + ".pnnx.param", "-o", str(out), "--shape", "in0=?x3x16x16"]) == 0
    assert "in0 takes [1.., 3, 16, 16]" in capsys.readouterr().out
    sess = InferenceSession(str(out))
    _check(sess, m, torch.rand(2, 3, 16, 16))
    with pytest.raises(PmxInputError):
        sess.run(None, {"in0": np.zeros((1, 3, 24, 24), np.float32)})


# --- --shape checked against the export ------------------------------------------------


@pytest.mark.parametrize(
    "spec,why",
    [
        ("in0=1..16x3x224x224", "fixes dim 2 at 224"),
        ("in0=1x4x32x32", "fixes dim 1 at 4"),
        ("in0=1x3x32", "has rank 3, not 4"),
        ("in0=1x3x32x32x1", "has rank 5, not 4"),
        ("in0=2..16x3x32x32", "allows 2..16 in dim 0, without its exported size 1"),
        ("in0=1x3x40..64x32", "allows 40..64 in dim 2, without its exported size 32"),
    ],
)
def test_a_shape_contradicting_the_export_is_refused_naming_both(exporter, tmp_path, capsys, spec, why):
    from pmx.compiler.cli import main

    prefix = exporter("dyn_fullyconv", model("fullyconv"), (torch.rand(1, 3, 32, 32),))
    assert main(["compile", prefix + ".pnnx.param", "-o", str(tmp_path / "m.pmx"), "--shape", spec]) == 1
    err = capsys.readouterr().err
    assert "input in0 was exported as [1, 3, 32, 32]" in err and spec.split("=")[1] in err and why in err, err
    assert not (tmp_path / "m.pmx").exists()


def test_a_shape_for_an_input_the_model_lacks_is_refused_naming_the_inputs(exporter, tmp_path, capsys):
    from pmx.compiler.cli import main

    prefix = exporter("dyn_fullyconv", model("fullyconv"), (torch.rand(1, 3, 32, 32),))
    assert main(["compile", prefix + ".pnnx.param", "-o", str(tmp_path / "m.pmx"), "--shape", "in5=1x3x32x32"]) == 1
    err = capsys.readouterr().err
    assert "'in5'" in err and "in0 [1, 3, 32, 32]" in err


def test_a_shape_agreeing_with_the_export_is_accepted(exporter, tmp_path, capsys):
    """A range containing the exported size opens the dim; the exported size fixes it."""
    from pmx.compiler.cli import main

    prefix = exporter("dyn_fullyconv", model("fullyconv"), (torch.rand(1, 3, 32, 32),))
    out = tmp_path / "m.pmx"
    for spec, takes, shape in [
        ("in0=1..16x3x32x32", "[1..16, 3, 32, 32]", [None, 3, 32, 32]),
        ("in0=1x3x32x32", None, [1, 3, 32, 32]),  # the batch too: nothing dynamic
        ("in0=?x3x8..32x32..", "[1.., 3, 8..32, 32..]", [None, 3, None, None]),
    ]:
        assert main(["compile", prefix + ".pnnx.param", "-o", str(out), "--shape", spec]) == 0
        text = capsys.readouterr().out
        assert (f"in0 takes {takes}" in text) if takes else ("in0 takes" not in text), text
        assert InferenceSession(str(out)).get_inputs()[0].shape == shape


def test_a_dynamic_range_without_the_exported_size_is_refused_from_python(exporter, tmp_path):
    prefix = exporter("dyn_fullyconv", model("fullyconv"), (torch.rand(1, 3, 32, 32),))
    with pytest.raises(PmxCompileError, match=r"in0 was exported as \[1, 3, 32, 32\].*40\.\.64 in dim 2"):
        compile_model(
            prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "m.pmx"), dynamic={"in0": {2: (40, 64)}}
        )


class TallPool(nn.Module):
    """Needs at least 600 rows: more than any placeholder size."""

    def forward(self, x):
        return F.avg_pool2d(x, (600, 1), stride=1)


def test_no_placeholder_fitting_says_to_give_a_shape(tmp_path):
    torch.manual_seed(0)
    m = TallPool().eval()
    prefix = _export_at_two_shapes(tmp_path, m, torch.rand(1, 1, 600, 6), torch.rand(1, 1, 610, 9))
    with pytest.raises(PmxCompileError, match=r"none of the sizes tried fits.*--shape in0=1x1x<n>x<n>"):
        _compile_without_shape(prefix, tmp_path / "p.pmx")
    _compile_without_shape(prefix, tmp_path / "p.pmx", plan_shapes={"in0": (1, 1, 600, 6)})
    _check(InferenceSession(str(tmp_path / "p.pmx")), m, torch.rand(1, 1, 612, 7))


def test_a_requested_dim_a_node_cannot_follow_names_the_node(tmp_path):
    """--dynamic in0:1 on a linear layer's features: the compile fails naming the layer and
    its .param line, and without the request the batch alone stays dynamic."""
    from ziputil import write_bin

    param = tmp_path / "m.pnnx.param"
    param.write_text(
        "7767517\n3 2\n"
        "pnnx.Input               pnnx_input_0             0 1 0 #0=(1,8)f32\n"
        "nn.Linear                fc                       1 1 0 1 bias=True in_features=8 out_features=4 "
        "@bias=(4)f32 @weight=(4,8)f32 #0=(1,8)f32 #1=(1,4)f32\n"
        "pnnx.Output              pnnx_output_0            1 0 1 #1=(1,4)f32\n"
    )
    write_bin(
        str(tmp_path / "m.pnnx.bin"), {"fc.weight": np.ones((4, 8), np.float32), "fc.bias": np.zeros(4, np.float32)}
    )
    with pytest.raises(PmxCompileError, match=r"dynamic dims in0:1 cannot change: .*'fc' \(line 4\)"):
        compile_model(str(param), output=str(tmp_path / "m.pmx"), dynamic="in0:1")
    result = compile_model(str(param), output=str(tmp_path / "m.pmx"))
    assert result.dynamic == {"in0": [(1, -1), (8, 8)]}


def test_a_map_smaller_than_a_conv_kernel_is_refused_naming_the_conv(tmp_path):
    """'?' spatial dims take any size 1..; a size leaving a conv no output position (torch
    refuses it too) is a PmxInputError naming the conv, not an internal error at bind."""
    from ziputil import write_bin

    param = tmp_path / "m.pnnx.param"
    param.write_text(
        "7767517\n3 2\n"
        "pnnx.Input               pnnx_input_0             0 1 0 #0=(1,3,?,?)f32\n"
        "nn.Conv2d                conv                     1 1 0 1 bias=True dilation=(1,1) groups=1 "
        "in_channels=3 kernel_size=(3,3) out_channels=8 padding=(0,0) padding_mode=zeros stride=(1,1) "
        "@bias=(8)f32 @weight=(8,3,3,3)f32 #0=(1,3,?,?)f32 #1=(1,8,?,?)f32\n"
        "pnnx.Output              pnnx_output_0            1 0 1 #1=(1,8,?,?)f32\n"
    )
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((8, 3, 3, 3)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    write_bin(str(tmp_path / "m.pnnx.bin"), {"conv.weight": w, "conv.bias": b})
    compile_model(str(param), output=str(tmp_path / "m.pmx"))
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    x = rng.standard_normal((1, 3, 5, 4)).astype(np.float32)
    (got,) = sess.run(None, {"in0": x})
    want = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(PmxInputError, match=r"'conv'.*too small for kernel \(3, 3\)"):
        sess.run(None, {"in0": np.zeros((1, 3, 2, 5), np.float32)})


@pytest.mark.parametrize(
    "line",
    [
        "nn.MaxPool2d             pool                     1 1 0 1 ceil_mode=False dilation=(1,1) kernel_size=(3,3) "
        "padding=(0,0) return_indices=False stride=(2,2) #0=(1,3,?,?)f32 #1=(1,3,?,?)f32",
        "nn.AvgPool2d             pool                     1 1 0 1 ceil_mode=False count_include_pad=True "
        "divisor_override=None kernel_size=(3,3) padding=(0,0) stride=(2,2) #0=(1,3,?,?)f32 #1=(1,3,?,?)f32",
    ],
)
def test_a_map_smaller_than_a_pool_window_is_refused_as_torch_refuses_it(tmp_path, line):
    """torch raises "Output size is too small" where a pool has no output position; pmx
    returned an empty array."""
    from ziputil import write_bin

    (tmp_path / "m.pnnx.param").write_text(
        "7767517\n3 2\npnnx.Input               pnnx_input_0             0 1 0 #0=(1,3,?,?)f32\n"
        f"{line}\npnnx.Output              pnnx_output_0            1 0 1 #1=(1,3,?,?)f32\n"
    )
    write_bin(str(tmp_path / "m.pnnx.bin"), {})
    compile_model(str(tmp_path / "m.pnnx.param"), output=str(tmp_path / "m.pmx"))
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    x = torch.rand(1, 3, 2, 2)
    with pytest.raises(RuntimeError):
        (F.max_pool2d if "Max" in line else F.avg_pool2d)(x, 3, 2)
    with pytest.raises(PmxInputError, match=r"'pool'.*too small for window \(3, 3\)"):
        sess.run(None, {"in0": x.numpy()})
    assert sess.run(None, {"in0": np.zeros((1, 3, 3, 3), np.float32)})[0].shape == (1, 3, 1, 1)


class FilledFromSizes(nn.Module):
    """Tensors made from the input's sizes (a mask, a buffer), as a dynamic-shape export
    writes them: zeros/ones/full with `[size(@0,0),size(@0,1),...]`."""

    def forward(self, x):
        b, n, _ = x.shape
        return x.new_zeros(b, n, 2) + x[..., :2], torch.ones(b, n) * 3, torch.full((b, 4), 2.5)


def test_tensors_made_from_dynamic_sizes_follow_them(tmp_path):
    from helpers import export_pnnx

    m = FilledFromSizes().eval()
    prefix = export_pnnx(tmp_path, m, (torch.rand(1, 8, 64),), (torch.rand(2, 5, 64),))
    compile_model(prefix + ".pnnx.param", output=str(tmp_path / "m.pmx"))
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    for shape in [(1, 8, 64), (3, 5, 64), (2, 1, 64)]:
        x = torch.rand(*shape)
        got = sess.run(None, {"in0": x.numpy()})
        for g, w in zip(got, torch_outputs(m, (x,))):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


class PositionsSlicedToLength(nn.Module):
    """A learned position table cut to the sequence length (ViT, GPT-2): pnnx's
    dynamic-shape export writes the slice's end as size(@0,1)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.rand(1, 32, 16))

    def forward(self, x):
        return x + self.pos[:, : x.size(1)]


def test_a_slice_ending_at_a_dynamic_size_follows_it(tmp_path):
    from helpers import export_pnnx

    m = PositionsSlicedToLength().eval()
    prefix = export_pnnx(tmp_path, m, (torch.rand(1, 8, 16),), (torch.rand(2, 5, 16),))
    compile_model(prefix + ".pnnx.param", output=str(tmp_path / "m.pmx"), shape="in0=1..x1..32x16")
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    for shape in [(1, 8, 16), (3, 5, 16), (2, 32, 16), (1, 1, 16)]:  # batch 3: the add broadcasts over the slice
        x = torch.rand(*shape)
        (got,) = sess.run(None, {"in0": x.numpy()})
        np.testing.assert_allclose(got, torch_outputs(m, (x,))[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(PmxInputError, match=r"1\.\.32"):
        sess.run(None, {"in0": np.zeros((1, 40, 16), np.float32)})


def test_a_slice_end_following_a_dim_past_its_like_input_is_refused():
    from pmx.compiler.ir import Node
    from pmx.runtime.kernels.shape import slice_infer

    attrs = dict(axes=(1,), starts=(0,), ends=(2**31 - 1,), steps=(1,), end_dims=(3,))
    node = Node("slice", "s", attrs=attrs)
    with pytest.raises(ValueError, match=r"end_dims \(3,\) name a dim past input 1"):
        slice_infer(node, [(1, 32, 16), (1, 8, 16)], [np.float32, np.float32])
    node.attrs["end_dims"] = (1,)
    assert slice_infer(node, [(1, 32, 16), (1, 8, 16)], [np.float32, np.float32])[0][0] == (1, 8, 16)


class SumReshapedAndHalved(nn.Module):
    """pnnx's own test_pnnx_input_npy 'input2' case: two '?'-dim inputs, a reshape to
    [size(@0,0), -1] and a slice ending at size(@0,2) // 2."""

    def forward(self, x, y):
        z = x + y
        return z.reshape(z.size(0), -1), z[:, :, : z.size(2) // 2] * 2


def test_pnnx_input2_case_compiles_without_shape_and_matches_torch(tmp_path):
    from helpers import export_pnnx

    m = SumReshapedAndHalved().eval()
    prefix = export_pnnx(
        tmp_path, m, (torch.rand(1, 2, 6), torch.rand(1, 2, 6)), (torch.rand(1, 3, 8), torch.rand(1, 3, 8))
    )
    compile_model(prefix + ".pnnx.param", output=str(tmp_path / "m.pmx"))
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    for shape in [(1, 2, 6), (1, 3, 8), (1, 5, 7), (2, 4, 3)]:
        x, y = torch.rand(*shape), torch.rand(*shape)
        got = sess.run(None, {"in0": x.numpy(), "in1": y.numpy()})
        for g, w in zip(got, torch_outputs(m, (x, y))):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


class SplitHeadsAttention(nn.Module):
    """q, k, v taken out of one reshaped projection with unbind (`q, k, v = t`) or by
    index (`t[0]`), as ViT and timm write attention."""

    def __init__(self, by_index):
        super().__init__()
        self.by_index = by_index
        self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, d = x.shape
        t = self.qkv(x).reshape(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        q, k, v = (t[0], t[1], t[2]) if self.by_index else t
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.proj(y)


class MhaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unbind", "index", "mha"])
def test_attention_exported_with_question_mark_dims_compiles_as_it_is(tmp_path, name):
    """The heads' outputs (unbind, select) and nn.MultiheadAttention's output get their
    shapes from the op's parameters once the placeholder sizes the input."""
    from helpers import export_pnnx

    torch.manual_seed(0)
    m = {"unbind": lambda: SplitHeadsAttention(False), "index": lambda: SplitHeadsAttention(True), "mha": MhaBlock}
    m = m[name]().eval()
    prefix = export_pnnx(tmp_path, m, (torch.rand(1, 10, 32),), (torch.rand(2, 20, 32),))
    with open(prefix + ".pnnx.param") as f:
        assert "#0=(?,?,32)f32" in f.read()
    compile_model(prefix + ".pnnx.param", output=str(tmp_path / "m.pmx"), verify=True)
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    assert sess.get_inputs()[0].shape == [None, None, 32]
    for shape in [(1, 10, 32), (3, 17, 32), (2, 1, 32), (1, 100, 32)]:
        _check(sess, m, torch.rand(*shape))


def test_an_output_that_does_not_follow_the_default_batch_is_noted(tmp_path):
    """pnnx folds torch.zeros(x.size(0), 4) into a constant, so such an output keeps its
    exported shape where torch's would follow the batch: the compile says which outputs
    do not follow it. A model whose outputs all follow the batch gets no such note."""
    from paramgraph import write_lines

    lines = [
        "pnnx.Input in0 0 1 x #x=(2,3)f32",
        "torch.mean m 1 1 x y dim=(0) keepdim=False $input=x #x=(2,3)f32 #y=(3)f32",
        "pnnx.Expression e 1 1 x z expr=mul(@0,2) #x=(2,3)f32 #z=(2,3)f32",
        "pnnx.Output out 2 0 y z",
    ]
    result = compile_model(str(write_lines(tmp_path, lines)), output=str(tmp_path / "m.pmx"))
    assert any(n.startswith("out0 keeps its exported shape at every batch") for n in result.notes), result.notes
    example = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn.pnnx.param"
    assert compile_model(str(example), output=str(tmp_path / "cnn.pmx")).notes == []


@pytest.mark.slow
def test_the_range_advice_for_a_sliced_table_works_when_followed(tmp_path):
    """Without --shape, a '?' length probed at twice the export runs past the position
    table: the error gives the --shape to write, and that compiles and matches torch."""
    import re

    from helpers import export_pnnx

    m = PositionsSlicedToLength().eval()
    prefix = export_pnnx(tmp_path, m, (torch.rand(1, 8, 16),), (torch.rand(2, 5, 16),))
    with pytest.raises(PmxCompileError) as caught:
        compile_model(prefix + ".pnnx.param", output=str(tmp_path / "m.pmx"))
    advice = re.search(r"--shape in0=(\S+),", str(caught.value)).group(1)
    assert advice == "1..<max>x1..<max>x16"
    compile_model(prefix + ".pnnx.param", output=str(tmp_path / "m.pmx"), shape="in0=" + advice.replace("<max>", "32"))
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    for shape in [(1, 8, 16), (3, 32, 16), (2, 1, 16)]:
        x = torch.rand(*shape)
        (got,) = sess.run(None, {"in0": x.numpy()})
        np.testing.assert_allclose(got, torch_outputs(m, (x,))[0], rtol=1e-6, atol=1e-6)
