"""Files written by earlier compilers keep loading and running.

Each file in tests/data was compiled while the compiler still made a form it no longer
makes, and its expected output is torch's, saved with the input when the file was made:
- se_gate_v3.pmx, a squeeze-and-excitation block (conv -> relu -> y * sigmoid(conv(mean(y)))
  -> 1x1 conv), whose gate was folded into the 1x1 conv's input scale (format version 3);
- shuffle_split_v3.pmx, two ShuffleNetV2 units (chunk, 1x1 conv branch, cat, channel
  shuffle), whose first shuffle writes the next unit's chunks itself (sizes, version 3)."""

import json
import pathlib
import subprocess
import sys

import numpy as np

from pmx.runtime import InferenceSession
from pmx.runtime import fileformat as ff

DATA = pathlib.Path(__file__).parent / "data"


def node_table(path):
    assert ff.unpack_preamble(path.read_bytes()[: ff.PREAMBLE_SIZE])["version"] == 3
    pmx = pathlib.Path(sys.executable).with_name("pmx")
    info = json.loads(
        subprocess.run([str(pmx), "inspect", str(path), "--json"], capture_output=True, text=True, check=True).stdout
    )
    return info["node_table"]


def matches_torch(path):
    expected = np.load(path.with_name(path.stem + "_expected.npz"))
    sess = InferenceSession(str(path))
    name = sess.get_inputs()[0].name
    np.testing.assert_allclose(sess.run(None, {name: expected["input"]})[0], expected["output"], rtol=1e-5, atol=1e-6)
    # another batch size: the stored plan is re-planned
    np.testing.assert_allclose(
        sess.run(None, {name: expected["input"][:1]})[0], expected["output"][:1], rtol=1e-5, atol=1e-6
    )


def test_version_3_conv_with_an_input_scale_runs():
    path = DATA / "se_gate_v3.pmx"
    # no elementwise node: the gate (the second conv's sigmoid output) is the last conv's input scale
    table = node_table(path)
    assert [row["op"] for row in table] == ["conv", "reduce_mean", "conv", "conv"]
    assert table[2]["expr"] == "sigmoid(@0)" and table[3]["inputs"][3] == table[2]["outputs"][0]
    matches_torch(path)


def test_version_3_channel_shuffle_into_parts_runs():
    path = DATA / "shuffle_split_v3.pmx"
    table = node_table(path)
    shuffles = [row for row in table if row["op"] == "channel_shuffle"]
    assert len(shuffles) == 2 and len(shuffles[0]["outputs"]) == 2, "the first shuffle writes the split's parts"
    assert [row["op"] for row in table].count("split") == 1
    matches_torch(path)
