"""The `pmx` commands that need only the runtime: run, inspect, verify, and the command
line's shared conventions (exit statuses, one-line errors, a closed pipe, -q and --json;
listed in EPILOG and in `pmx --help`). compiler/cli.py adds `compile` and the entry point.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from pmx.runtime.errors import PmxInputError
from pmx.runtime.options import DEFAULT_THREADS_TEXT

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

EPILOG = """exit status:
  0  success
  1  failure: an error in the model, a file or the inputs, or outputs that do not match --expect
  2  usage error (a wrong or missing argument)
  3  internal error: a bug in pmx; please report it with the model file and the command

A closed output pipe (pmx run m.pmx --random | head -1) ends pmx quietly with status 0.
"""


class _Failure(Exception):
    """A check the command made failed (an --expect mismatch): exit 1, message printed."""


# --- arguments -------------------------------------------------------------------------------


def int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number_above(low, inclusive=True, finite=True):
    """argparse type: a number >= low (> low unless inclusive), never nan, and finite
    unless finite=False."""
    word = ">=" if inclusive else ">"

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {word} {low}, got {text!r}") from None
        ok = value >= low if inclusive else value > low  # False for nan
        if not ok or (finite and value == float("inf")):
            raise argparse.ArgumentTypeError(f"expected a number {word} {low}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


_tolerance = number_above(0, finite=False)


def _name_equals(what):
    def parse(text):
        name, eq, value = text.partition("=")
        if not eq or not name or not value:
            raise argparse.ArgumentTypeError(f"expected NAME={what}, got {text!r}")
        return text

    parse.__name__ = f"NAME={what}"
    return parse


def _fixed_shape(text):
    """NAME=8x3x64x64 (NAME= for a 0-d input) -> (NAME, (8, 3, 64, 64))."""
    name, eq, dims = text.partition("=")
    try:
        shape = tuple(int(d) for d in dims.split("x")) if dims else ()
    except ValueError:
        shape = None
    if not name or not eq or shape is None or any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"expected NAME=8x3x64x64 (sizes, x between them), got {text!r}")
    return name, shape


def key_value(text):
    key, eq, value = text.partition("=")
    if not eq or not key:
        # --meta takes one or more pairs, so a model path after it reads as one more
        hint = " (a file: give it before --meta, or end the pairs with --)" if os.path.exists(text) else ""
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}{hint}")
    return key, value


key_value.__name__ = "KEY=VALUE"


def common_flags(sub):
    """--debug and -q on a subcommand as on pmx itself (SUPPRESS: an option given before
    the subcommand is not reset by the subcommand's default)."""
    sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print nothing but errors (and --json output)",
    )
    sub.set_defaults(_parser=sub)


