"""ONNX's backend node tests through pnnx and pmx: each single-op model the onnx package
defines (onnx.backend.test.case.node, with its expected outputs) is converted with
`pnnx model.onnx`, compiled with pmx, run on the case's inputs and compared with ONNX's
expected outputs. Where pmx's answer differs, pnnx's generated Python runs the same graph,
to tell a graph pnnx got wrong from a wrong answer of pmx's.

    python tools/sweep_onnx_node_tests.py [-k SUBSTRING] [--show CATEGORY] [--limit N]

Needs the test extra (onnx, pnnx, torch). Prints a count per outcome and the cases of each
outcome named by --show (e.g. --show wrong --show internal):

  pnnx-failed     pnnx did not convert the model
  refused         pmx compile or load refused it with a PmxError (an unconverted ONNX op,
                  a contradiction in the graph, ...), and pnnx's Python cannot run it or
                  gets it wrong too
  refused-right   pmx refused it, but pnnx's Python runs it and matches ONNX: a right
                  graph pmx does not take
  run-error       the compiled model refused its inputs when run (PmxError)
  internal        a PmxInternalError or another exception: a bug of pmx's
  wrong           pmx's outputs differ from ONNX's and pnnx's Python matches ONNX's, or
                  pnnx's Python cannot run the graph (then nothing clears pmx)
  graph-wrong     pmx's outputs differ from ONNX's, and so do pnnx's Python's
  right           pmx's outputs match ONNX's
"""

import argparse
import collections
import contextlib
import importlib.util
import io
import os
import pathlib
import subprocess
import sys
import tempfile
import warnings

import numpy as np

PNNX_TYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
    "complex64": "c64",
}


def close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    if want.dtype.kind in "biuSUO" or got.dtype.kind in "biu":
        return np.array_equal(got.astype(want.dtype), want) if want.dtype.kind not in "SUO" else False
    return np.allclose(got, want, rtol=1e-3, atol=1e-4, equal_nan=True)


def all_close(got, want):
    return len(got) == len(want) and all(close(g, w) for g, w in zip(got, want))


def as_array(value):
    """A case's input or expected output as numpy holds it (some cases give TensorProtos)."""
    import onnx
    from onnx import numpy_helper

    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value


def input_shapes(inputs):
    specs = []
    for a in inputs:
        if not isinstance(a, (np.ndarray, np.generic)):  # a sequence or an optional: no pnnx input type
            return None
        code = PNNX_TYPES.get(np.asarray(a).dtype.name)
        if code is None:
            return None
        specs.append("[" + ",".join(map(str, np.shape(a))) + "]" + code)
    return ",".join(specs)


def pnnx_python(directory, inputs):
    """The outputs of pnnx's generated Python on `inputs`, or None when it cannot run."""
    import torch

    script = directory / "model_pnnx.py"
    if not script.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location("pnnx_model", script)
        module = importlib.util.module_from_spec(spec)
        cwd = os.getcwd()
        os.chdir(directory)  # the script reads its weights from the working directory
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                spec.loader.exec_module(module)
                net = module.Model().eval()
                with torch.no_grad():
                    out = net(*[torch.from_numpy(np.array(a)) for a in inputs])
        finally:
            os.chdir(cwd)
    except Exception:
        return None
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o.numpy() if hasattr(o, "numpy") else np.asarray(o) for o in out]


def convert(directory, inputs):
    """`pnnx model.onnx`, which takes the input shapes the model declares; where that
    fails (a dim the model leaves open), again with the case's shapes (inputshape=)."""
    import pnnx

    def pnnx_run(*args):
        return subprocess.run(
            [pnnx.EXEC_PATH, "model.onnx", *args], cwd=directory, capture_output=True, text=True, timeout=120
        )

    done = pnnx_run()
    shapes = input_shapes(inputs)
    if done.returncode != 0 and shapes is not None:
        done = pnnx_run(f"inputshape={shapes}")
    return done


def run_case(case, directory):
    """(outcome, detail) of one node test case."""
    import onnx

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession, PmxError, PmxInternalError

    inputs, expected = (list(map(as_array, arrays)) for arrays in case.data_sets[0])
    onnx.save(case.model, str(directory / "model.onnx"))
    done = convert(directory, inputs)
    if done.returncode != 0 or not (directory / "model.pnnx.param").exists():
        return "pnnx-failed", (done.stderr or done.stdout).strip().splitlines()[-1:]
    plan = {f"in{k}": tuple(np.shape(a)) for k, a in enumerate(inputs)}
    untyped = {f"in{k}": np.asarray(a).dtype.name for k, a in enumerate(inputs) if np.ndim(a) == 0}
    try:
        compile_model(
            str(directory / "model.pnnx.param"),
            str(directory / "model.pnnx.bin"),
            str(directory / "m.pmx"),
            plan_shapes=plan,
            **({"dtype": untyped} if untyped else {}),  # pnnx writes no dtype for a 0-d input
        )
        sess = InferenceSession(str(directory / "m.pmx"))
    except PmxInternalError as e:
        return "internal", str(e)[:300]
    except PmxError as e:
        reference = pnnx_python(directory, inputs)
        right_graph = reference is not None and all_close(reference, expected)
        return "refused-right" if right_graph else "refused", str(e)[:300]
    except Exception as e:  # a bug of pmx's own
        return "internal", f"{type(e).__name__}: {str(e)[:300]}"
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = sess.run(None, {arg.name: np.array(a) for arg, a in zip(sess.get_inputs(), inputs)})
    except PmxInternalError as e:
        return "internal", str(e)[:300]
    except PmxError as e:
        return "run-error", str(e)[:300]
    except Exception as e:
        return "internal", f"{type(e).__name__}: {str(e)[:300]}"
    if all_close(got, expected):
        return "right", ""
    reference = pnnx_python(directory, inputs)
    if reference is None:
        return "wrong", "pnnx's Python did not run"
    if all_close(reference, expected):
        return "wrong", "pnnx's Python matches ONNX"
    return "graph-wrong", "pnnx's Python differs from ONNX too"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("--show", action="append", default=[], help="list the cases of this outcome")
    parser.add_argument("--limit", type=int, default=0, help="at most this many cases (0: all)")
    args = parser.parse_args()
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = [c for c in collect_testcases(None) if args.k in c.name]
    if args.limit:
        cases = cases[: args.limit]
    outcomes = collections.Counter()
    shown = collections.defaultdict(list)
    for k, case in enumerate(cases, 1):
        with tempfile.TemporaryDirectory(prefix="pmx_onnx_") as d:
            try:
                outcome, detail = run_case(case, pathlib.Path(d))
            except subprocess.TimeoutExpired:
                outcome, detail = "pnnx-failed", "pnnx timed out"
        outcomes[outcome] += 1
        if outcome in args.show:
            shown[outcome].append(f"{case.name}: {detail}")
        if k % 100 == 0:
            print(f"... {k} of {len(cases)}: {dict(outcomes)}", file=sys.stderr, flush=True)
    print(f"{len(cases)} ONNX node test cases")
    for outcome in (
        "right",
        "wrong",
        "graph-wrong",
        "internal",
        "run-error",
        "refused-right",
        "refused",
        "pnnx-failed",
    ):
        print(f"  {outcome:12} {outcomes[outcome]:5d}")
    for outcome, lines in shown.items():
        print(f"\n{outcome}:")
        for line in lines:
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
