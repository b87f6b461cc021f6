"""`python -m pmx.compiler ...` is the `pmx` command: `python -m pmx.compiler run m.pmx`.
Arguments that do not start with a subcommand (or --version / --help) mean `pmx compile`,
so `python -m pmx.compiler model.pnnx.param -o model.pmx` compiles, as it always has."""

import sys

from pmx.compiler.cli import main

_COMMANDS = {
    "compile",
    "run",
    "inspect",
    "verify",
    "serve",
    "-V",
    "--version",
    "-h",
    "--help",
    "--debug",
    "-q",
    "--quiet",
}

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(argv if argv and argv[0] in _COMMANDS else ["compile", *argv]))
