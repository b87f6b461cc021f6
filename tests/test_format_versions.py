"""Files written by earlier compilers keep loading and running.

tests/data/se_gate_v3.pmx is a squeeze-and-excitation block, conv -> relu -> y * sigmoid(
conv(mean(y))) -> 1x1 conv, compiled while the compiler still folded such gates into the
1x1 conv's input scale (format version 3). Its expected output is torch's, saved with the
input when the file was made."""

import json
import pathlib
import subprocess
import sys

import numpy as np

from pmx.runtime import InferenceSession
from pmx.runtime import fileformat as ff

DATA = pathlib.Path(__file__).parent / "data"


def test_version_3_conv_with_an_input_scale_runs():
    path = DATA / "se_gate_v3.pmx"
    assert ff.unpack_preamble(path.read_bytes()[:ff.PREAMBLE_SIZE])["version"] == 3
    pmx = pathlib.Path(sys.executable).with_name("pmx")
    info = json.loads(subprocess.run([str(pmx), "inspect", str(path), "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    # no elementwise node: the gate (the second conv's sigmoid output) is the last conv's input scale
    table = info["node_table"]
    assert [row["op"] for row in table] == ["conv", "reduce_mean", "conv", "conv"]
    assert table[2]["expr"] == "sigmoid(@0)" and table[3]["inputs"][3] == table[2]["outputs"][0]
    expected = np.load(DATA / "se_gate_v3_expected.npz")
    sess = InferenceSession(str(path))
    (out,) = sess.run(None, {sess.get_inputs()[0].name: expected["input"]})
    np.testing.assert_allclose(out, expected["output"], rtol=1e-5, atol=1e-6)
    one = sess.run(None, {sess.get_inputs()[0].name: expected["input"][:1]})[0]
    np.testing.assert_allclose(one, expected["output"][:1], rtol=1e-5, atol=1e-6)
