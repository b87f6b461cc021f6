"""The `pmx` command on the example model that ships in tools/example/."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from pmx.compiler.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "tools" / "example"


@pytest.fixture(scope="module")
def example_pmx(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "example.pmx"
    assert main(["compile", str(EXAMPLE / "cnn.pnnx.param"), "-o", str(out)]) == 0
    return out


def test_compile_prints_summary(tmp_path, capsys):
    out = tmp_path / "m.pmx"
    assert main(["compile", str(EXAMPLE / "cnn.pnnx.param"), str(EXAMPLE / "cnn.pnnx.bin"), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("ops", "constants", "arena", "file", "time"):
        assert word in text
    assert out.stat().st_size > 0


def test_compile_verbose_prints_rule_hits(tmp_path, capsys):
    """-v lists each rule of the rule-table passes that ran, with its hits."""
    out = tmp_path / "m.pmx"
    assert main(["compile", str(EXAMPLE / "cnn.pnnx.param"), "-o", str(out), "-v"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  rule ")]
    assert ["rule", "fuse_activation:", "fuse_into_epilogue", "fired"] in [line[:4] for line in lines]
    assert all(line[-1].endswith("x") and int(line[-1][:-1]) >= 0 for line in lines)
    assert main(["compile", str(EXAMPLE / "cnn.pnnx.param"), "-o", str(out), "-v", "--disable", "fuse_activation"]) == 0
    assert "fuse_activation:" not in capsys.readouterr().out


def test_compile_default_output_next_to_param(tmp_path):
    for name in ("cnn.pnnx.param", "cnn.pnnx.bin"):
        (tmp_path / name).write_bytes((EXAMPLE / name).read_bytes())
    assert main(["compile", str(tmp_path / "cnn.pnnx.param")]) == 0
    assert (tmp_path / "cnn.pmx").exists()


def test_run_matches_torch_output_shipped_with_example(example_pmx, capsys):
    assert (
        main(["run", str(example_pmx), "--input", f"in0={EXAMPLE / 'cnn_input.npy'}", "--repeat", "2", "--warmup", "0"])
        == 0
    )
    text = capsys.readouterr().out
    assert "out0: shape [1, 10]" in text and "load" in text
    from pmx.runtime import InferenceSession

    sess = InferenceSession(str(example_pmx))
    [y] = sess.run(None, {"in0": np.load(EXAMPLE / "cnn_input.npy")})
    expected = np.load(EXAMPLE / "cnn_expected.npy")
    assert np.abs(y - expected).max() / np.abs(expected).max() <= 1e-4


def test_run_random_and_profile(example_pmx, capsys):
    assert main(["run", str(example_pmx), "--random", "--profile", "--repeat", "1", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    assert "of which kernels" in text and "conv" in text


def test_inspect_text_and_json(example_pmx, capsys):
    assert main(["inspect", str(example_pmx)]) == 0
    assert "in0" in capsys.readouterr().out
    assert main(["inspect", "--json", str(example_pmx)]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("nodes", "arena_bytes", "lower_bound_bytes", "naive_bytes"):
        assert isinstance(info[key], int)
    assert info["lower_bound_bytes"] <= info["arena_bytes"]


def test_verify_ok(example_pmx, capsys):
    assert main(["verify", str(example_pmx)]) == 0
    assert "OK" in capsys.readouterr().out


def test_python_dash_m_compiler_matches_pmx_compile(tmp_path, example_pmx):
    out = tmp_path / "m.pmx"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pmx.compiler",
            str(EXAMPLE / "cnn.pnnx.param"),
            str(EXAMPLE / "cnn.pnnx.bin"),
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    assert out.read_bytes() == example_pmx.read_bytes()


def test_errors_are_one_line_and_exit_1(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.pmx")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pmx: error:") and err.count("\n") == 1 and "missing.pmx" in err


def test_list_ops(capsys):
    assert main(["compile", "--list-ops"]) == 0
    text = capsys.readouterr().out
    assert "nn.Conv2d" in text and "pnnx.Expression" in text


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_a_zero_d_input_takes_an_empty_shape_and_a_dtype(tmp_path, capsys, dtype):
    """pnnx records neither shape nor dtype for a 0-d input: `--shape NAME=` (no dims)
    says it is 0-d and `--dtype NAME=TYPE` gives its dtype; pmx guesses neither."""
    param = tmp_path / "m.pnnx.param"
    param.write_text(
        "7767517\n3 2\n"
        "pnnx.Input in0 0 1 0\n"
        f"pnnx.Expression e 1 1 0 1 expr=mul(@0,2) #1=(){dtype[0]}{dtype[-2:]}\n"
        "pnnx.Output out0 1 0 1\n"
    )
    from ziputil import write_bin

    write_bin(tmp_path / "m.pnnx.bin", {})
    out = tmp_path / "m.pmx"
    assert main(["compile", str(param), "-o", str(out)]) == 1
    assert "no recorded dtype or shape" in capsys.readouterr().err
    assert main(["compile", str(param), "-o", str(out), "--shape", "in0="]) == 1
    assert "give it, e.g. --dtype in0=" in capsys.readouterr().err
    assert main(["compile", str(param), "-o", str(out), "--shape", "in0=", "--dtype", f"in0={dtype}"]) == 0
    from pmx.runtime import InferenceSession

    sess = InferenceSession(str(out))
    assert sess.get_inputs()[0].shape == []
    (got,) = sess.run(None, {"in0": np.array(5, dtype)})
    assert got.dtype == np.dtype(dtype) and got == 10  # torch: an int32 tensor times 2 stays int32


def test_a_dtype_given_must_name_an_input_and_agree_with_the_recorded_one(tmp_path, capsys):
    model = str(EXAMPLE / "cnn.pnnx.param")
    assert main(["compile", model, "-o", str(tmp_path / "a.pmx"), "--dtype", "nope=int32"]) == 1
    assert "no input nope" in capsys.readouterr().err
    assert main(["compile", model, "-o", str(tmp_path / "a.pmx"), "--dtype", "in0=int32"]) == 1
    assert "records input in0 as float32" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["compile", model, "--dtype", "in0=int33"])
    assert exit_.value.code == 2
    assert "--dtype in0=int33: 'int33' is not one of float32" in capsys.readouterr().err


def test_an_onnx_op_pnnx_left_unconverted_is_named_as_one(tmp_path, capsys):
    param = tmp_path / "m.pnnx.param"
    param.write_text(
        "7767517\n3 2\n"
        "pnnx.Input in0 0 1 0 #0=(4,6)f32\n"
        "Slice slice_0 1 1 0 1 #0=(4,6)f32 #1=(2,6)f32\n"
        "pnnx.Output out0 1 0 1 #1=(2,6)f32\n"
    )
    from ziputil import write_bin

    write_bin(tmp_path / "m.pnnx.bin", {})
    assert main(["compile", str(param), "-o", str(tmp_path / "m.pmx")]) == 1
    err = capsys.readouterr().err
    assert "unsupported op Slice" in err and "an ONNX op that pnnx left unconverted" in err
    assert "ncnn" not in err


def test_compile_never_writes_a_file_the_loader_refuses(tmp_path, monkeypatch):
    """The compiler checks the file it wrote with the loader's own code before it replaces
    the output: when they disagree (here a loader made stricter than the compiler: no
    elementwise expression passes), compile fails as pmx's bug and the file that was
    there stays as it was."""
    from pmx.compiler.driver import compile_model
    from pmx.runtime import PmxInternalError, verify

    out = tmp_path / "m.pmx"
    out.write_bytes(b"the previous file")
    monkeypatch.setattr(verify, "MAX_EXPANDED_EXPR", 0)
    with pytest.raises(
        PmxInternalError, match=r"fails the loader's checks, so .*m.pmx was not written: .*expression expands"
    ):
        compile_model(str(EXAMPLE / "cnn.pnnx.param"), str(EXAMPLE / "cnn.pnnx.bin"), str(out))
    assert out.read_bytes() == b"the previous file"
    assert [p.name for p in tmp_path.iterdir()] == ["m.pmx"], "no temporary file is left behind"


def test_a_model_path_after_meta_is_told_where_to_go(tmp_path, capsys):
    """--meta takes one or more pairs, so the model path after it reads as a pair: the
    message says so and how to write it; both fixes it names work."""
    param = str(EXAMPLE / "cnn.pnnx.param")
    out = str(tmp_path / "m.pmx")
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "-o", out, "--meta", "a=b", param])
    assert exit_.value.code == 2
    assert "give it before --meta, or end the pairs with --" in capsys.readouterr().err
    assert main(["compile", "-o", out, "--meta", "a=b", "--", param]) == 0
    assert main(["compile", param, "-o", out, "--meta", "a=b"]) == 0


def test_the_readme_states_the_current_op_count(capsys):
    """The README's count of supported op types is --list-ops' (a recipe's new rule updates it)."""
    import re

    assert main(["compile", "--list-ops", "--json"]) == 0
    count = len(json.loads(capsys.readouterr().out))
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"(\d+) (?:supported )?PNNX\s+op types", readme)) == {str(count)}
