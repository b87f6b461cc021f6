"""The `pmx` command's conventions: exit status 0 ok, 1 failure, 2 usage, 3 internal
error; --version; a closed pipe ends quietly; --json parses; --expect, --save,
--batch-dir; errors that say what to do.

Most tests call the console script's function (`pmx.compiler.cli.main`) in this process,
with its argv, its working directory and its standard streams captured; what only a
process shows runs the console script of the interpreter under test (or `python -m
pmx.compiler`, the same command) in a subprocess: the entry point itself, a closed pipe,
a terminal, and the modules `pmx run` imports."""

import ast
import contextlib
import io
import json
import os
import pathlib
import pty
import re
import subprocess
import sys

import numpy as np
import pytest
from ziputil import build_zip

from pmx.compiler import compile_model
from pmx.compiler.cli import main
from pmx.runtime import InferenceSession, __version__

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "tools" / "example"
SCRIPT = pathlib.Path(sys.executable).with_name("pmx")
PMX = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "pmx.compiler"]

TWO_INPUTS = """7767517
4 3
pnnx.Input in0 0 1 0 #0=(2,4)f32
pnnx.Input in1 0 1 1 #1=(2,4)f32
pnnx.Expression add 2 1 0 1 2 expr=add(@0,@1) #0=(2,4)f32 #1=(2,4)f32 #2=(2,4)f32
pnnx.Output out 1 0 2 #2=(2,4)f32
"""