def add_runtime_commands(sub):
    """The run, inspect and verify subcommands, on `sub` (argparse subparsers)."""
    r = sub.add_parser(
        "run",
        help="run a .pmx model on given or random inputs",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a .pmx model once (then --repeat more times, timed) and print its outputs. "
        "Every input needs --input NAME=FILE.npy unless --random is given.",
    )
    r.add_argument("model")
    r.add_argument(
        "--input",
        action="append",
        metavar="NAME=FILE.npy",
        type=_name_equals("FILE.npy"),
        help="an input's value (repeat for each input)",
    )
    r.add_argument("--random", action="store_true", help="random values for the inputs not given with --input")
    r.add_argument(
        "--shape",
        action="append",
        metavar="NAME=8x3x64x64",
        type=_fixed_shape,
        help="with --random: the shape of that input's random values (a dynamic dim takes any size "
        "its range allows; default: the shape the model was compiled for)",
    )
    r.add_argument("--repeat", type=int_at_least(0), default=10, help="timed runs after the first (default 10)")
    r.add_argument(
        "--warmup",
        type=number_above(0),
        default=WARM_SECONDS,
        metavar="SECONDS",
        help=f"with --repeat: warm-up runs for at least this long before the timed ones (default "
        f"{WARM_SECONDS:g}; 0: only until the session has chosen how to use its threads), "
        f"at most {SETTLE_SECONDS:g} s in all",
    )
    r.add_argument(
        "--threads",
        type=int_at_least(1),
        default=None,
        help=f"threads of this run's kernel splits (default: {DEFAULT_THREADS_TEXT})",
    )
    r.add_argument("--profile", action="store_true", help="print per-node times")
    r.add_argument("--json", action="store_true", help="print the results as JSON")
    r.add_argument(
        "--save",
        metavar="DIR",
        help="save each output, and each tensor kept with pmx compile --keep, as DIR/<name>.npy "
        "(with --batch-dir: DIR/<input file stem>.npy, or .npz for several)",
    )
    r.add_argument(
        "--expect",
        action="append",
        metavar="NAME=FILE.npy",
        type=_name_equals("FILE.npy"),
        help="compare output NAME with FILE.npy; exit 1 on a mismatch, printing the largest error",
    )
    r.add_argument("--rtol", type=_tolerance, default=1e-4, help="--expect: relative tolerance (default 1e-4)")
    r.add_argument(
        "--atol",
        type=_tolerance,
        default=1e-5,
        help="--expect: absolute tolerance (default 1e-5); passes where |out - expected| <= atol + rtol * |expected|",
    )
    r.add_argument(
        "--batch-dir",
        metavar="DIR",
        help="run every .npy (the input of a single-input model) and .npz (one array per input name) "
        "in DIR, sorted by name; needs --save",
    )
    common_flags(r)

    i = sub.add_parser("inspect", help="print inputs, outputs, metadata, passes, memory plan and nodes")
    i.add_argument("model")
    i.add_argument("--json", action="store_true", help="print it as JSON (dims that may change as null)")
    common_flags(i)

    v = sub.add_parser("verify", help="check a .pmx file's structure and checksums")
    v.add_argument("model")
    v.add_argument("--json", action="store_true", help='print the result as JSON ({"ok": false, ...} on failure)')
    common_flags(v)


def dispatch_runtime(args):
    parser = args._parser
    if args.command == "run":
        if args.batch_dir is not None:
            if not args.save:
                parser.error("--batch-dir needs --save DIR for the outputs")
            clash = [
                o
                for o, v in (
                    ("--input", args.input),
                    ("--random", args.random),
                    ("--expect", args.expect),
                    ("--profile", args.profile),
                    ("--shape", args.shape),
                )
                if v
            ]
            if clash:
                parser.error(f"--batch-dir takes its inputs from the directory; it cannot be combined with {clash[0]}")
        elif args.shape and not args.random:
            parser.error("--shape sets the shape of --random inputs; give --random too")
        elif args.expect is None and (args.rtol != 1e-4 or args.atol != 1e-5):
            parser.error("--rtol/--atol apply to --expect")
    return {"run": _run, "inspect": _inspect, "verify": _verify}[args.command](args)


# --- what a file is, when it is not a .pmx ----------------------------------------------


def check_model_arg(path, command):
    from pmx.runtime.errors import PmxInputError
    from pmx.runtime.hints import foreign_model_hint

    hint = foreign_model_hint(path, command)
    if hint is not None:
        raise PmxInputError(hint)


# --- pmx run -------------------------------------------------------------------------------


