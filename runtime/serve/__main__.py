"""`python -m pmx.runtime.serve MODEL.pmx ...` is `pmx serve MODEL.pmx ...`."""

import argparse
import sys

from pmx.runtime.cli import EPILOG, guarded
from pmx.runtime.serve.cli import DESCRIPTION, add_serve_arguments, serve_command


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m pmx.runtime.serve",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("-q", "--quiet", action="store_true", help="no startup lines (warnings and errors still show)")
    args = parser.parse_args(argv)
    return guarded(lambda: serve_command(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
