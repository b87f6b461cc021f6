"""The `pmx` command: compile here, run, inspect and verify from runtime/cli.py.

Conventions (also in `pmx --help`):
  - exit status 0 ok, 1 a failure (a PmxError, an output that does not match --expect),
    2 a usage error (argparse's), 3 an internal error (a bug of pmx: report it);
  - errors print one line on stderr; --debug shows the traceback instead;
  - a closed output pipe (`pmx run m.pmx --random | head -1`) ends pmx quietly with
    status 0, as ripgrep does (not 141 as git's SIGPIPE death: a pipeline under
    `set -o pipefail` should not fail because its reader had seen enough);
  - -q/--quiet prints nothing but errors (and what --json asks for); --json prints one
    JSON document on stdout, dims that may change at run time as null, and on a failure
    {"model": ..., "ok": false, "error": ...} beside the stderr line;
  - progress goes to stderr, only when stderr is a terminal.
"""

import argparse
import json
import os
import sys

from pmx.runtime.cli import (
    EPILOG,
    add_runtime_commands,
    check_model_arg,
    common_flags,
    dispatch_runtime,
    guarded,
    json_failure,
    key_value,
    random_inputs,
)
from pmx.runtime.errors import PmxCompileError
from pmx.runtime.serve.cli import add_serve_command


def _version():
    from pmx.runtime.version import __version__

    return __version__


def _compile(args):
    from pmx.compiler.driver import compile_model

    r = compile_model(  # --dynamic and --shape as given: compile_model takes the CLI's strings
        args.param,
        args.bin,
        args.output,
        keep=args.keep or (),
        verify=args.verify,
        disabled=args.disable or (),
        no_opt=args.no_opt,
        dynamic=list(args.dynamic or ()),
        shape=list(args.shape or ()),
        dtype=list(args.dtype or ()),
        auto_batch=not args.static,
        tune=args.tune,
        metadata=dict(args.meta or ()),
    )
    if not args.quiet:
        _print_summary(args, r)
    if args.check:  # -q too: a check asked for is made (and fails loudly), whatever is printed
        _check_against_trace(args.param, r.output, args.quiet)
    return 0


def _print_summary(args, r):
    replaced = " (replaced the file that was there)" if r.replaced else ""
    print(f"compiled {args.param} -> {r.output}{replaced}")
    print(f"  ops        {r.ops_in} pnnx ops -> {r.ops_out} nodes")
    print(f"  constants  {r.constants} ({r.constant_bytes / 1e6:.2f} MB)")
    print(
        f"  arena      {r.arena_bytes / 1e6:.2f} MB (lower bound {r.lower_bound_bytes / 1e6:.2f} MB, "
        f"unplanned sum {r.naive_bytes / 1e6:.2f} MB)"
    )
    print(f"  file       {r.file_bytes / 1e6:.2f} MB")
    print(f"  time       {r.seconds * 1e3:.0f} ms")
    from pmx.runtime.dim_ranges import format_ranges

    for name, ranges in r.dynamic.items():
        print(f"  input      {name} takes {format_ranges(ranges)}")
    for note in r.notes:
        print(f"  note       {note}")
    if args.verbose:
        for pass_name, rule, hits in r.rule_hits:
            print(f"  rule       {pass_name}: {rule} fired {hits}x")
    if args.tune:
        from pmx.compiler.passes.tune import format_report

        changed = sum(1 for _, rule, chosen, *_ in r.tuned if rule != chosen)
        print(f"  tuned      {len(r.tuned)} nodes timed, {changed} changed from the rule's choice (ms per candidate):")
        for line in format_report(r.tuned, limit=None if args.verbose else 10):
            print(line)


