"""The `pmx` command: compile, run, inspect, verify.

Errors print one line and exit non-zero (1 for a PmxError, 2 for usage, 3 for an
internal error); --debug shows the traceback instead.
"""

import argparse
import json
import sys
import time

import numpy as np


def _compile(args):
    from pmx.compiler.driver import compile_model

    r = compile_model(args.param, args.bin, args.output, keep=args.keep or (), verify=args.verify,
                      disabled=args.disable or (), no_opt=args.no_opt,
                      dynamic=parse_dynamic(args.dynamic or (), args.shape or ()), auto_batch=not args.static,
                      plan_shapes=parse_plan_shapes(args.shape or ()), tune=args.tune)
    print(f"compiled {args.param} -> {r.output}")
    print(f"  ops        {r.ops_in} pnnx ops -> {r.ops_out} nodes")
    print(f"  constants  {r.constants} ({r.constant_bytes / 1e6:.2f} MB)")
    print(f"  arena      {r.arena_bytes / 1e6:.2f} MB (lower bound {r.lower_bound_bytes / 1e6:.2f} MB, "
          f"unplanned sum {r.naive_bytes / 1e6:.2f} MB)")
    print(f"  file       {r.file_bytes / 1e6:.2f} MB")
    print(f"  time       {r.seconds * 1e3:.0f} ms")
    from pmx.runtime.replan import format_ranges

    for name, ranges in r.dynamic.items():
        print(f"  input      {name} takes {format_ranges(ranges)}")
    for note in r.notes:
        print(f"  note       {note}")
    if args.tune:
        from pmx.compiler.passes.tune import format_report

        changed = sum(1 for _, rule, chosen, *_ in r.tuned if rule != chosen)
        print(f"  tuned      {len(r.tuned)} nodes timed, {changed} changed from the rule's choice (ms per candidate):")
        for line in format_report(r.tuned, limit=None if args.verbose else 10):
            print(line)
    return 0


def parse_plan_shapes(shape_specs):
    """--shape in0=1..16x3x224x224 -> {in0: (1, 3, 224, 224)}: the size memory is planned
    for (a range's lower end), used for inputs pnnx wrote with '?' dims."""
    out = {}
    for spec in shape_specs:
        name, _, dims = spec.partition("=")
        plan = []
        for d in dims.split("x"):
            head = d.split("..")[0]
            plan.append(int(head) if head.isdigit() else None)
        out[name] = tuple(plan)
    return out


def parse_dynamic(dynamic_specs, shape_specs):
    """--dynamic in0:0,2  and  --shape in0=1..16x3x224x224 -> {name: {dim: (min, max)}}.
    In --shape, each dim is N (fixed), A..B (range), A.. (from A up) or ? (any size)."""
    from pmx.runtime.errors import PmxCompileError

    out = {}
    for spec in dynamic_specs:
        name, sep, dims = spec.partition(":")
        try:
            assert sep and name
            for d in dims.split(","):
                out.setdefault(name, {})[int(d)] = (1, -1)
        except (AssertionError, ValueError):
            raise PmxCompileError(f"--dynamic {spec!r}: expected NAME:DIM[,DIM...], e.g. in0:0") from None
    for spec in shape_specs:
        name, sep, dims = spec.partition("=")
        if not sep or not name:
            raise PmxCompileError(f"--shape {spec!r}: expected NAME=DIMxDIMx..., e.g. in0=1..16x3x224x224")
        for i, d in enumerate(dims.split("x")):
            try:
                if d == "?":
                    rng = (1, -1)
                elif ".." in d:
                    lo, hi = d.split("..")
                    rng = (int(lo), int(hi) if hi else -1)
                    if rng[0] < 1 or (rng[1] != -1 and rng[1] < rng[0]):
                        raise ValueError
                else:
                    continue  # a fixed dim: nothing to declare
            except ValueError:
                raise PmxCompileError(f"--shape {spec!r}: dim {i} {d!r} is not N, A..B, A.. or ?") from None
            out.setdefault(name, {})[i] = rng
    return out


def _list_ops(args):
    """Every pnnx op type `pmx compile` accepts: the canonicalization rules' keys plus the
    structural ops the frontend consumes itself (inputs, outputs, weights, tuples)."""
    from pmx.compiler.canon import RULES
    from pmx.compiler.pnnx import FRONTEND_OPS

    ops = sorted(set(RULES) | set(FRONTEND_OPS))
    print(json.dumps(ops) if args.json else "\n".join(ops))
    return 0


