"""The runtime stays small: importing it pulls in numpy and numexpr only (not flatbuffers:
it reads .pmx headers with its own reader, from the layouts in schema/layout.py)."""

import pathlib
import subprocess
import sys
import zipfile

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
    out = subprocess.run(
        [sys.executable, "-c", "import sys, pmx.runtime; print('pmx.compiler' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_runtime_third_party_imports_are_numpy_numexpr():
    stdlib = set(sys.stdlib_module_names)
    third_party = {m for m in _new_top_level_modules() if m not in stdlib and not m.startswith("_")}
    assert third_party <= {"pmx", "numpy", "numexpr"}, third_party


def test_runtime_imports_no_logging_until_it_needs_futures():
    """concurrent.futures brings logging (~3 ms of import): pmx imports it for batches in
    chunks, run_async and BatchingSession only."""
    new = _new_top_level_modules()
    assert "logging" not in new and "concurrent" not in new, new & {"logging", "concurrent"}


def test_runtime_does_not_import_the_generated_schema_code():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, pmx.runtime; print('pmx.schema.pmx_generated' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_committed_layout_is_the_one_the_generated_code_gives():
    """schema/layout.py is written from the generated code (tools/regen_schema.py); a schema
    change that forgot to rewrite it would make the runtime misread files."""
    from pmx.schema import derive_layout, layout, pmx_generated

    assert pathlib.Path(layout.__file__).read_text() == derive_layout.render(pmx_generated)


@pytest.mark.parametrize("module", ["pmx.compiler", "pmx.runtime", "pmx.schema.pmx_generated"])
def test_namespace_packages_import(module):
    __import__(module)


ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "tools" / "example"

WHEEL_CHECK = """
import importlib.metadata, pathlib, sys
import numpy as np
import pmx.compiler, pmx.runtime
from pmx.runtime import InferenceSession

venv = pathlib.Path(sys.argv[1]).resolve()
for mod in (pmx.runtime, pmx.compiler):
    assert venv in pathlib.Path(mod.__file__).resolve().parents, mod.__file__
assert pmx.runtime.__version__ == pmx.compiler.__version__ == importlib.metadata.version("pnnx-pmx")
sess = InferenceSession(sys.argv[2])
[y] = sess.run(None, {"in0": np.load(sys.argv[3])})
expected = np.load(sys.argv[4])
err = float(np.abs(y - expected).max() / np.abs(expected).max())
assert err <= 1e-4, err
from pmx.runtime import blas
assert blas.library().private, blas.library()  # the BLAS pmx owns, from its own wheel
print("ok", pmx.runtime.__version__, sess.model.producer)
"""


def test_wheel_installs_alone_and_runs_the_example(tmp_path):
    """`pip wheel .` gives a wheel that, installed into a fresh venv, compiles and runs the
    shipped example with its console script and matches torch's output. The venv gets
    numpy, numexpr, flatbuffers and scipy-openblas32 from the interpreter under test through a .pth file
    naming their directories (no download), and nothing else: an editable install
    registers itself through a .pth file in its own site-packages, which a directory
    added this way does not run, so pmx can only come from the wheel."""
    import flatbuffers
    import numexpr
    import numpy
    import scipy_openblas32

    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(wheels)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = wheels.glob("pnnx_pmx-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for name in (
        "pmx/runtime/py.typed",
        "pmx/compiler/py.typed",
        "pmx/schema/py.typed",
        "pmx/schema/pmx.fbs",
        "pmx/runtime/version.py",
    ):
        assert name in names, name
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert "License-Expression: BSD-3-Clause" in metadata
    assert "Requires-Dist: flatbuffers>=" in metadata and "==" not in metadata.split("Provides-Extra")[0]
    assert "Requires-Dist: scipy-openblas32>=" in metadata  # pmx's own BLAS, where its wheel ships

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dirs = sorted(
        {str(pathlib.Path(m.__file__).resolve().parent.parent) for m in (numpy, numexpr, flatbuffers, scipy_openblas32)}
    )
    pathlib.Path(purelib, "dependencies.pth").write_text("\n".join(dirs) + "\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]

    env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    model = tmp_path / "cnn.pmx"
    compiled = subprocess.run(
        [str(venv / "bin" / "pmx"), "compile", str(EXAMPLE / "cnn.pnnx.param"), "-o", str(model)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert compiled.returncode == 0, compiled.stderr
    checked = subprocess.run(
        [
            str(py),
            "-c",
            WHEEL_CHECK,
            str(venv),
            str(model),
            str(EXAMPLE / "cnn_input.npy"),
            str(EXAMPLE / "cnn_expected.npy"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("ok 0."), checked.stdout
