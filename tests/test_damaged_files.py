"""Every damaged file is a PmxFormatError: accidental damage before the data section (a
flipped bit anywhere in the preamble, the header or the padding after it) is refused by
the checksums at every load, never loaded, run or reported as another error. The data
section is covered by its checksum under verify=True (tests/test_verify.py), and forged
files with recomputed checksums by the structural and attribute checks
(tests/test_pmx_fuzz.py, tests/test_attr_specs.py)."""

import pathlib

import numpy as np
import pytest

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession, PmxFormatError
from pmx.runtime import fileformat as ff

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    path = tmp_path_factory.mktemp("damaged") / "cnn.pmx"
    compile_model(str(EXAMPLE) + ".pnnx.param", str(EXAMPLE) + ".pnnx.bin", str(path))
    return path.read_bytes()


def _outcome(data):
    """What loading and running `data` gives: None for PmxFormatError, else a description."""
    try:
        sess = InferenceSession(data)
        feed = {}
        for arg, i in zip(sess.get_inputs(), sess.model.inputs):
            t = sess.model.tensors[i]
            feed[arg.name] = np.ones(t.shape, t.dtype)
        sess.run(None, feed)
    except PmxFormatError:
        return None
    except Exception as e:  # anything else is what this test looks for
        return f"{type(e).__name__}: {str(e)[:160]}"
    return "loaded and ran"


def test_every_bit_before_the_data_section_is_checked(example):
    """All single-bit flips of preamble, header and padding (the example's 5.9 kB: 47k
    loads, each refused by the checks that run before the header is read)."""
    data_offset = ff.unpack_preamble(example[: ff.PREAMBLE_SIZE])["data_offset"]
    assert data_offset < 16384, "the example's header grew: this test loads once per bit of it"
    wrong = {}
    flipped = bytearray(example)
    for pos in range(data_offset):
        for bit in range(8):
            flipped[pos] ^= 1 << bit
            found = _outcome(bytes(flipped))
            flipped[pos] ^= 1 << bit
            if found is not None:
                wrong[f"byte {pos} bit {bit}"] = found
    assert not wrong, f"{len(wrong)} flips were not a PmxFormatError, e.g. {list(wrong.items())[:5]}"


def test_the_damage_is_named(example):
    """A flip in the header, one in the stored header CRC and one in the padding each say
    what is damaged."""
    pre = ff.unpack_preamble(example[: ff.PREAMBLE_SIZE])
    header_end = ff.PREAMBLE_SIZE + pre["header_size"]
    cases = {
        ff.PREAMBLE_SIZE + 100: "header checksum mismatch: stored 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}: "
        "the file is damaged",
        48: "preamble checksum",
        header_end: r"the padding between header and data \(bytes \d+\.\.\d+\) is not zero",
    }
    assert header_end < pre["data_offset"], "the example should have padding after its header"
    for pos, message in cases.items():
        bad = bytearray(example)
        bad[pos] ^= 0x04
        with pytest.raises(PmxFormatError, match=f"<model bytes>: {message}"):
            InferenceSession(bytes(bad))