def _feed(sess, inputs, random):
    from pmx.runtime.errors import PmxInputError

    given = {}
    for item in inputs or ():
        name, eq, path = item.partition("=")
        if not eq:
            raise PmxInputError(f"--input {item!r}: expected name=file.npy")
        try:
            given[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise PmxInputError(f"--input {name}: cannot read {path}: {e}") from None
    rng = np.random.default_rng(0)
    for arg in sess.get_inputs():
        if arg.name in given:
            continue
        if not random and inputs:
            continue
        shape = [d if d is not None else 1 for d in arg.shape]
        dtype = np.dtype(_np_type(arg.type))
        if dtype.kind == "f":
            given[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            given[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            given[arg.name] = rng.integers(0, 10, shape).astype(dtype)
    return given


def _np_type(ort_type):
    from pmx.runtime.dtypes import ORT_TYPE

    return {v: k for k, v in ORT_TYPE.items()}[ort_type]


def _run(args):
    from pmx.runtime import InferenceSession

    t0 = time.perf_counter()
    sess = InferenceSession(args.model, num_threads=args.threads, workers=args.workers)
    load_ms = (time.perf_counter() - t0) * 1e3
    feed = _feed(sess, args.input, args.random)
    t0 = time.perf_counter()
    outputs = sess.run(None, feed)
    first_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append((time.perf_counter() - t0) * 1e3)
    for arg, y in zip(sess.get_outputs(), outputs):
        flat = y.reshape(-1)[:6]
        print(f"{arg.name}: shape {list(y.shape)} {y.dtype}  first values {np.array2string(flat, precision=5, separator=', ')}")
    steady = f", median of {args.repeat} runs {np.median(times):.2f} ms" if times else ""
    print(f"load {load_ms:.2f} ms, first run {first_ms:.2f} ms{steady}")
    if args.profile:
        _print_profile(sess.profile(feed, repeat=max(args.repeat, 5)))
    return 0


def _print_profile(rows):
    total = sum(r["ms"] for r in rows) or 1.0
    print(f"\n{'op':<18} {'variant':<10} {'name':<28} {'input shapes':<30} {'ms':>8} {'%':>6}")
    for r in rows:
        shapes = " ".join("x".join(map(str, s)) for s in r["in_shapes"])[:30]
        print(f"{r['op']:<18} {r['variant']:<10} {r['name'][:28]:<28} {shapes:<30} {r['ms']:>8.3f} {100 * r['ms'] / total:>5.1f}%")
    print(f"{'total':<88} {total:>8.3f}")


def inspect_dict(model):
    """Everything `pmx inspect` reports, as one JSON-able dict."""
    from pmx.runtime.plan import lower_bound
    from pmx.runtime.replan import root_buffers
    from pmx.schema.pmx_generated import TensorKind

    t = model.tensors
    _, buffers = root_buffers(model, [x.shape for x in t], lambda i: model.roots[i][0])
    naive = sum(ti.nbytes for ti in t if ti.kind != TensorKind.Constant)  # one buffer per tensor
    return {
        "file": model.path,
        "producer": model.producer,
        "source": model.source,
        "file_bytes": model.file_size,
        "inputs": [dict(name=t[i].name, shape=list(t[i].shape), dtype=t[i].dtype.name) for i in model.inputs],
        "outputs": [dict(name=t[i].name, shape=list(t[i].shape), dtype=t[i].dtype.name) for i in model.outputs],
        "kept": [t[i].name for i in model.kept],
        "nodes": len(model.nodes),
        "constants": sum(1 for x in t if x.kind == TensorKind.Constant),
        "constant_bytes": sum(x.data_size for x in t if x.kind == TensorKind.Constant),
        "arena_bytes": model.arena_size,
        "lower_bound_bytes": lower_bound(buffers),
        "naive_bytes": naive,
        "passes": [dict(name=a, nodes_before=b, nodes_after=c) for a, b, c in model.pass_stats],
        "node_table": [
            dict(op=nd.op, name=nd.name, variant=nd.variant,
                 inputs=[t[i].name if i >= 0 else None for i in nd.inputs],
                 outputs=[t[i].name for i in nd.outputs],
                 shapes=[list(t[i].shape) for i in nd.outputs], expr=nd.expr)
            for nd in model.nodes
        ],
    }


def _inspect(args):
    from pmx.runtime.load import open_model

    info = inspect_dict(open_model(args.model))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{info['file']}  ({info['file_bytes'] / 1e6:.2f} MB, {info['producer']}, from {info['source']})")
    for kind in ("inputs", "outputs"):
        for x in info[kind]:
            print(f"  {kind[:-1]:<7} {x['name']:<12} {x['shape']} {x['dtype']}")
    print("passes (nodes before -> after):")
    for p in info["passes"]:
        print(f"  {p['name']:<22} {p['nodes_before']:>5} -> {p['nodes_after']}")
    print(f"memory: arena {info['arena_bytes']} B, lower bound {info['lower_bound_bytes']} B, "
          f"unplanned sum {info['naive_bytes']} B")
    print(f"\n{'#':>4} {'op':<18} {'variant':<10} {'name':<32} output shapes")
    for j, nd in enumerate(info["node_table"]):
        shapes = ", ".join("x".join(map(str, s)) for s in nd["shapes"])
        print(f"{j:>4} {nd['op']:<18} {nd['variant']:<10} {nd['name'][:32]:<32} {shapes}")
    return 0


def _verify(args):
    from pmx.runtime.load import open_model

    model = open_model(args.model, verify_checksum=True)
    pre = model.preamble
    print(f"{args.model}: OK ({model.file_size} bytes, {len(model.nodes)} nodes, {len(model.tensors)} tensors, "
          f"structure valid, header and data checksums match: "
          f"{pre['header_crc']:#010x} {pre['data_crc']:#010x})")
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="pmx", description="Compile PNNX models to .pmx and run them.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile model.pnnx.param + model.pnnx.bin into model.pmx")
    add_compile_args(c)
    c.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    r = sub.add_parser("run", help="run a .pmx model on given or random inputs")
    r.add_argument("model")
    r.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    r.add_argument("--random", action="store_true", help="random inputs for those not given")
    r.add_argument("--repeat", type=int, default=10, help="timed runs after the first (default 10)")
    r.add_argument("--threads", type=int, default=None,
                   help="threads for BLAS, numexpr and kernel splits (default: all cores)")
    r.add_argument("--workers", choices=("threads", "processes"), default=None,
                   help="what runs the second half of split kernels: worker threads (default) or a forked "
                        "worker process (Linux; the PMX_WORKERS environment variable sets the same)")
    r.add_argument("--profile", action="store_true", help="print per-node times")
    r.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    i = sub.add_parser("inspect", help="print inputs, outputs, passes, memory plan and nodes")
    i.add_argument("model")
    i.add_argument("--json", action="store_true")
    i.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    v = sub.add_parser("verify", help="check a .pmx file's structure and checksums")
    v.add_argument("model")
    v.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


def add_compile_args(c):
    c.add_argument("param", nargs="?", help="model.pnnx.param")
    c.add_argument("bin", nargs="?", help="model.pnnx.bin (default: beside the .param)")
    c.add_argument("-o", "--output", help="output .pmx (default: beside the .param)")
    c.add_argument("--keep", action="append", metavar="NAME", help="keep this intermediate tensor fetchable by name")
    c.add_argument("--verify", action="store_true", help="check the graph after every pass")
    c.add_argument("--no-opt", action="store_true", help="skip the optimizing passes")
    c.add_argument("--disable", action="append", metavar="PASS", help="skip one optimizing pass")
    c.add_argument("--list-ops", action="store_true", help="print the supported pnnx op types, one per line, and exit")
    c.add_argument("--json", action="store_true", help="with --list-ops: print a JSON list")
    c.add_argument("--dynamic", action="append", metavar="NAME:DIM[,DIM]",
                   help="let these input dims take any size at run time (dim 0 is tried by default)")
    c.add_argument("--shape", action="append", metavar="NAME=1..16x3x224x224",
                   help="allowed sizes per input dim: N, A..B, A.. or ?")
    c.add_argument("--static", action="store_true", help="do not make the batch dim dynamic by default")
    c.add_argument("--tune", action="store_true",
                   help="time each node's candidate kernels on this machine and store the fastest")
    c.add_argument("--verbose", action="store_true", help="with --tune: list every tuned node, not the top 10")


def _dispatch(args):
    if args.command == "compile":
        if args.list_ops:
            return _list_ops(args)
        if not args.param:
            raise SystemExit("pmx compile: a .pnnx.param file is required")
        return _compile(args)
    return {"run": _run, "inspect": _inspect, "verify": _verify}[args.command](args)


def main(argv=None, prog_args=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    return guarded(lambda: _dispatch(args), args.debug)


def guarded(fn, debug):
    from pmx.runtime.errors import PmxError

    try:
        return fn()
    except PmxError as e:
        if debug:
            raise
        print(f"pmx: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI never shows a bare traceback
        if debug:
            raise
        print(f"pmx: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
