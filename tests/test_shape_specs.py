"""compile_model's dynamic= and shape= take the CLI's strings and plain Python structures,
all meaning the same; anything else is a PmxInputError naming the keyword and its forms."""

import pathlib

import numpy as np
import pytest

from pmx.compiler.driver import compile_model
from pmx.compiler.shape_specs import dynamic_option, shape_option
from pmx.runtime import InferenceSession, PmxInputError

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"

ANY = (1, -1)


@pytest.mark.parametrize(
    "value, want",
    [
        ("in0:0,2", {"in0": {0: ANY, 2: ANY}}),
        (["in0:0", "in1:1"], {"in0": {0: ANY}, "in1": {1: ANY}}),
        ({"in0": [0, 2]}, {"in0": {0: ANY, 2: ANY}}),
        ({"in0": {0: (1, 16), 2: (32, None)}}, {"in0": {0: (1, 16), 2: (32, -1)}}),
        ({"in0": {0: (1, -1)}}, {"in0": {0: ANY}}),
        (None, {}),
    ],
)
def test_dynamic_forms(value, want):
    assert dynamic_option(value) == want


@pytest.mark.parametrize(
    "value, want_dynamic, want_plan",
    [
        ("in0=1..16x3x?", {"in0": {0: (1, 16), 1: (3, 3), 2: ANY}}, {"in0": (1, 3, None)}),
        (["in0=2x3", "in1="], {"in0": {0: (2, 2), 1: (3, 3)}, "in1": {}}, {"in0": (2, 3), "in1": ()}),
        ({"in0": "4..x3"}, {"in0": {0: (4, -1), 1: (3, 3)}}, {"in0": (4, 3)}),
        ({"in0": (1, 3, None)}, {"in0": {0: (1, 1), 1: (3, 3), 2: ANY}}, {"in0": (1, 3, None)}),
    ],
)
def test_shape_forms(value, want_dynamic, want_plan):
    assert shape_option(value) == (want_dynamic, want_plan)


@pytest.mark.parametrize(
    "keyword, value",
    [
        ("dynamic", {"in0": [2, 3]}.items()),
        ("dynamic", "in0"),
        ("dynamic", {"in0": {0: (0, 4)}}),
        ("dynamic", {"in0": {0: (8, 4)}}),
        ("dynamic", {"in0": 0}),
        ("dynamic", {0: [0]}),
        ("shape", "in0=1x0"),
        ("shape", "1x3"),
        ("shape", {"in0": (1, 0)}),
        ("shape", 7),
    ],
)
def test_a_bad_value_names_the_keyword_and_its_forms(tmp_path, keyword, value):
    with pytest.raises(PmxInputError, match=rf"^{keyword}=.*: expected {keyword}="):
        compile_model(f"{EXAMPLE}.pnnx.param", f"{EXAMPLE}.pnnx.bin", str(tmp_path / "m.pmx"), **{keyword: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dynamic="in0:0"),
        dict(dynamic={"in0": [0]}),
        dict(dynamic={"in0": {0: (1, None)}}),
        dict(shape="in0=1..x3x64x64"),
        dict(shape={"in0": "1..x3x64x64"}),
    ],
)
def test_every_form_compiles_a_dynamic_batch(tmp_path, kwargs):
    out = tmp_path / "m.pmx"
    compile_model(f"{EXAMPLE}.pnnx.param", f"{EXAMPLE}.pnnx.bin", str(out), auto_batch=False, **kwargs)
    sess = InferenceSession(str(out))
    assert sess.get_inputs()[0].shape == [None, 3, 64, 64]
    x = np.random.default_rng(0).standard_normal((3, 3, 64, 64)).astype(np.float32)
    assert sess.run(None, {"in0": x})[0].shape == (3, 10)