def pmx(*args, cwd=None):
    """`pmx ARGS` run by the console script's function in this process: its exit status and
    what it wrote, as subprocess.run gives them."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's usage errors and --help/--version
            status = e.code
    return subprocess.CompletedProcess(argv, status or 0, out.getvalue(), err.getvalue())


def pmx_process(*args):
    """`pmx ARGS` run by the console script in a subprocess."""
    return subprocess.run([*PMX, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "cnn.pmx"
    compile_model(str(EXAMPLE / "cnn.pnnx.param"), output=str(out))
    return out


@pytest.fixture(scope="module")
def two_input_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("two")
    (d / "add.pnnx.param").write_text(TWO_INPUTS)
    (d / "add.pnnx.bin").write_bytes(build_zip([]).data)
    compile_model(str(d / "add.pnnx.param"), output=str(d / "add.pmx"), auto_batch=False)
    return d / "add.pmx"


def _one_error_line(r):
    lines = r.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("pmx: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    return lines[0]


# --- version, usage --------------------------------------------------------------------


def test_version():
    r = pmx_process("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pmx {__version__}"


@pytest.mark.parametrize(
    "args, message",
    [
        (["compile"], "a model.pnnx.param file is required"),
        ([], "required"),
        (["frobnicate"], "invalid choice"),
        (["run", "{model}", "--random", "--repeat", "-3"], "--repeat: expected an integer >= 0, got -3"),
        (["run", "{model}", "--random", "--threads", "0"], "--threads: expected an integer >= 1"),
        (["run", "{model}", "--input", "in0"], "expected NAME=FILE.npy"),
        (["run", "{model}", "--random", "--expect", "out0=x.npy", "--rtol", "-1"], "--rtol: expected a number >= 0"),
        (["run", "{model}", "--random", "--rtol", "0.1"], "--rtol/--atol apply to --expect"),
        (["run", "{model}", "--batch-dir", "."], "--batch-dir needs --save"),
        (["run", "{model}", "--batch-dir", ".", "--save", "o", "--random"], "cannot be combined with --random"),
        (["compile", "{param}", "--meta", "novalue"], "expected KEY=VALUE"),
        (["compile", "{param}", "--meta", "a=1", "--meta", "a=2"], "--meta a given twice"),
        (["compile", "{param}", "--shape", "in0=abc"], "dim 0 'abc' is not N, A..B, A.. or ?"),
        (["compile", "{param}", "--shape", "in0=0x3x64x64"], "dim 0 '0' is not N"),
        (["compile", "{param}", "--shape", "in0"], "expected NAME=DIMxDIMx"),
        (["compile", "{param}", "--dynamic", "in0:x"], "expected NAME:DIM"),
        (["compile", "{param}", "--disable", "no_such_pass"], "--disable no_such_pass: no such pass"),
        (["compile", "{param}", "--json"], "--json goes with --list-ops"),
    ],
)
def test_usage_errors_exit_2(model, tmp_path, args, message):
    args = [str(a).format(model=model, param=EXAMPLE / "cnn.pnnx.param") for a in args]
    r = pmx(*args, cwd=tmp_path)
    assert r.returncode == 2, r
    assert message in r.stderr and "usage:" in r.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_run_names_the_inputs_it_will_not_guess(two_input_model):
    r = pmx("run", two_input_model, "--input", f"in0={EXAMPLE / 'cnn_input.npy'}")
    assert r.returncode == 2
    assert "no value for input(s) in1 [2, 4] float32" in r.stderr and "--random" in r.stderr
    assert "in0 [" not in r.stderr.split("error:")[-1]


# --- a closed pipe ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["run", "{model}", "--random", "--repeat", "1", "--warmup", "0"],
        ["inspect", "{model}"],
        ["inspect", "{model}", "--json"],
    ],
)
def test_closed_pipe_ends_quietly(model, args):
    """`pmx run m.pmx --random | head -1`, with the reader gone before pmx writes."""
    proc = subprocess.Popen(
        [*PMX, *[a.format(model=model) for a in args]], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0
    assert err == ""


# --- --json --------------------------------------------------------------------------------


def test_inspect_json_reports_dynamic_dims_as_null(model):
    r = pmx("inspect", model, "--json")
    assert r.returncode == 0
    info = json.loads(r.stdout)
    sess = InferenceSession(str(model))
    assert [x["declared_shape"] for x in info["inputs"]] == [a.shape for a in sess.get_inputs()]
    assert [x["declared_shape"] for x in info["outputs"]] == [a.shape for a in sess.get_outputs()]
    assert info["inputs"][0]["declared_shape"][0] is None  # the batch dim the compiler made dynamic
    assert info["inputs"][0]["planned_shape"] == [1, 3, 64, 64]
    assert info["metadata"] == {}


def test_json_vocabulary_is_shared_by_run_inspect_and_verify(model):
    """One name per meaning across commands: `model` is the .pmx path, `declared_shape` the
    shape get_inputs() reports, `planned_shape` what memory was planned for, `shape` only
    an actual array's shape (run)."""
    run = json.loads(pmx("run", model, "--random", "--repeat", "1", "--warmup", "0", "--json").stdout)
    inspect = json.loads(pmx("inspect", model, "--json").stdout)
    verify = json.loads(pmx("verify", model, "--json").stdout)
    assert run["model"] == inspect["model"] == verify["model"] == str(model)
    for kind in ("inputs", "outputs"):
        for ran, described in zip(run[kind], inspect[kind]):
            assert ran["declared_shape"] == described["declared_shape"]
            assert "shape" not in described  # inspect has no arrays, only declared and planned shapes
    assert inspect["file_bytes"] == verify["file_bytes"] == model.stat().st_size


