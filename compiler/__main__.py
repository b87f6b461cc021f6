"""`python -m pmx.compiler model.pnnx.param model.pnnx.bin -o model.pmx` = `pmx compile ...`."""

import sys

from pmx.compiler.cli import main

if __name__ == "__main__":
    sys.exit(main(["compile", *sys.argv[1:]]))