def _check_against_trace(param, output, quiet=False):
    """pmx compile --check: the compiled model against the traced model.pt pnnx wrote
    beside the .param (compiler/from_torch.py), on random inputs of each input's dtype and
    planned shape, as `pmx run --random` draws them, and at twice that batch where the
    batch dim may change; a model that fails it is removed. Where it cannot check (no
    model.pt, no torch) it fails: a check asked for and not made must not pass."""
    pt = param[: -len(".pnnx.param")] + ".pt" if param.endswith(".pnnx.param") else None
    skip = f"{output} was written unchecked; compile without --check to skip the check"
    if pt is None or not os.path.exists(pt):
        raise PmxCompileError(f"--check: no traced model.pt beside {param} to check against (pnnx writes one); {skip}")
    try:
        import torch
    except ImportError:
        raise PmxCompileError(f"--check needs torch, which is not installed here (pip install torch); {skip}") from None
    import numpy as np

    from pmx.compiler.from_torch import check_against_torch, removed_if_it_fails
    from pmx.runtime import InferenceSession

    module = torch.jit.load(pt).eval()
    feed = random_inputs(InferenceSession(output), np.random.default_rng(1))
    pnnx_python = param[: -len(".pnnx.param")] + "_pnnx.py"
    batches = removed_if_it_fails(
        output,
        lambda: check_against_torch(
            module,
            tuple(torch.from_numpy(a) for a in feed.values()),
            output,
            pnnx_python=pnnx_python if os.path.exists(pnnx_python) else None,
        ),
    )
    if not quiet:
        at = f" and at batch {batches[-1]}" if len(batches) > 1 else ""
        print(f"  check      matches {pt} on two random inputs{at}")


def shape_flags(args):
    """--dynamic and --shape as given -> (dynamic, plan_shapes), by compile_model's own
    parser (compiler/shape_specs.py), for the usage checks: a malformed value is exit 2
    naming the flag. Each --shape dim is N (fixed), A..B, A.. or ? (any size); the compile
    checks them against the export: N must equal a dim pnnx recorded with a fixed size
    and a range must contain it; only '?' dims take any N or range."""
    from pmx.compiler.shape_specs import DYNAMIC_TEXT, SHAPE_TEXT, dynamic_option, merge_dynamic, shape_option

    dynamic = dynamic_option(list(args.dynamic or ()), "--dynamic", DYNAMIC_TEXT)
    shaped, plan_shapes = shape_option(list(args.shape or ()), "--shape", SHAPE_TEXT)
    return merge_dynamic(dynamic, shaped), plan_shapes


def _list_ops(args):
    """Every pnnx op type `pmx compile` accepts: the canonicalization rules' keys plus the
    structural ops the frontend consumes itself (inputs, outputs, weights, tuples)."""
    from pmx.compiler.canon import RULES
    from pmx.compiler.pnnx import FRONTEND_OPS

    ops = sorted(set(RULES) | set(FRONTEND_OPS))
    print(json.dumps(ops) if args.json else "\n".join(ops))
    return 0


