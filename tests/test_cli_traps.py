"""Traps a user meets in their second hour with the `pmx` command and the Python API:
flags that contradict each other, files replaced without a word, numpy's advice about
unpickling, one spelling of a shape, output a person can read, timing that says what it
measured, help texts that tell the truth."""

import json
import pathlib
import re
import zipfile

import numpy as np
import pytest

from pmx.compiler.cli import main
from pmx.runtime.options import default_thread_count

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example"
LONG_NAME = "stage2_residual_block_expansion_conv_with_a_name_longer_than_forty_characters"


@pytest.fixture(scope="module")
def example_pmx(tmp_path_factory):
    out = tmp_path_factory.mktemp("traps") / "example.pmx"
    assert main(["compile", str(EXAMPLE / "cnn.pnnx.param"), "-o", str(out), "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def long_named_pmx(tmp_path_factory):
    """The example with one conv renamed to a long name (as timm and HF models name nodes)."""
    d = tmp_path_factory.mktemp("long")
    param = (EXAMPLE / "cnn.pnnx.param").read_text()
    assert " convbn2d_1 " in param
    (d / "cnn.pnnx.param").write_text(param.replace(" convbn2d_1 ", f" {LONG_NAME} "))
    with zipfile.ZipFile(EXAMPLE / "cnn.pnnx.bin") as src, zipfile.ZipFile(d / "cnn.pnnx.bin", "w") as dst:
        for entry in src.namelist():  # weights are stored under their node's name
            dst.writestr(re.sub(r"^convbn2d_1\.", f"{LONG_NAME}.", entry), src.read(entry))
    assert main(["compile", str(d / "cnn.pnnx.param"), "-o", str(d / "m.pmx"), "-q"]) == 0
    return d / "m.pmx"


def _exit_code(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


# --- compile flags ------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [["--dynamic", "in0:0"], ["--shape", "in0=1..8x3x64x64"]])
def test_static_with_a_dynamic_request_is_a_usage_error(tmp_path, capsys, flag):
    argv = ["compile", str(EXAMPLE / "cnn.pnnx.param"), "-o", str(tmp_path / "m.pmx"), "--static", *flag]
    assert _exit_code(argv) == 2
    assert "--static" in capsys.readouterr().err
    assert not (tmp_path / "m.pmx").exists()


def test_static_with_the_fixed_shape_compiles_a_fixed_model(tmp_path):
    from pmx.runtime import InferenceSession

    out = tmp_path / "m.pmx"
    assert (
        main(["compile", str(EXAMPLE / "cnn.pnnx.param"), "-o", str(out), "--static", "--shape", "in0=1x3x64x64"]) == 0
    )
    assert InferenceSession(str(out)).get_inputs()[0].shape == [1, 3, 64, 64]


def test_compiling_without_o_says_when_it_replaces_a_file(tmp_path, capsys):
    for name in ("cnn.pnnx.param", "cnn.pnnx.bin"):
        (tmp_path / name).write_bytes((EXAMPLE / name).read_bytes())
    assert main(["compile", str(tmp_path / "cnn.pnnx.param")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("cnn.pmx") and "replaced" not in first
    assert main(["compile", str(tmp_path / "cnn.pnnx.param")]) == 0
    assert "replaced" in capsys.readouterr().out.splitlines()[0]


def test_the_readme_shows_o_as_optional():
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    assert "-o OUT.pmx`**" not in readme
    assert re.search(r"pmx compile PARAM \[BIN\] \[-o OUT\.pmx\]", readme)


# --- pmx run's inputs -----------------------------------------------------------------------


def test_a_pickled_npy_is_refused_without_numpys_unpickling_advice(example_pmx, tmp_path, capsys):
    path = tmp_path / "objects.npy"
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert main(["run", str(example_pmx), "--input", f"in0={path}"]) == 1
    err = capsys.readouterr().err
    assert "objects.npy" in err and "Python objects" in err
    assert "allow_pickle" not in err and "trust" not in err


def test_an_input_file_of_another_dtype_is_named_with_the_fix(example_pmx, tmp_path, capsys):
    path = tmp_path / "f64.npy"
    np.save(path, np.load(EXAMPLE / "cnn_input.npy").astype(np.float64))
    assert main(["run", str(example_pmx), "--input", f"in0={path}"]) == 1
    err = capsys.readouterr().err
    assert f"{path} holds float64, input in0 takes float32" in err and "astype(numpy.float32)" in err
    np.save(path, np.load(path).astype(np.float32))  # as the message says
    assert main(["run", str(example_pmx), "--input", f"in0={path}"]) == 0


def test_a_file_that_is_no_npy_is_named_as_such(example_pmx, tmp_path, capsys):
    path = tmp_path / "notes.npy"
    path.write_text("these are not numbers\n")
    assert main(["run", str(example_pmx), "--input", f"in0={path}"]) == 1
    err = capsys.readouterr().err
    assert "notes.npy is not a .npy file" in err and "pickle" not in err


def test_random_inputs_take_a_shape_for_a_dynamic_dim(example_pmx, capsys):
    assert main(["run", str(example_pmx), "--random", "--shape", "in0=5x3x64x64", "--repeat", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["inputs"][0]["shape"] == [5, 3, 64, 64]
    assert result["outputs"][0]["shape"] == [5, 10]


def test_a_random_shape_the_model_does_not_take_names_the_allowed_shapes(example_pmx, capsys):
    assert main(["run", str(example_pmx), "--random", "--shape", "in0=5x3x32x64", "--repeat", "0"]) == 1
    assert "[1.., 3, 64, 64]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "in0=5x3x64x64"], "give --random too"),
        (["--random", "--shape", "in0=5x3xax64"], "expected NAME=8x3x64x64"),
    ],
)
def test_run_shape_misuse_is_a_usage_error(example_pmx, capsys, argv, message):
    assert _exit_code(["run", str(example_pmx), *argv]) == 2
    assert message in capsys.readouterr().err


def test_run_shape_naming_no_input_is_refused(example_pmx, capsys):
    assert main(["run", str(example_pmx), "--random", "--shape", "x=1x3x64x64"]) == 1
    assert "no input of the model" in capsys.readouterr().err


# --- one spelling of a shape ------------------------------------------------------------------


def test_the_missing_input_message_spells_dims_as_ranges(example_pmx, capsys):
    assert _exit_code(["run", str(example_pmx)]) == 2
    err = capsys.readouterr().err
    assert "in0 [1.., 3, 64, 64] float32" in err and "?" not in err


def test_an_output_that_follows_the_batch_takes_the_batchs_range(example_pmx, capsys):
    """The batch passes through to the output: [1.., 10], not [0.., 10] (a batch of 0 is refused)."""
    assert main(["inspect", str(example_pmx), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["inputs"][0]["allowed"] == "[1.., 3, 64, 64]"
    assert info["outputs"][0]["allowed"] == "[1.., 10]"
    assert info["inputs"][0]["dim_ranges"] == [[1, None], [3, 3], [64, 64], [64, 64]]
    assert main(["inspect", str(example_pmx)]) == 0
    assert re.search(r"output\s+out0\s+\[1\.\., 10\]", capsys.readouterr().out)


# --- output a person can read -------------------------------------------------------------------


def test_profile_and_inspect_show_full_names_and_fused_activations(long_named_pmx, capsys):
    assert main(["run", str(long_named_pmx), "--random", "--profile", "--repeat", "2", "--warmup", "0"]) == 0
    profile = capsys.readouterr().out
    assert main(["inspect", str(long_named_pmx)]) == 0
    inspect = capsys.readouterr().out
    for text in (profile, inspect):
        row = next(line for line in text.splitlines() if LONG_NAME in line)
        assert "+relu" in row.split(LONG_NAME)[1]  # conv + bn + relu: the relu runs in the conv's epilogue
    assert main(["inspect", str(long_named_pmx), "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["node_table"]
    assert {n["name"]: n["fused"] for n in nodes}[LONG_NAME] == "+relu"


def test_the_profiles_parts_never_exceed_its_run(example_pmx, capsys):
    """The split of a run into kernels and overhead comes from the same runs; no sum of
    per-node medians is printed as a total that can exceed the run."""
    assert main(["run", str(example_pmx), "--random", "--profile", "--repeat", "3", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    match = re.search(r"run ([\d.]+) ms \(median of runs\), of which kernels ([\d.]+) ms", text)
    assert match and float(match[2]) <= float(match[1])
    assert not re.search(r"^total\b", text, re.M)


# --- timing that says what it measured ------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_run_times_after_the_thread_choice_and_says_the_threads(example_pmx, capsys, threads):
    argv = ["run", str(example_pmx), "--random", "--repeat", "3", "--threads", str(threads)]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["threads_settled"] is True
    assert result["threads"] in range(1, threads + 1)
    assert result["warmup_runs"] > 0  # runs for --warmup's 0.3 s at least, also with nothing to choose
    assert main(argv) == 0
    assert re.search(r"^timed on [12] threads?", capsys.readouterr().out, re.M)


def test_warmup_zero_stops_once_the_thread_choice_settles(example_pmx, capsys):
    argv = ["run", str(example_pmx), "--random", "--repeat", "1", "--threads", "1", "--warmup", "0", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["warmup_runs"] == 0  # one thread: nothing to choose


def test_thread_choice_reports_the_way_runs_go(example_pmx):
    from pmx.runtime import InferenceSession

    sess = InferenceSession(str(example_pmx), num_threads=2)
    feed = {"in0": np.zeros((1, 3, 64, 64), np.float32)}
    assert sess.thread_choice(feed) == (2, False)  # splits until it has timed both ways
    for _ in range(40):
        sess.run(None, feed)
    threads, settled = sess.thread_choice(feed)
    assert settled and threads in (1, 2)
    assert InferenceSession(str(example_pmx), num_threads=1).thread_choice(feed) == (1, True)


# --- help texts that tell the truth ---------------------------------------------------------


def test_run_help_states_the_thread_default_the_session_uses(capsys, monkeypatch):
    assert _exit_code(["run", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "OMP_NUM_THREADS when set, else the cores this process may use" in help_text
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_thread_count() == 3


# --- advice that works when followed ---------------------------------------------------------


@pytest.fixture(scope="module")
def long_kernel_export(tmp_path_factory):
    """A Conv1d with a 600-tap kernel exported with '?' length: every placeholder size the
    compiler tries (up to 512) is too short for it."""
    import torch
    from helpers import export_pnnx

    torch.manual_seed(0)
    module = torch.nn.Conv1d(1, 4, kernel_size=600).eval()
    d = tmp_path_factory.mktemp("long_kernel")
    prefix = export_pnnx(d, module, (torch.rand(1, 1, 1000),), (torch.rand(1, 1, 1200),))
    return prefix + ".pnnx.param", module


def _advised_shape(err):
    match = re.search(r"--shape (in0=\S+?<n>)", err)
    assert match, err
    return match[1]


@pytest.mark.parametrize("fill, run_length", [("1000", 1000), ("600..", 700)])
def test_the_advice_for_dims_no_placeholder_fits_works_when_followed(
    long_kernel_export, tmp_path, capsys, fill, run_length
):
    import torch

    from pmx.runtime import InferenceSession

    param, module = long_kernel_export
    out = str(tmp_path / "m.pmx")
    assert main(["compile", param, "-o", out]) == 1
    advised = _advised_shape(capsys.readouterr().err)
    assert main(["compile", param, "-o", out, "--shape", advised.replace("<n>", fill)]) == 0
    x = torch.rand(1, 1, run_length)
    with torch.no_grad():
        want = module(x).numpy()
    (got,) = InferenceSession(out).run(None, {"in0": x.numpy()})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_advice_for_static_with_open_dims_works_when_followed(long_kernel_export, tmp_path, capsys):
    param, _ = long_kernel_export
    out = str(tmp_path / "m.pmx")
    assert main(["compile", param, "-o", out, "--static"]) == 1
    advised = _advised_shape(capsys.readouterr().err)
    assert main(["compile", param, "-o", out, "--static", "--shape", advised.replace("<n>", "1000")]) == 0


def test_the_advice_for_a_missing_input_works_when_followed(example_pmx, capsys):
    assert _exit_code(["run", str(example_pmx)]) == 2
    assert "or --random for random values" in capsys.readouterr().err
    assert main(["run", str(example_pmx), "--random", "--repeat", "0"]) == 0


def test_no_shape_advice_where_no_size_would_do(tmp_path, capsys):
    """Shape arithmetic pmx cannot follow fails the same at every size: the error says
    so, without advice to give a --shape that would fail the same way."""
    import torch
    from helpers import export_pnnx

    class NewZerosOfTwiceTheBatch(torch.nn.Module):
        def forward(self, x):
            b, n, _ = x.shape
            return x.new_zeros(b * 2, n)

    prefix = export_pnnx(tmp_path, NewZerosOfTwiceTheBatch(), (torch.rand(1, 8, 64),), (torch.rand(2, 5, 64),))
    assert main(["compile", prefix + ".pnnx.param", "-o", str(tmp_path / "m.pmx")]) == 1
    err = capsys.readouterr().err
    assert "mul(size(@0,0),2)" in err and "export with a fixed input shape" in err
    assert "--shape" not in err


def test_the_advice_for_an_intermediate_output_works_when_followed(example_pmx, tmp_path):
    """Asking a session for an intermediate tensor names --keep; compiled with it, the
    tensor (here the residual block's relu, pnnx operand 7) is fetchable."""
    from pmx.runtime import InferenceSession, PmxInputError

    feed = {"in0": np.load(EXAMPLE / "cnn_input.npy")}
    with pytest.raises(PmxInputError, match=r"compile with --keep NAME"):
        InferenceSession(str(example_pmx)).run(["7"], feed)
    kept = tmp_path / "kept.pmx"
    assert main(["compile", str(EXAMPLE / "cnn.pnnx.param"), "-o", str(kept), "--keep", "7", "-q"]) == 0
    sess = InferenceSession(str(kept))
    relu, out = sess.run(["7", "out0"], feed)
    assert relu.shape == (1, 16, 32, 32) and relu.min() >= 0 and relu.max() > 0
    np.testing.assert_allclose(out, InferenceSession(str(example_pmx)).run(None, feed)[0], rtol=1e-5, atol=1e-6)
