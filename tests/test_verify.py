"""Integrity: the CRC32s of header and data stored in the preamble, checked by
`pmx verify` and by InferenceSession(path, verify=True); off by default, when only the
structural verifier runs."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from pmx.compiler.cli import main
from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession, PmxFormatError
from pmx.runtime import fileformat as ff

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify") / "cnn.pmx"
    compile_model(str(EXAMPLE) + ".pnnx.param", str(EXAMPLE) + ".pnnx.bin", str(path))
    return path


def flipped(good, tmp_path, where):
    """A copy of `good` with one bit flipped in the header or in the middle of the data."""
    data = bytearray(good.read_bytes())
    pre = ff.unpack_preamble(bytes(data[: ff.PREAMBLE_SIZE]))
    if where == "data":
        pos = pre["data_offset"] + pre["data_size"] // 2
    else:  # a byte of the producer string: the header stays structurally valid
        pos = bytes(data).index(b"pmx 0.1")
    data[pos] ^= 0x10
    bad = tmp_path / f"bad_{where}.pmx"
    bad.write_bytes(bytes(data))
    return bad


def test_verify_good_file(good, capsys):
    assert main(["verify", str(good)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "checksums match" in out


@pytest.mark.parametrize("where", ["data", "header"])
def test_verify_flipped_bit(good, tmp_path, capsys, where):
    bad = flipped(good, tmp_path, where)
    assert main(["verify", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{where} checksum mismatch" in err[0]
    assert str(bad) in err[0]


def test_verify_console_script(good, tmp_path):
    """The installed `pmx` command: exit status and one line on stderr."""
    bad = flipped(good, tmp_path, "data")
    script = pathlib.Path(sys.executable).with_name("pmx")
    cmd = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "import sys; from pmx.compiler.cli import main; sys.exit(main())"]
    )
    ok = subprocess.run(cmd + ["verify", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout
    res = subprocess.run(cmd + ["verify", str(bad)], capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.count("\n") == 1 and "data checksum mismatch" in res.stderr


def test_session_verify_catches_flip(good, tmp_path):
    bad = flipped(good, tmp_path, "data")
    with pytest.raises(PmxFormatError, match=r"data checksum mismatch: stored 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}"):
        InferenceSession(str(bad), verify=True)


def test_session_without_verify_loads_flipped_data(good, tmp_path):
    """verify is off by default: a flipped weight bit is structurally valid, so the file
    loads and runs (with a changed weight); only the checksum can tell."""
    bad = flipped(good, tmp_path, "data")
    x = np.load(str(EXAMPLE) + "_input.npy")
    sess = InferenceSession(str(bad))
    (y,) = sess.run(None, {sess.get_inputs()[0].name: x})
    assert y.shape == (1, 10)
    ref = InferenceSession(str(good), verify=True)
    (y_ref,) = ref.run(None, {ref.get_inputs()[0].name: x})
    assert np.isfinite(y_ref).all()


@pytest.mark.parametrize("verify", [False, True])
def test_header_flip_is_refused_at_every_load(good, tmp_path, verify):
    """A flipped bit in a string of the header leaves it structurally valid; the header's
    checksum, checked at every load (it is small), refuses it with or without verify."""
    bad = flipped(good, tmp_path, "header")
    with pytest.raises(PmxFormatError, match=f"{bad}: header checksum mismatch: .* the file is damaged"):
        InferenceSession(str(bad), verify=verify)


def test_preamble_is_always_checked(good, tmp_path):
    """The preamble has its own CRC (and zero reserved bytes), checked on every load."""
    data = bytearray(good.read_bytes())
    for pos in (9, 30, 50, 62):
        bad = bytearray(data)
        bad[pos] ^= 1
        p = tmp_path / f"pre{pos}.pmx"
        p.write_bytes(bytes(bad))
        with pytest.raises(PmxFormatError, match="preamble"):
            InferenceSession(str(p))


def test_verify_missing_and_foreign_files(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope.pmx")]) == 1
    assert "cannot open" in capsys.readouterr().err
    junk = tmp_path / "junk.pmx"
    junk.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    assert main(["verify", str(junk)]) == 1
    assert "not a .pmx file" in capsys.readouterr().err
