"""`pmx compile --list-ops`: the pnnx op types pmx compiles; an op outside that list fails
naming its type, node and .param line."""

import json
import subprocess
import sys
import zipfile

import pytest

from pmx.compiler.canon import RULES
from pmx.compiler.cli import main
from pmx.compiler.driver import compile_model
from pmx.runtime.errors import PmxUnsupportedOpError


def listed(capsys, *extra):
    assert main(["compile", "--list-ops", *extra]) == 0
    return capsys.readouterr().out


def test_one_type_per_line_sorted(capsys):
    lines = listed(capsys).splitlines()
    assert lines == sorted(lines) and len(lines) == len(set(lines))
    assert all(line and line == line.strip() and " " not in line for line in lines)
    # every canonicalization rule, plus what the frontend consumes itself
    assert set(RULES) <= set(lines)
    assert {"nn.Conv2d", "F.relu", "pnnx.Expression", "pnnx.Input", "pnnx.Output", "pnnx.Attribute"} <= set(lines)
    assert set(lines) - set(RULES) <= {
        "pnnx.Input",
        "pnnx.Output",
        "pnnx.Attribute",
        "prim::TupleConstruct",
        "prim::ListConstruct",
    }


def test_json_is_the_same_list(capsys):
    text = listed(capsys)
    ops = json.loads(listed(capsys, "--json"))
    assert isinstance(ops, list) and ops == text.splitlines()


def test_the_docs_give_the_listed_count(capsys):
    """One op count, the registry's, wherever the docs give one."""
    import pathlib
    import re

    count = len(listed(capsys).splitlines())
    root = pathlib.Path(__file__).resolve().parents[1]
    stated = [
        int(n)
        for doc in ("README.md", "docs/design.md")
        for n in re.findall(r"(\d+) (?:supported )?PNNX op types", (root / doc).read_text())
    ]
    assert stated and set(stated) == {count}, (stated, count)


def test_console_script_exits_0():
    p = subprocess.run(
        [sys.executable, "-m", "pmx.compiler", "compile", "--list-ops", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert "nn.Linear" in json.loads(p.stdout)


PARAM = """7767517
4 3
pnnx.Input               pnnx_input_0             0 1 0 #0=(1,4)f32
F.relu                   F.relu_0                 1 1 0 1 #0=(1,4)f32 #1=(1,4)f32
{op:<24} frob_7                   1 1 1 2 dim=1 #1=(1,4)f32 #2=(1,4)f32
pnnx.Output              pnnx_output_0            1 0 2 #2=(1,4)f32
"""


@pytest.mark.parametrize("op", ["torch.frobnicate", "nn.Frobnicate2d", "Tensor.frob_"])
def test_unlisted_op_fails_with_type_node_and_line(tmp_path, capsys, op):
    assert op not in listed(capsys).splitlines()
    param = tmp_path / "m.pnnx.param"
    param.write_text(PARAM.format(op=op))
    with zipfile.ZipFile(tmp_path / "m.pnnx.bin", "w"):
        pass
    with pytest.raises(PmxUnsupportedOpError) as info:
        compile_model(str(param), str(tmp_path / "m.pnnx.bin"), str(tmp_path / "m.pmx"))
    msg = str(info.value)
    assert f"unsupported op {op}" in msg and "node 'frob_7'" in msg and "line 5" in msg, msg
    # the CLI prints the same as one line and exits 1
    assert main(["compile", str(param), "-o", str(tmp_path / "m.pmx")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and op in err and "frob_7" in err and "line 5" in err