def test_run_json(model):
    r = pmx("run", model, "--input", f"in0={EXAMPLE / 'cnn_input.npy'}", "--repeat", "2", "--warmup", "0", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    [out] = info["outputs"]
    assert out["name"] == "out0" and out["shape"] == [1, 10] and out["declared_shape"] == [None, 10]
    expected = np.load(EXAMPLE / "cnn_expected.npy")
    np.testing.assert_allclose(out["first_values"], expected.reshape(-1)[:6], rtol=1e-4, atol=1e-6)
    assert info["inputs"][0]["declared_shape"] == [None, 3, 64, 64]
    assert info["repeat"] == 2 and info["median_ms"] > 0


def test_verify_json_ok_and_damaged(model, tmp_path):
    r = pmx("verify", model, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    bad = tmp_path / "bad.pmx"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0x40
    bad.write_bytes(bytes(data))
    r = pmx("verify", bad, "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["ok"] is False and "data checksum mismatch" in report["error"]
    assert "data checksum mismatch" in _one_error_line(r)


@pytest.mark.parametrize("command", [["inspect"], ["run", "--random"]])
def test_a_failed_json_command_still_prints_a_document(model, tmp_path, command):
    """A script reading `pmx inspect|run --json` gets JSON on failure too, as from verify."""
    cut = tmp_path / "cut.pmx"
    cut.write_bytes(model.read_bytes()[:200])
    r = pmx(command[0], cut, *command[1:], "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["ok"] is False and report["model"] == str(cut) and report["error"] in _one_error_line(r)


# --- --expect, --save, -q ------------------------------------------------------------------


def test_expect_passes_and_fails_on_a_changed_file(model, tmp_path):
    good = EXAMPLE / "cnn_expected.npy"
    x = f"in0={EXAMPLE / 'cnn_input.npy'}"
    r = pmx("run", model, "--input", x, "--repeat", "0", "--expect", f"out0={good}")
    assert r.returncode == 0 and "out0: matches" in r.stdout
    changed = np.load(good)
    changed[0, 3] += 0.01
    bad = tmp_path / "changed.npy"
    np.save(bad, changed)
    r = pmx("run", model, "--input", x, "--repeat", "0", "--expect", f"out0={bad}")
    assert r.returncode == 1
    line = _one_error_line(r)
    assert "out0 does not match" in line and re.search(r"max abs error 0\.0(1\b|099)", line) and "(0, 3)" in line
    r = pmx("run", model, "--input", x, "--repeat", "0", "--expect", f"out0={bad}", "--atol", "0.02")
    assert r.returncode == 0  # within the tolerance given
    r = pmx("run", model, "--input", x, "--repeat", "0", "--expect", f"out0={bad}", "--json")
    assert r.returncode == 1
    [check] = json.loads(r.stdout)["expect"]
    assert check["ok"] is False and abs(check["max_abs_error"] - 0.01) < 1e-4 and check["worst_index"] == [0, 3]
    np.save(bad, changed[:, :5])
    r = pmx("run", model, "--input", x, "--repeat", "0", "--expect", f"out0={bad}")
    assert r.returncode == 1 and "shape [1, 10] != expected [1, 5]" in r.stderr
    r = pmx("run", model, "--input", x, "--repeat", "0", "--expect", f"nope={good}")
    assert r.returncode == 1 and "no such output" in _one_error_line(r)


def test_save_and_quiet(model, tmp_path):
    r = pmx(
        "run", model, "--input", f"in0={EXAMPLE / 'cnn_input.npy'}", "--repeat", "0", "--save", tmp_path / "o", "-q"
    )
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    y = np.load(tmp_path / "o" / "out0.npy")
    np.testing.assert_allclose(y, np.load(EXAMPLE / "cnn_expected.npy"), rtol=1e-4, atol=1e-6)
    r = pmx("compile", EXAMPLE / "cnn.pnnx.param", "-o", tmp_path / "q.pmx", "-q")
    assert r.returncode == 0 and r.stdout == "" and (tmp_path / "q.pmx").exists()


def test_save_where_it_cannot_write_is_one_error_line(model, tmp_path):
    """--save onto an existing file (even the model itself) or under a file: exit 1 with
    the reason, not an internal error."""
    x = f"in0={EXAMPLE / 'cnn_input.npy'}"
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    for target, reason in [(model, "a file of that name exists"), (blocker / "sub", "cannot create the directory")]:
        r = pmx("run", model, "--input", x, "--repeat", "0", "--save", target)
        assert r.returncode == 1, r.stderr
        assert reason in _one_error_line(r) and "bug in pmx" not in r.stderr
    inputs = tmp_path / "in"
    inputs.mkdir()
    np.save(inputs / "a.npy", np.load(EXAMPLE / "cnn_input.npy"))
    r = pmx("run", model, "--batch-dir", inputs, "--save", blocker)
    assert r.returncode == 1 and "a file of that name exists" in _one_error_line(r)


def test_expect_against_zeros_reports_no_huge_relative_error(model, tmp_path):
    zeros = tmp_path / "zeros.npy"
    np.save(zeros, np.zeros((1, 10), np.float32))
    r = pmx(
        "run",
        model,
        "--input",
        f"in0={EXAMPLE / 'cnn_input.npy'}",
        "--repeat",
        "0",
        "--expect",
        f"out0={zeros}",
        "--json",
    )
    assert r.returncode == 1
    [check] = json.loads(r.stdout)["expect"]
    assert check["max_rel_error"] == 0.0 and 0.05 < check["max_abs_error"] < 1  # softmax outputs against 0


# --- --batch-dir ---------------------------------------------------------------------------


def test_batch_dir_single_input(model, tmp_path):
    rng = np.random.default_rng(1)
    inputs = tmp_path / "in"
    inputs.mkdir()
    xs = {name: rng.standard_normal((1, 3, 64, 64)).astype(np.float32) for name in ("b", "a", "c")}
    for name, x in xs.items():
        np.save(inputs / f"{name}.npy", x)
    (inputs / "notes.txt").write_text("not an input")
    r = pmx("run", model, "--batch-dir", inputs, "--save", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no progress bar: stderr is not a terminal
    assert sorted(os.listdir(tmp_path / "out")) == ["a.npy", "b.npy", "c.npy"]
    sess = InferenceSession(str(model))
    for name, x in xs.items():
        [want] = sess.run(None, {"in0": x})
        np.testing.assert_array_equal(np.load(tmp_path / "out" / f"{name}.npy"), want)


def test_batch_dir_npz_for_several_inputs(two_input_model, tmp_path):
    rng = np.random.default_rng(2)
    inputs = tmp_path / "in"
    inputs.mkdir()
    feeds = {}
    for name in ("x1", "x2"):
        feeds[name] = {k: rng.standard_normal((2, 4)).astype(np.float32) for k in ("in0", "in1")}
        np.savez(inputs / f"{name}.npz", **feeds[name])
    r = pmx("run", two_input_model, "--batch-dir", inputs, "--save", tmp_path / "out", "--json")
    assert r.returncode == 0, r.stderr
    assert [pathlib.Path(f["output"]).name for f in json.loads(r.stdout)["files"]] == ["x1.npy", "x2.npy"]
    for name, feed in feeds.items():
        np.testing.assert_allclose(np.load(tmp_path / "out" / f"{name}.npy"), feed["in0"] + feed["in1"], rtol=1e-6)
    np.save(inputs / "x3.npy", feeds["x1"]["in0"])  # a .npy cannot feed two inputs
    r = pmx("run", two_input_model, "--batch-dir", inputs, "--save", tmp_path / "out")
    assert r.returncode == 1 and "a .npy file feeds a model with one input" in r.stderr


def test_batch_dir_progress_on_a_terminal(model, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for k in range(3):
        np.save(inputs / f"{k}.npy", np.zeros((1, 3, 64, 64), np.float32))
    master, slave = pty.openpty()
    try:
        r = subprocess.run(
            [*PMX, "run", str(model), "--batch-dir", str(inputs), "--save", str(tmp_path / "o")],
            stdout=subprocess.PIPE,
            stderr=slave,
            timeout=300,
        )
        os.close(slave)
        slave = None
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert r.returncode == 0
    assert b"3/3" in seen and b"[" in seen and b"\r" in seen
    r = pmx("run", model, "--batch-dir", inputs, "--save", tmp_path / "o", "-q")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""


# --- errors that say what to do ------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "inspect", "verify"])
def test_foreign_files_say_what_to_do(tmp_path, command):
    (tmp_path / "model.pt").write_bytes(b"PK\x03\x04" + bytes(60))
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07\x12\x04test")
    (tmp_path / "model.ncnn.param").write_text("7767517\n2 1\nInput in0 0 1 in0\n")
    (tmp_path / "model.ncnn.bin").write_bytes(bytes(16))
    extra = ["--random"] if command == "run" else []
    cases = {
        "model.pt": "export it with pnnx first",
        "model.onnx": "pnnx model.onnx inputshape=",
        "model.ncnn.param": "pnnx's ncnn output (model.ncnn.param/.bin) is not pmx input",
        "model.ncnn.bin": "is not pmx input",
        str(EXAMPLE / "cnn.pnnx.param"): "not compiled yet: pmx compile",
        str(EXAMPLE / "cnn.pnnx.bin"): "compile its graph first: pmx compile",
    }
    for name, want in cases.items():
        r = pmx(command, name, *extra, cwd=tmp_path)
        assert r.returncode == 1, (name, r)
        assert want in _one_error_line(r), (name, r.stderr)


def test_compile_of_a_torch_or_onnx_file_says_to_export_it(tmp_path, model):
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07")
    r = pmx("compile", "model.onnx", cwd=tmp_path)
    assert r.returncode == 1 and "pnnx model.onnx inputshape=" in _one_error_line(r)
    r = pmx("compile", model, "-o", tmp_path / "again.pmx")
    assert r.returncode == 1 and "is already compiled" in _one_error_line(r)


# --- internal errors -----------------------------------------------------------------------


def test_internal_error_exits_3_with_a_bug_report_request(model, monkeypatch, capsys):
    from pmx.compiler.cli import main
    from pmx.runtime.kernels.registry import REGISTRY

    node = InferenceSession(str(model)).model.nodes[-1]
    monkeypatch.setattr(REGISTRY[node.op], "make", lambda node, ins, outs, ctx: lambda: [][1])  # noqa: PLE0643 - a kernel bug
    assert main(["run", str(model), "--random", "--repeat", "0"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"internal error: node '{node.name}' ({node.op}) failed at run: IndexError" in err
    assert "report it with the model file" in err


# --- metadata through the CLI, python -m -----------------------------------------------------


def test_meta_round_trip_through_the_cli(tmp_path):
    out = tmp_path / "m.pmx"
    r = pmx(
        "compile", EXAMPLE / "cnn.pnnx.param", "-o", out, "--meta", "author=Ada", "eq=a=b", "--meta", "empty="
    )  # several pairs after one --meta, and the flag repeated
    assert r.returncode == 0, r.stderr
    meta = InferenceSession(str(out)).get_modelmeta().custom_metadata_map
    assert meta == {"author": "Ada", "eq": "a=b", "empty": ""}
    assert json.loads(pmx("inspect", out, "--json").stdout)["metadata"] == meta
    assert "meta    author = Ada" in pmx("inspect", out).stdout


def test_python_dash_m_takes_subcommands(model):
    r = subprocess.run(
        [sys.executable, "-m", "pmx.compiler", "verify", str(model)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "OK" in r.stdout
    r = subprocess.run([sys.executable, "-m", "pmx.compiler", "--version"], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == f"pmx {__version__}"


def test_help_documents_exit_codes():
    r = pmx("--help")
    assert r.returncode == 0
    for line in ("0  success", "1  failure", "2  usage error", "3  internal error", "closed output pipe"):
        assert line in r.stdout


def test_pmx_run_imports_neither_the_compiler_nor_flatbuffers(tmp_path):
    """`pmx run` starts in the compiler package's CLI module, but loads only the runtime:
    the compiler's passes and flatbuffers cost a command-line run tens of milliseconds."""
    example = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example"
    out = tmp_path / "m.pmx"
    subprocess.run(
        [sys.executable, "-m", "pmx.compiler", "compile", str(example / "cnn.pnnx.param"), "-o", str(out), "-q"],
        check=True,
    )
    code = (
        "import sys\n"
        "from pmx.compiler.cli import main\n"
        f"assert main(['run', {str(out)!r}, '--random', '--repeat', '0', '-q']) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'flatbuffers' or m.startswith('pmx.compiler.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    light = {"pmx.compiler.cli", "pmx.compiler.from_torch"}  # no driver, passes or writer
    assert set(ast.literal_eval(result.stdout)) <= light