def _read_array(spec, what):
    from pmx.runtime.errors import PmxInputError

    name, _, path = spec.partition("=")
    try:
        with open(path, "rb") as f:
            is_npy = f.read(len(_NPY_MAGIC)) == _NPY_MAGIC
        array = np.load(path, allow_pickle=False) if is_npy else None
    except OSError as e:
        raise PmxInputError(f"{what} {name}: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        if "allow_pickle" in str(e):  # numpy's advice to unpickle is not ours to give
            raise PmxInputError(
                f"{what} {name}: {path} holds Python objects, not numbers (pmx never unpickles); "
                f"save a numeric array with numpy.save"
            ) from None
        raise PmxInputError(f"{what} {name}: cannot read {path}: {e}") from None
    if array is None:
        raise PmxInputError(
            f"{what} {name}: {path} is not a .npy file (no .npy header); save the array with numpy.save"
        )
    return name, array


_NPY_MAGIC = b"\x93NUMPY"


def _feed(sess, inputs, random, parser, shapes=None):
    """The inputs of one run: those given with --input, random values for the others
    with --random (of the --shape given, else the planned one); without --random a
    missing input is a usage error naming it."""
    from pmx.runtime.errors import PmxInputError

    given = dict(_read_array(item, "--input") for item in inputs or ())
    names = [a.name for a in sess.get_inputs()]
    unknown = [n for n in given if n not in names]
    if unknown:
        raise PmxInputError(f"--input {unknown[0]}: the model has no such input; its inputs are {names}")
    for item in inputs or ():
        _check_file_dtype(sess, item, given)
    missing = [a for a in sess.get_inputs() if a.name not in given]
    if missing and not random:
        listed = ", ".join(f"{a.name} {_allowed_text(sess, a.name)} {_np_type(a.type)}" for a in missing)
        example = " ".join(f"--input {a.name}={a.name}.npy" for a in missing)
        parser.error(f"no value for input(s) {listed}: pass {example}, or --random for random values")
    shapes = dict(shapes or ())
    unknown = [n for n in shapes if n not in names] or [n for n in shapes if n in given]
    if unknown:
        why = "is given with --input" if unknown[0] in given else f"is no input of the model; its inputs are {names}"
        raise PmxInputError(f"--shape {unknown[0]}: {unknown[0]} {why} (--shape sets random inputs' shapes)")
    drawn = random_inputs(sess, np.random.default_rng(0), shapes=shapes)
    return {**{a.name: drawn[a.name] for a in missing}, **given}


def _check_file_dtype(sess, item, given):
    """An --input file of another dtype than its input's: named with the file, and the
    line of numpy that saves it right (pmx never casts an input: a cast can lose values)."""
    from pmx.runtime.errors import PmxInputError

    name, _, path = item.partition("=")
    want = np.dtype(_np_type(next(a.type for a in sess.get_inputs() if a.name == name)))
    if given[name].dtype != want:
        raise PmxInputError(
            f"--input {item}: {path} holds {given[name].dtype}, input {name} takes {want}; "
            f"save it as {want}: numpy.save(path, array.astype(numpy.{want}))"
        )


def random_inputs(sess, rng, batch=None, shapes=None):
    """{input name: random array} of each input's planned shape (dim 0 `batch` if given;
    `shapes[name]` where given) and dtype, in ranges models take: normal floats, bools,
    and integers 0..9 (small enough for token ids and indices)."""
    feed = {}
    for arg, shape in zip(sess.get_inputs(), _planned_shapes(sess)):
        if batch is not None and shape:
            shape = [batch, *shape[1:]]
        shape = (shapes or {}).get(arg.name, shape)
        dtype = np.dtype(_np_type(arg.type))
        if dtype.kind in "fc":
            feed[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feed[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feed[arg.name] = rng.integers(0, 10, shape).astype(dtype)
    return feed


def _planned_shapes(sess):
    """Each input's shape the compile planned memory for: the exported size of a dynamic
    dim, or the size chosen for a '?' dim, where the model is known to take it."""
    model = sess.model
    return [list(model.tensors[i].shape) for i in model.inputs]


def _allowed_text(sess, name):
    """The shapes an input takes, spelled as every message and `inspect` spell them: [1.., 3, 64, 64]."""
    from pmx.runtime.dim_ranges import format_ranges, tensor_ranges

    model = sess.model
    (t,) = (model.tensors[i] for i in model.inputs if model.tensors[i].name == name)
    return format_ranges(tensor_ranges(t))


def _np_type(ort_type):
    from pmx.runtime.dtypes import ORT_TYPE

    return {v: k for k, v in ORT_TYPE.items()}[ort_type]


def _file_stem(name):
    """An output name as a file name: path separators and other odd characters become _."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip(".")
    return safe or "output"


def _save_outputs(directory, names, outputs):
    _make_output_dir(directory)
    paths = []
    for name, y in zip(names, outputs):
        path = os.path.join(directory, _file_stem(name) + ".npy")
        try:
            np.save(path, y)
        except OSError as e:
            raise PmxInputError(f"--save {directory}: cannot write {path}: {e.strerror or e}") from None
        paths.append(path)
    return paths


def _make_output_dir(directory):
    """--save DIR made if missing; a PmxInputError (exit 1) where it cannot be: a file of
    that name, or no permission."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise PmxInputError(f"--save {directory}: a file of that name exists; --save takes a directory")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise PmxInputError(f"--save {directory}: cannot create the directory: {e.strerror or e}") from None


def _compare(name, got, path, want, rtol, atol):
    """One --expect check as a dict: ok, and the largest errors (|got - want| and that
    over |want|) with where the worst one is."""
    row = dict(name=name, file=path, ok=False, rtol=rtol, atol=atol)
    if got.shape != want.shape:
        row["error"] = f"shape {list(got.shape)} != expected {list(want.shape)}"
        return row
    if got.size == 0:
        return dict(row, ok=True, max_abs_error=0.0, max_rel_error=0.0)
    a, b = got.astype(np.float64), want.astype(np.float64)
    diff = np.abs(a - b)
    nan_ok = np.isnan(a) == np.isnan(b)
    diff = np.where(np.isnan(a) & np.isnan(b), 0.0, diff)
    worst = int(np.nanargmax(np.where(np.isnan(diff), np.inf, diff)))
    # relative to |expected|, where that is not 0 (against 0 only the absolute error means anything)
    nonzero = np.abs(b) > 0
    rel = np.where(nonzero, diff / np.where(nonzero, np.abs(b), 1.0), 0.0)
    ok = bool(np.all(nan_ok) and np.all(diff <= atol + rtol * np.abs(b)))
    return dict(
        row,
        ok=ok,
        max_abs_error=float(diff.max()),
        max_rel_error=float(np.nanmax(rel)),
        worst_index=[int(i) for i in np.unravel_index(worst, got.shape)] if got.ndim else [],
        worst_value=float(a.reshape(-1)[worst]),
        expected_value=float(b.reshape(-1)[worst]),
    )


def _expectations(sess, specs):
    from pmx.runtime.errors import PmxInputError

    names = fetched_names(sess)
    out = []
    for spec in specs or ():
        name, array = _read_array(spec, "--expect")
        if name not in names:
            raise PmxInputError(f"--expect {name}: the model has no such output; its outputs are {names}")
        out.append((name, spec.partition("=")[2], array))
    return out


def fetched_names(sess):
    """What pmx run prints and saves: the outputs, then the tensors kept with --keep."""
    model = sess.model
    return [a.name for a in sess.get_outputs()] + [model.tensors[i].name for i in model.kept]


def _run(args):
    from pmx.runtime import InferenceSession

    parser = args._parser
    check_model_arg(args.model, "run")
    if args.batch_dir is not None:
        return _run_batch(args)
    t0 = time.perf_counter()
    sess = InferenceSession(args.model, num_threads=args.threads)
    load_ms = (time.perf_counter() - t0) * 1e3
    feed = _feed(sess, args.input, args.random, parser, args.shape)
    expect = _expectations(sess, args.expect)
    names = fetched_names(sess)
    t0 = time.perf_counter()
    outputs = sess.run(names, feed)
    first_ms = (time.perf_counter() - t0) * 1e3
    warmup = _settle(sess, feed, args.warmup) if args.repeat else 0
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append((time.perf_counter() - t0) * 1e3)
    threads, settled = sess.thread_choice(feed)
    by_name = dict(zip(names, outputs))
    checks = [_compare(name, by_name[name], path, want, args.rtol, args.atol) for name, path, want in expect]
    saved = _save_outputs(args.save, names, outputs) if args.save else []
    profile = sess.profile(feed, repeat=max(args.repeat, 5)) if args.profile else None
    overhead = _overhead(sess, feed, args.repeat) if args.profile else None
    if args.json:
        print(
            _dumps(
                dict(
                    model=args.model,
                    load_ms=load_ms,
                    first_run_ms=first_ms,
                    repeat=args.repeat,
                    median_ms=float(np.median(times)) if times else None,
                    warmup_runs=warmup,
                    threads=threads,
                    threads_settled=settled,
                    inputs=[
                        dict(
                            name=a.name,
                            shape=list(feed[a.name].shape),
                            dtype=feed[a.name].dtype.name,
                            declared_shape=a.shape,
                        )
                        for a in sess.get_inputs()
                    ],
                    outputs=[
                        dict(
                            name=n,
                            shape=list(y.shape),
                            dtype=y.dtype.name,
                            declared_shape=a.shape,
                            first_values=_json_values(y.reshape(-1)[:6]),
                        )
                        for n, y, a in zip(names, outputs, sess.get_outputs())
                    ],
                    saved=saved,
                    expect=checks,
                    profile=profile,
                    framework_overhead=None
                    if overhead is None
                    else dict(wall_ms=overhead.wall_ms, kernel_ms=overhead.kernel_ms, fraction=overhead.overhead),
                )
            )
        )
    elif not args.quiet:
        for name, y in zip(names, outputs):
            flat = y.reshape(-1)[:6]
            print(
                f"{name}: shape {list(y.shape)} {y.dtype}  first values {np.array2string(flat, precision=5, separator=', ')}"
            )
        steady = f", median of {args.repeat} runs {np.median(times):.2f} ms" if times else ""
        print(f"load {load_ms:.2f} ms, first run {first_ms:.2f} ms{steady}")
        if times:
            print(_timing_note(warmup, threads, settled, args.warmup))
        for path in saved:
            print(f"saved {path}")
        for c in checks:
            if c["ok"]:
                print(
                    f"{c['name']}: matches {c['file']} (max abs error {c['max_abs_error']:.3g}, "
                    f"max rel error {c['max_rel_error']:.3g})"
                )
        if profile is not None:
            _print_profile(profile, overhead)
    failed = [c for c in checks if not c["ok"]]
    if failed:
        raise _Failure("; ".join(_mismatch_text(c) for c in failed))
    return 0


SETTLE_SECONDS = 3.0  # at most this long warming up before the timed runs
# at least this long warming up: on a VM whose cores idled, the first few hundred ms of
# runs were up to 1.5x slower, which moved a small model's median between processes by
# up to 50% (docs/performance.md, "pmx run's spread between processes")
WARM_SECONDS = 0.3


def _settle(sess, feed, warm_seconds=WARM_SECONDS):
    """Run for `warm_seconds` and until the session has chosen how to use its threads for
    these inputs (it times whole runs both ways after about ten: parallel.RunChooser),
    so the timed runs measure the way it keeps on a host in its steady state; at most
    SETTLE_SECONDS. Returns the runs made."""
    runs, start = 0, time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= SETTLE_SECONDS or (elapsed >= warm_seconds and sess.thread_choice(feed)[1]):
            return runs
        sess.run(None, feed)
        runs += 1


def _timing_note(warmup, threads, settled, warm_seconds):
    way = f"on {threads} thread{'s' if threads > 1 else ''}"
    if not settled:
        return (
            f"timed {way} after {warmup} warm-up runs, before the session had chosen how to use its threads "
            f"(a slow model: more --repeat runs show the steady state)"
        )
    return (
        f"timed {way}, after {warmup} warm-up runs ({warm_seconds:g} s at least, and until the session "
        f"chose how to use its threads)"
    )


def _dumps(obj):
    """Strict JSON (no NaN or Infinity tokens, which many parsers refuse), indented."""

    def strict(o):
        if isinstance(o, float):
            return _json_number(o)
        if isinstance(o, dict):
            return {k: strict(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [strict(v) for v in o]
        return o

    return json.dumps(strict(obj), indent=1, allow_nan=False)


def _json_values(a):
    """Values as strict JSON: complex as [real, imag], non-finite floats as strings
    ("nan", "inf", "-inf"), which JSON has no numbers for."""
    if a.dtype.kind == "c":
        return [[_json_number(v.real), _json_number(v.imag)] for v in a.tolist()]
    return [_json_number(v) for v in a.tolist()]


def _json_number(v):
    return v if not isinstance(v, float) or np.isfinite(v) else str(v)


def _mismatch_text(c):
    if "error" in c:
        return f"{c['name']} does not match {c['file']}: {c['error']}"
    return (
        f"{c['name']} does not match {c['file']}: max abs error {c['max_abs_error']:.6g} at "
        f"{tuple(c['worst_index'])} (got {c['worst_value']:.6g}, expected {c['expected_value']:.6g}), "
        f"max rel error {c['max_rel_error']:.6g}; allowed atol {c['atol']:g} + rtol {c['rtol']:g} x |expected|"
    )


def batch_files(directory):
    """The files `pmx run --batch-dir` runs, sorted by name: each .npy (the one input of a
    single-input model) and each .npz (one array per input name)."""
    from pmx.runtime.errors import PmxInputError

    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith((".npy", ".npz")))
    except OSError as e:
        raise PmxInputError(f"--batch-dir {directory}: {e.strerror or e}") from None
    if not names:
        raise PmxInputError(f"--batch-dir {directory}: no .npy or .npz files in it")
    return [os.path.join(directory, n) for n in names]


def _batch_feed(sess, path):
    """A .npy is the model's one input; a .npz holds one array per input name."""
    from pmx.runtime.errors import PmxInputError

    inputs = [a.name for a in sess.get_inputs()]
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise PmxInputError(f"{path}: cannot read: {e}") from None
    if isinstance(loaded, np.ndarray):
        if len(inputs) != 1:
            raise PmxInputError(
                f"{path}: a .npy file feeds a model with one input; this one has {inputs}: "
                f"give each run as a .npz with one array per input name"
            )
        return {inputs[0]: loaded}
    with loaded:
        feed = {k: loaded[k] for k in loaded.files}
    if sorted(feed) != sorted(inputs):
        raise PmxInputError(f"{path}: holds arrays {sorted(feed)}, the model's inputs are {inputs}")
    return feed


class _Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total, enabled):
        self.total, self.enabled, self.t0 = total, enabled and sys.stderr.isatty(), time.perf_counter()

    def show(self, done, name):
        if not self.enabled:
            return
        width = 30
        filled = width * done // self.total
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {rate:.1f}/s {name[:30]:<30}")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _run_batch(args):
    """pmx run model.pmx --batch-dir IN --save OUT: every .npy/.npz of IN, sorted by name,
    run once; outputs saved as OUT/<stem>.npy (one output) or OUT/<stem>.npz (one array
    per output name)."""
    from pmx.runtime import InferenceSession

    files = batch_files(args.batch_dir)
    sess = InferenceSession(args.model, num_threads=args.threads)
    names = fetched_names(sess)
    _make_output_dir(args.save)
    progress = _Progress(len(files), not args.quiet)
    t0 = time.perf_counter()
    written = []
    try:
        for k, path in enumerate(files):
            progress.show(k, os.path.basename(path))
            outputs = sess.run(names, _batch_feed(sess, path))
            stem = os.path.splitext(os.path.basename(path))[0]
            if len(outputs) == 1:
                target = os.path.join(args.save, stem + ".npy")
                np.save(target, outputs[0])
            else:
                target = os.path.join(args.save, stem + ".npz")
                np.savez(target, **dict(zip(names, outputs)))
            written.append(dict(input=path, output=target))
        progress.show(len(files), "")
    finally:
        progress.close()
    seconds = time.perf_counter() - t0
    if args.json:
        print(_dumps(dict(model=args.model, files=written, seconds=seconds)))
    elif not args.quiet:
        print(f"ran {len(files)} files in {seconds:.2f} s; outputs in {args.save}")
    return 0


def _overhead(sess, feed, repeat):
    from pmx.runtime.overhead import framework_overhead

    return framework_overhead(sess, feed, repeat=max(repeat, 5))


def _print_profile(rows, overhead):
    """The profile table, names and shapes in full, then the run's time split from the
    same runs' pairing (runtime/overhead.py), so the parts never exceed the whole."""
    total = sum(r["ms"] for r in rows) or 1.0
    table = [
        (*_node_cells(r), _shapes_text(r["in_shapes"], " "), f"{r['ms']:.3f}", f"{100 * r['ms'] / total:.1f}%")
        for r in rows
    ]
    print()
    _print_table(("op", "variant", "name", "fused", "input shapes", "ms", "%"), table, right=(5, 6))
    print(
        f"run {overhead.wall_ms:.3f} ms (median of runs), of which kernels {overhead.kernel_ms:.3f} ms; "
        f"framework overhead {100 * overhead.overhead:.1f}% (feed checks, copies in and out, the loop). "
        f"Node times are each node's median over the runs."
    )


def _node_cells(entry):
    """A profile row's or node table entry's op, kernel variant, name and fused epilogue."""
    return entry["op"], entry["variant"], entry["name"], entry["fused"]


def _shapes_text(shapes, separator):
    return separator.join("x".join(map(str, s)) for s in shapes)


def _print_table(header, rows, right=()):
    """Columns as wide as their widest cell: nothing is cut."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        cells = [str(c).rjust(w) if k in right else str(c).ljust(w) for k, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())


# --- pmx inspect, pmx verify -----------------------------------------------------------------


def _declared_shape(t):
    """A graph input's or output's shape as get_inputs() reports it: None for dims that
    may change at run time."""
    if t.dim_min is None:
        return list(t.shape)
    return [d if lo == hi else None for d, lo, hi in zip(t.shape, t.dim_min, t.dim_max)]


def _io_entry(t):
    from pmx.runtime.dim_ranges import UNBOUNDED, format_ranges, tensor_ranges

    entry = dict(name=t.name, declared_shape=_declared_shape(t), dtype=t.dtype.name, planned_shape=list(t.shape))
    if t.dim_min is not None:
        ranges = tensor_ranges(t)
        entry["allowed"] = format_ranges(ranges)
        entry["dim_ranges"] = [[lo, None if hi == UNBOUNDED else hi] for lo, hi in ranges]
    return entry


def inspect_dict(model):
    """Everything `pmx inspect` reports, as one JSON-able dict, in the vocabulary all
    commands share (README, "JSON output"): inputs and outputs carry declared_shape (as
    get_inputs() reports it: null for dims that may change), planned_shape (the shape
    memory was planned for) and, where dims may change, allowed (the sizes they take, as
    messages spell them) and dim_ranges ([min, max] per dim, max null: no upper end)."""
    from pmx.runtime import expr as E
    from pmx.runtime.plan import lower_bound, naive_bytes
    from pmx.runtime.replan import root_buffers, tensor_lifetimes
    from pmx.schema.layout import TensorKind

    t = model.tensors
    _, buffers = root_buffers(model, [x.shape for x in t], lambda i: model.roots[i][0])
    return {
        "model": model.path,
        "producer": model.producer,
        "source": model.source,
        "file_bytes": model.file_size,
        "metadata": dict(model.metadata),
        "inputs": [_io_entry(t[i]) for i in model.inputs],
        "outputs": [_io_entry(t[i]) for i in model.outputs],
        "kept": [t[i].name for i in model.kept],
        "nodes": len(model.nodes),
        "constants": sum(1 for x in t if x.kind == TensorKind.Constant),
        "constant_bytes": sum(x.data_size for x in t if x.kind == TensorKind.Constant),
        "arena_bytes": model.arena_size,
        "lower_bound_bytes": lower_bound(buffers),
        "naive_bytes": naive_bytes(tensor_lifetimes(model), lambda i: t[i].nbytes),
        "passes": [dict(name=a, nodes_before=b, nodes_after=c) for a, b, c in model.pass_stats],
        "node_table": [
            dict(
                op=nd.op,
                name=nd.name,
                variant=nd.variant,
                inputs=[t[i].name if i >= 0 else None for i in nd.inputs],
                outputs=[t[i].name for i in nd.outputs],
                planned_shapes=[list(t[i].shape) for i in nd.outputs],
                expr=E.to_text(nd.expr) if nd.expr else "",
                fused=E.describe_node_expr(nd.op, nd.expr),
            )
            for nd in model.nodes
        ],
    }


def _inspect(args):
    from pmx.runtime.load import open_model

    check_model_arg(args.model, "inspect")
    info = inspect_dict(open_model(args.model))
    if args.json:
        print(_dumps(info))
        return 0
    if args.quiet:
        return 0
    print(f"{info['model']}  ({info['file_bytes'] / 1e6:.2f} MB, {info['producer']}, from {info['source']})")
    for kind in ("inputs", "outputs"):
        for x in info[kind]:
            print(f"  {kind[:-1]:<7} {x['name']:<12} {x.get('allowed') or x['declared_shape']} {x['dtype']}")
    for name in info["kept"]:
        print(f"  kept    {name:<12} (pmx compile --keep: sess.run([{name!r}], feed); pmx run prints it)")
    for key, value in info["metadata"].items():
        print(f"  meta    {key} = {value}")
    print("passes (nodes before -> after):")
    for p in info["passes"]:
        print(f"  {p['name']:<22} {p['nodes_before']:>5} -> {p['nodes_after']}")
    print(
        f"memory: arena {info['arena_bytes']} B, lower bound {info['lower_bound_bytes']} B, "
        f"unplanned sum {info['naive_bytes']} B"
    )
    print()
    rows = [(j, *_node_cells(nd), _shapes_text(nd["planned_shapes"], ", ")) for j, nd in enumerate(info["node_table"])]
    _print_table(("#", "op", "variant", "name", "fused", "output shapes"), rows, right=(0,))
    return 0


def _verify(args):
    from pmx.runtime.errors import PmxError
    from pmx.runtime.load import open_model

    check_model_arg(args.model, "verify")
    try:
        model = open_model(args.model, verify_checksum=True)
    except PmxError as e:
        if args.json:
            print(_dumps(dict(model=args.model, ok=False, error=str(e))))
        raise
    pre = model.preamble
    if args.json:
        print(
            _dumps(
                dict(
                    model=args.model,
                    ok=True,
                    file_bytes=model.file_size,
                    nodes=len(model.nodes),
                    tensors=len(model.tensors),
                    format_version=pre["version"],
                    header_crc=f"{pre['header_crc']:#010x}",
                    data_crc=f"{pre['data_crc']:#010x}",
                )
            )
        )
    elif not args.quiet:
        print(
            f"{args.model}: OK ({model.file_size} bytes, {len(model.nodes)} nodes, {len(model.tensors)} tensors, "
            f"structure valid, header and data checksums match: "
            f"{pre['header_crc']:#010x} {pre['data_crc']:#010x})"
        )
    return 0


def guarded(fn, debug, json_failure=None):
    """Run one command: its status, with errors as one line on stderr (see EPILOG). With
    `json_failure` (a dict: --json was given and the command printed no document), a
    failure also prints that dict with ok false and the error on stdout, so a script
    reading the JSON reads a document either way."""
    from pmx.runtime.errors import PmxError, PmxInternalError

    try:
        status = fn()
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        return _closed_pipe()
    except _Failure as e:
        print(f"pmx: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except PmxInternalError as e:
        if debug:
            raise
        _print_json_failure(json_failure, e)
        print(f"pmx: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
    except PmxError as e:
        if debug:
            raise
        _print_json_failure(json_failure, e)
        print(f"pmx: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the CLI never shows a bare traceback
        if debug:
            raise
        print(
            f"pmx: internal error: {type(e).__name__}: {e}. This is a bug in pmx; please report it with the "
            f"model file and the command line (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _print_json_failure(document, error):
    if document is not None:
        print(_dumps(dict(document, ok=False, error=str(error))))
        sys.stdout.flush()


def json_failure(args):
    """What a failed `pmx run|inspect --json` prints on stdout (verify prints its own)."""
    if getattr(args, "json", False) and getattr(args, "command", None) in ("run", "inspect"):
        return dict(model=args.model)
    return None


def _closed_pipe():
    """The reader of stdout went away (`| head`): stop quietly. stdout is pointed at
    /dev/null so the interpreter's final flush does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_OK
