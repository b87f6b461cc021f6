"""The runtime stays small: importing it pulls in numpy, numexpr and flatbuffers only."""

import subprocess
import sys

import pytest

PROBE = """
import sys
before = set(sys.modules)
import pmx.runtime
new = {m.split('.')[0] for m in set(sys.modules) - before}
import json
print(json.dumps(sorted(new)))
"""


def _new_top_level_modules():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    import json

    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_runtime_does_not_import_torch_or_compiler():
    new = _new_top_level_modules()
    assert "torch" not in new
    out = subprocess.run([sys.executable, "-c", "import sys, pmx.runtime; print('pmx.compiler' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_runtime_third_party_imports_are_numpy_numexpr_flatbuffers():
    stdlib = set(sys.stdlib_module_names)
    third_party = {m for m in _new_top_level_modules() if m not in stdlib and not m.startswith("_")}
    assert third_party <= {"pmx", "numpy", "numexpr", "flatbuffers"}, third_party


@pytest.mark.parametrize("module", ["pmx.compiler", "pmx.runtime", "pmx.schema.pmx_generated"])
def test_namespace_packages_import(module):
    __import__(module)