def build_parser():
    p = argparse.ArgumentParser(
        prog="pmx",
        description="Compile PNNX models to .pmx and run them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-V", "--version", action="version", version=f"pmx {_version()}")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors (and --json output)")
    sub = p.add_subparsers(dest="command", required=True, metavar="{compile,run,inspect,verify,serve}")

    c = sub.add_parser(
        "compile",
        help="compile model.pnnx.param + model.pnnx.bin into model.pmx",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_compile_args(c)
    common_flags(c)

    add_runtime_commands(sub)
    add_serve_command(sub)  # its module imports argparse only; the server loads when it runs
    return p


def add_compile_args(c):
    c.add_argument("param", nargs="?", help="model.pnnx.param")
    c.add_argument("bin", nargs="?", help="model.pnnx.bin (default: beside the .param)")
    c.add_argument(
        "-o",
        "--output",
        help="output .pmx (default: the .param's name with .pmx, beside it); a file there is replaced, "
        "and the summary says so",
    )
    c.add_argument("--keep", action="append", metavar="NAME", help="keep this intermediate tensor fetchable by name")
    c.add_argument("--verify", action="store_true", help="check the graph after every pass")
    c.add_argument("--no-opt", action="store_true", help="skip the optimizing passes")
    c.add_argument("--disable", action="append", metavar="PASS", help="skip one optimizing pass")
    c.add_argument("--list-ops", action="store_true", help="print the supported pnnx op types, one per line, and exit")
    c.add_argument("--json", action="store_true", help="with --list-ops: print a JSON list")
    c.add_argument(
        "--dynamic",
        action="append",
        metavar="NAME:DIM[,DIM]",
        help="let these input dims take any size at run time (dim 0 is tried by default)",
    )
    c.add_argument(
        "--shape",
        action="append",
        metavar="NAME=1..16x3x224x224",
        help="allowed sizes per input dim: N, A..B, A.. or ?; a dim exported with a fixed size "
        "takes that N or a range containing it, a '?' dim any (memory is planned at N or "
        "A; for '?' at a placeholder, and again at the first run's shape)",
    )
    c.add_argument(
        "--dtype",
        action="append",
        metavar="NAME=TYPE",
        help="the dtype of an input pnnx wrote none for (a 0-d input), a numpy name: int64, float32, ...",
    )
    c.add_argument(
        "--static",
        action="store_true",
        help="every dim keeps the size it is compiled for (no dynamic batch); cannot be combined with "
        "--dynamic or a --shape range",
    )
    c.add_argument(
        "--tune", action="store_true", help="time each node's candidate kernels on this machine and store the fastest"
    )
    c.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="list how often each rewrite rule fired (and with --tune every tuned node, not the top 10)",
    )
    c.add_argument(
        "--check",
        action="store_true",
        help="compare the compiled model with the traced model.pt beside the .param (needs torch)",
    )
    c.add_argument(
        "--meta",
        action="extend",
        nargs="+",
        metavar="KEY=VALUE",
        type=key_value,
        help="store these KEY=VALUE pairs in the file (one or more, flag repeatable; "
        "InferenceSession.get_modelmeta()"
        ".custom_metadata_map)",
    )


def _check_compile_options(args, parser):
    """Malformed --dynamic, --shape, --dtype and --disable values are usage errors (exit 2):
    what the model allows is checked when it compiles."""
    from pmx.compiler.passes import PIPELINE
    from pmx.compiler.shape_specs import DTYPE_TEXT, dtype_option
    from pmx.runtime.errors import PmxInputError

    try:
        dynamic, _ = shape_flags(args)
        dtype_option(list(args.dtype or ()), "--dtype", DTYPE_TEXT)
    except PmxInputError as e:
        parser.error(str(e))
    if args.static and any(lo != hi for dims in dynamic.values() for lo, hi in dims.values()):
        given = "--dynamic" if args.dynamic else "a --shape range"
        parser.error(
            f"--static keeps every dim at the size it is compiled for, and {given} asks for dims that "
            f"change: give one or the other"
        )
    passes = [p.name for p in PIPELINE]
    for name in args.disable or ():
        if name not in passes:
            parser.error(f"--disable {name}: no such pass; the passes are {', '.join(passes)}")


def _dispatch(args):
    parser = args._parser
    if args.command == "compile":
        if args.list_ops:
            return _list_ops(args)
        if not args.param:
            parser.error("a model.pnnx.param file is required")
        keys = [k for k, _ in args.meta or ()]
        if len(set(keys)) != len(keys):
            parser.error(f"--meta {next(k for k in keys if keys.count(k) > 1)} given twice")
        if args.json:
            parser.error("--json goes with --list-ops (the compile summary is text)")
        _check_compile_options(args, parser)
        check_model_arg(args.param, "compile")
        return _compile(args)
    if args.command == "serve":
        from pmx.runtime.serve.cli import serve_command

        return serve_command(args)
    return dispatch_runtime(args)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_parser"):
        args._parser = parser
    return guarded(lambda: _dispatch(args), args.debug, json_failure(args))


if __name__ == "__main__":
    sys.exit(main())
