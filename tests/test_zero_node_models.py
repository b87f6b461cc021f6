"""Models whose compiled graph keeps no compute node: every output is a graph input passed
through (identity, dropout in eval, clone) or a constant pnnx folded (zeros_like,
new_ones, a buffer plus one). Their files have an empty node table; they must compile,
load, run equal to torch, and pass `pmx inspect` / `pmx verify` / `pmx run`."""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

from pmx.compiler.cli import main
from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession


class Identity(nn.Module):
    def forward(self, x):
        return x


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x)


class Clone(nn.Module):
    def forward(self, x):
        return x.clone().contiguous()


class ConstantOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.arange(6.0).reshape(2, 3))

    def forward(self, x):
        return x, self.c + 1


class ZerosLike(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


class NewOnes(nn.Module):
    def forward(self, x):
        return x.new_ones((2, 3))


class SameTwice(nn.Module):
    def forward(self, x):
        return x, nn.functional.dropout(x, 0.3, training=False)


MODELS = {
    "identity": Identity,
    "dropout": Dropout,
    "clone": Clone,
    "constant": ConstantOutput,
    "zeros_like": ZerosLike,
    "new_ones": NewOnes,
    "same_twice": SameTwice,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zero_node_model_matches_torch(check_model, name):
    module = MODELS[name]()
    x = torch.rand(2, 3)
    sess, got, want = check_model(f"zero_{name}", module, (x,))
    assert sess.model.nodes == [], f"{name}: expected no node, got {[n.op for n in sess.model.nodes]}"
    # outputs belong to the caller: changing them changes nothing in the next run
    for g in got:
        g[...] = -7
    again = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    for a, w in zip(again, want):
        np.testing.assert_array_equal(a, w)
    # nor does a returned pass-through alias the caller's input
    feed = x.numpy().copy()
    out = sess.run(None, {sess.get_inputs()[0].name: feed})
    assert not any(np.shares_memory(o, feed) for o in out)


@pytest.fixture(scope="module")
def constant_pmx(exporter, tmp_path_factory):
    prefix = exporter("zero_constant", ConstantOutput(), (torch.rand(2, 3),))
    out = tmp_path_factory.mktemp("zero_cli") / "constant.pmx"
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(out))
    return out


def test_cli_inspect_verify_run(constant_pmx, capsys):
    assert main(["verify", str(constant_pmx)]) == 0
    text = capsys.readouterr().out
    assert "OK" in text and "0 nodes" in text
    assert main(["inspect", str(constant_pmx)]) == 0
    assert "in0" in capsys.readouterr().out
    assert main(["inspect", "--json", str(constant_pmx)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["nodes"] == 0 and len(info["outputs"]) == 2
    assert main(["run", str(constant_pmx), "--random", "--profile", "--repeat", "1", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    assert "[1., 2., 3., 4., 5., 6.]" in text
    match = re.search(r"of which kernels ([\d.]+) ms", text)
    assert match and float(match[1]) == 0.0


def test_verify_on_session(constant_pmx):
    sess = InferenceSession(str(constant_pmx), verify=True)
    x = np.random.rand(2, 3).astype(np.float32)
    got = sess.run(None, {"in0": x})
    np.testing.assert_array_equal(got[0], x)
    np.testing.assert_array_equal(got[1], np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3))
