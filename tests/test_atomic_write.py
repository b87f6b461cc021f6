"""Atomic output: compile writes a temporary file in the target directory, fsyncs it and
renames it over the target. A failure at any byte leaves the previous file byte-identical
and no temporary behind; compile refuses to overwrite its own inputs."""

import os
import pathlib
import shutil
import textwrap

import numpy as np
import pytest

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession, PmxError

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"
PARAM, BIN = str(EXAMPLE) + ".pnnx.param", str(EXAMPLE) + ".pnnx.bin"


@pytest.fixture()
def previous(tmp_path):
    """A directory holding a good model.pmx from an earlier compile."""
    out = tmp_path / "model.pmx"
    compile_model(PARAM, BIN, str(out))
    return out


def listing(directory):
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("fail_after", [0, 1, 63, 64, 100, 1000, "header end", "half", "last byte"])
def test_failure_mid_write_keeps_previous_file(previous, fail_after):
    before = previous.read_bytes()
    from pmx.runtime import fileformat as ff

    pre = ff.unpack_preamble(before[:64])
    fail_after = {"header end": 64 + pre["header_size"], "half": len(before) // 2, "last byte": len(before) - 1}.get(
        fail_after, fail_after
    )
    files_before = listing(previous.parent)
    with pytest.raises(PmxError, match="simulated failure"):
        compile_model(PARAM, BIN, str(previous), _fail_after_bytes=fail_after)
    assert previous.read_bytes() == before
    assert listing(previous.parent) == files_before, "a temporary file was left behind"
    InferenceSession(str(previous), verify=True)


def test_failure_mid_write_with_no_previous_file(tmp_path):
    out = tmp_path / "fresh.pmx"
    with pytest.raises(PmxError, match="simulated failure"):
        compile_model(PARAM, BIN, str(out), _fail_after_bytes=5000)
    assert listing(tmp_path) == []


def test_every_failure_point_leaves_no_trace(previous):
    """A failure after each of many byte counts spread over the whole file."""
    before = previous.read_bytes()
    for n in np.linspace(0, len(before) - 1, 25).astype(int):
        with pytest.raises(PmxError):
            compile_model(PARAM, BIN, str(previous), _fail_after_bytes=int(n))
        assert previous.read_bytes() == before
        assert listing(previous.parent) == ["model.pmx"]


def test_success_replaces_and_keeps_mode(previous):
    os.chmod(previous, 0o640)
    stale = previous.read_bytes()
    previous.write_bytes(b"junk")  # an earlier, damaged output
    os.chmod(previous, 0o640)
    compile_model(PARAM, BIN, str(previous))
    assert previous.read_bytes() == stale
    assert previous.stat().st_mode & 0o777 == 0o640
    assert listing(previous.parent) == ["model.pmx"]


def test_new_file_gets_umask_mode(tmp_path):
    out = tmp_path / "m.pmx"
    old = os.umask(0o022)
    try:
        compile_model(PARAM, BIN, str(out))
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644, "not the 0600 of a raw temporary file"


@pytest.mark.parametrize("which", ["param", "bin"])
def test_refuses_to_overwrite_inputs(tmp_path, which):
    param, bin_ = tmp_path / "m.pnnx.param", tmp_path / "m.pnnx.bin"
    shutil.copy(PARAM, param)
    shutil.copy(BIN, bin_)
    target = param if which == "param" else bin_
    before = target.read_bytes()
    with pytest.raises(PmxError, match="refusing to overwrite the input"):
        compile_model(str(param), str(bin_), str(target))
    assert target.read_bytes() == before
    assert listing(tmp_path) == ["m.pnnx.bin", "m.pnnx.param"]


def test_refuses_to_overwrite_input_through_a_link(tmp_path):
    param, bin_ = tmp_path / "m.pnnx.param", tmp_path / "m.pnnx.bin"
    shutil.copy(PARAM, param)
    shutil.copy(BIN, bin_)
    link = tmp_path / "out.pmx"
    link.symlink_to(bin_)
    with pytest.raises(PmxError, match="refusing to overwrite the input"):
        compile_model(str(param), str(bin_), str(link))
    assert bin_.read_bytes() == pathlib.Path(BIN).read_bytes()


def test_missing_output_directory(tmp_path):
    out = tmp_path / "no" / "such" / "dir" / "m.pmx"
    with pytest.raises(PmxError, match="does not exist"):
        compile_model(PARAM, BIN, str(out))
    assert not (tmp_path / "no").exists()


def test_output_is_a_directory(tmp_path):
    (tmp_path / "m.pmx").mkdir()
    with pytest.raises(PmxError, match="is a directory"):
        compile_model(PARAM, BIN, str(tmp_path / "m.pmx"))
    assert listing(tmp_path) == ["m.pmx"]


def test_unwritable_directory(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(PmxError, match="cannot write"):
            compile_model(PARAM, BIN, str(d / "m.pmx"))
    finally:
        d.chmod(0o700)


def test_cli_failure_exit_code(previous, capsys):
    """`pmx compile` turns the same failures into one line and exit status 1."""
    from pmx.compiler.cli import main

    rc = main(["compile", PARAM, "-o", str(previous.parent / "missing" / "m.pmx")])
    assert rc == 1
    assert "does not exist" in capsys.readouterr().err


def test_sigkill_mid_write_keeps_previous_file(previous):
    """A compile killed with SIGKILL (no cleanup can run) after writing the temporary but
    before the rename: the previous file is untouched. The torn temporary stays behind
    (hidden, named .model.pmx.*.tmp) - nothing can remove it from inside a killed process."""
    import signal
    import subprocess
    import sys

    before = previous.read_bytes()
    child = textwrap.dedent(f"""
        import os, sys, time
        from pmx.compiler.driver import compile_model

        def stall(fd):
            sys.stdout.write("writing\\n"); sys.stdout.flush()
            time.sleep(60)

        os.fsync = stall
        compile_model({PARAM!r}, {BIN!r}, {str(previous)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        temps = [n for n in listing(previous.parent) if n.endswith(".tmp")]
        assert len(temps) == 1 and temps[0].startswith(".model.pmx.")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert previous.read_bytes() == before
    InferenceSession(str(previous), verify=True)
