"""Run pnnx's upstream per-op tests through pmx and classify every case.

Usage: python tools/sweep_pnnx_tests.py --tests PATH/TO/tools/pnnx/tests [--jobs 2]
       [--timeout 300] [--json sweep.json] [--only test_F_conv2d.py ...]
       python tools/sweep_pnnx_tests.py --report sweep.json   (tables of an earlier run)

`--tests` is a checkout of ncnn's tools/pnnx/tests (its test_*.py files; the onnx/ and
ncnn/ subfolders are not used). Each test file runs in its own subprocess, in a fresh
temporary directory, with its own test() function driving the export: torch.jit.trace is
wrapped to record the model's inputs and torch's outputs, the `../src/pnnx X.pt ...` shell
call runs the pip pnnx converter with the same arguments, and `import X_pnnx` yields a
stand-in whose test_inference() returns torch's outputs (so the test carries on to its
next sub-case). Each recorded case is then compiled with pmx, run on the same inputs and
compared with torch (max |pmx - torch| / max |torch| <= 1e-4, exact for ints and bools;
outputs in an order torch does not promise, ORDER_FREE, as sets along the last axis).

Some files need packages that do not install beside the torch that torchvision needs:
torchaudio (its last release, installed with pip --no-deps into a separate folder, imports
and runs the spectrogram tests), onnxscript with onnx_ir (test_pnnx_fuse_rmsnorm), and a
transformers from before 5.0 (4.46, with its tokenizers and huggingface_hub: 5.x removed
the attention classes six tests build). Put such a folder on PYTHONPATH for the sweep.

Statuses: ok, mismatch, compile-error (the PmxError message), load/run error,
pnnx failed (pnnx wrote no .pnnx.param), needs torchvision, skipped (the test fails in
torch, or exports nothing on this torch version), timeout.
"""

import argparse
import concurrent.futures
import importlib.abc
import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import types

FAMILIES = ("F", "nn", "torch", "Tensor", "torchvision", "pnnx/other")
# tests of ops returning uninitialized memory (Tensor.new_empty): like the upstream test,
# compare shapes and dtypes only
SHAPE_ONLY = ("test_Tensor_new_empty", "test_torch_empty", "test_torch_empty_like")
# outputs whose order along the last axis torch leaves open (topk with sorted=False, whose
# CPU order is the selection algorithm's): compared after sorting both along that axis, so
# the same values and the same index set pass
ORDER_FREE = {"test_torch_topk": (2, 3)}
STATUS_ORDER = (
    "ok",
    "mismatch",
    "compile-error",
    "load/run error",
    "pnnx failed",
    "needs torchvision",
    "skipped",
    "timeout",
)


def family(test_name):
    stem = test_name.removeprefix("test_")
    for prefix in ("F", "nn", "torch", "Tensor", "torchvision"):
        if stem.startswith(prefix + "_"):
            return prefix
    return "pnnx/other"


def one_line(text, limit=400):
    return " ".join(str(text).split())[:limit]


# ---------------------------------------------------------------- child: one test file


def _flatten(obj, out):
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for e in obj:
            _flatten(e, out)
    elif isinstance(obj, dict):
        for e in obj.values():
            _flatten(e, out)
    return out


class _Recorder:
    """Everything the test's own test() did that the sweep needs: traces and conversions."""

    def __init__(self, pnnx_exe, timeout):
        self.pnnx_exe = pnnx_exe
        self.timeout = timeout
        self.traces = []  # (inputs, torch outputs) per torch.jit.trace call
        self.cases = []  # dicts: pt, inputs, outputs, pnnx rc/log

    def trace(self, original):
        import torch

        def wrapped(func, example_inputs=None, *args, **kwargs):
            example = example_inputs if example_inputs is not None else kwargs.get("example_kwarg_inputs")
            inputs = (example,) if isinstance(example, torch.Tensor) else tuple(example or ())
            try:
                with torch.no_grad():
                    # run before tracing: tracing runs forward too, which may update state
                    out = func(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
                outputs = [t.detach().clone() for t in _flatten(out, [])]
            except Exception as e:  # recorded, the trace itself will decide
                outputs = e
            mod = original(func, example_inputs, *args, **kwargs)
            self.traces.append(([t.detach().clone() for t in _flatten(inputs, [])], outputs))
            return mod

        return wrapped

    def system(self, command):
        words = command.split()
        if not words or not words[0].endswith("pnnx"):
            return 1
        args = words[1:]
        pt = args[0] if args else ""
        try:
            p = subprocess.run(
                [self.pnnx_exe] + args, capture_output=True, text=True, timeout=self.timeout, check=False
            )
            rc, log = p.returncode, (p.stdout + p.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            rc, log = -9, "pnnx timed out"
        inputs, outputs = self.traces[-1] if self.traces else ([], None)
        self.cases.append(dict(pt=pt, inputs=inputs, outputs=outputs, rc=rc, log=log))
        return rc

    def fake_module(self, name):
        """The test's `import test_X_pnnx`: returns torch's outputs of the matching case."""
        pt = name[: -len("_pnnx")] + ".pt"
        case = next(
            (c for c in reversed(self.cases) if os.path.basename(c["pt"]) == pt), self.cases[-1] if self.cases else None
        )
        mod = types.ModuleType(name)

        def test_inference(*args, **kwargs):
            outs = case["outputs"] if case is not None else None
            if not isinstance(outs, list):
                raise RuntimeError("no recorded torch outputs")
            return outs[0] if len(outs) == 1 else tuple(outs)

        mod.test_inference = test_inference
        return mod


class _FakeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, recorder):
        self.recorder = recorder

    def find_spec(self, name, path=None, target=None):
        if re.fullmatch(r"test_\w+_(pnnx|ncnn)", name):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return self.recorder.fake_module(spec.name)

    def exec_module(self, module):
        pass


def _compare(got, want, shapes_only=False, order_free=()):
    import numpy as np

    if len(got) != len(want):
        return f"pmx returned {len(got)} outputs, torch {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape} != torch {w.shape}"
        if i in order_free and w.ndim:
            g, w = np.sort(g, axis=-1), np.sort(w, axis=-1)
        if shapes_only:
            if g.dtype != w.dtype:
                return f"output {i}: dtype {g.dtype} != torch {w.dtype}"
            continue
        if w.dtype.kind in "biu" or (w.dtype.kind != g.dtype.kind and w.dtype.kind == "b"):
            if not np.array_equal(g, w):
                return f"output {i}: {int((g != w).sum())} of {w.size} elements differ (exact dtype {w.dtype})"
            continue
        if w.dtype.kind == "c":
            g, w = np.stack([g.real, g.imag]), np.stack([w.real, w.imag])
        a, b = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if b.size == 0:
            continue
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        if not np.array_equal(nan_a, nan_b):
            return f"output {i}: NaN positions differ"
        ok = ~nan_b
        if not ok.any():
            continue
        if not np.array_equal(np.isinf(a[ok]), np.isinf(b[ok])) or not np.array_equal(
            a[ok][np.isinf(b[ok])], b[ok][np.isinf(b[ok])]
        ):
            return f"output {i}: inf positions differ"
        fin = ok & np.isfinite(b)
        if not fin.any():
            continue
        scale = max(float(np.abs(b[fin]).max()), 1e-12)
        err = float(np.abs(a[fin] - b[fin]).max() / scale)
        if not err <= 1e-4:
            return f"output {i}: rel. error {err:.3g} > 1e-4"
    return None


def _run_case(case, workdir):
    from pmx.compiler.driver import compile_model
    from pmx.compiler.pnnx import load as load_pnnx
    from pmx.runtime import InferenceSession
    from pmx.runtime.errors import PmxError

    stem = case["pt"].removesuffix(".pt")
    param, binf = os.path.join(workdir, stem + ".pnnx.param"), os.path.join(workdir, stem + ".pnnx.bin")
    result = dict(pt=case["pt"])
    if not os.path.exists(param):
        return dict(result, status="pnnx failed", detail=f"rc={case['rc']}: " + one_line(case["log"][-600:]))
    if isinstance(case["outputs"], Exception):
        return dict(result, status="skipped", detail="torch: " + one_line(repr(case["outputs"])))
    inputs = [t.numpy() for t in case["inputs"]]
    want = [t.numpy() for t in case["outputs"]]
    try:
        graph = load_pnnx(param, binf)
        plan = {
            v.name: tuple(x.shape) for v, x in zip(graph.inputs, inputs) if v.shape is None or None in tuple(v.shape)
        }
        compile_model(param, binf, os.path.join(workdir, stem + ".pmx"), verify=True, plan_shapes=plan or None)
    except PmxError as e:
        return dict(result, status="compile-error", detail=f"{type(e).__name__}: {one_line(e)}")
    except Exception as e:
        return dict(result, status="compile-error", detail=f"crash {type(e).__name__}: {one_line(e)}")
    try:
        sess = InferenceSession(os.path.join(workdir, stem + ".pmx"), verify=True)
        names = [a.name for a in sess.get_inputs()]
        if len(names) != len(inputs):
            return dict(
                result, status="load/run error", detail=f"model has {len(names)} inputs, the test traced {len(inputs)}"
            )
        got = sess.run(None, dict(zip(names, inputs)))
    except Exception as e:
        return dict(result, status="load/run error", detail=f"{type(e).__name__}: {one_line(e)}")
    problem = _compare(
        got, want, shapes_only=case.get("test") in SHAPE_ONLY, order_free=ORDER_FREE.get(case.get("test"), ())
    )
    if problem:
        return dict(result, status="mismatch", detail=problem)
    return dict(result, status="ok", detail="")


def run_one(test_path, pnnx_exe, timeout):
    """Child process: run one upstream test file; returns a list of case results."""
    name = os.path.basename(test_path)[:-3]
    workdir = tempfile.mkdtemp(prefix=f"sweep_{name}_")
    try:
        return _run_in(workdir, test_path, pnnx_exe, timeout)
    finally:
        os.chdir(tempfile.gettempdir())
        shutil.rmtree(workdir, ignore_errors=True)


def _run_in(workdir, test_path, pnnx_exe, timeout):
    import torch

    name = os.path.basename(test_path)[:-3]
    os.chdir(workdir)
    sys.path.insert(0, os.path.dirname(os.path.abspath(test_path)))
    recorder = _Recorder(pnnx_exe, timeout)
    sys.meta_path.insert(0, _FakeFinder(recorder))
    os.system = recorder.system
    torch.jit.trace = recorder.trace(torch.jit.trace)
    base = dict(test=name, family=family(name))
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        if "torchvision" in str(e):
            return [dict(base, status="needs torchvision", detail=one_line(e))]
        return [dict(base, status="skipped", detail="import: " + one_line(e))]
    failure = None
    try:
        module.test()
    except ImportError as e:
        if "torchvision" in str(e) or "torchvision" in traceback.format_exc():
            return [dict(base, status="needs torchvision", detail=one_line(e))]
        failure = e
    except BaseException as e:  # the test's own failure (in torch) is a finding
        failure = e
    if not recorder.cases:
        why = (
            f"test failed before any export: {type(failure).__name__}: {one_line(failure)}"
            if failure
            else "the test exported nothing on this torch version"
        )
        return [dict(base, status="skipped", detail=why)]
    results = []
    for i, case in enumerate(recorder.cases):
        case["test"] = name
        try:
            r = _run_case(case, workdir)
        except Exception as e:
            r = dict(pt=case["pt"], status="load/run error", detail=f"sweep: {type(e).__name__}: {one_line(e)}")
        results.append(dict(base, case=i, **r))
    return results


# ---------------------------------------------------------------- parent: the sweep


def _pnnx_executable():
    import pnnx

    return pnnx.EXEC_PATH


def _launch(test_path, args):
    name = os.path.basename(test_path)[:-3]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", test_path, "--timeout", str(args.timeout)]
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return [dict(test=name, family=family(name), status="timeout", detail=f"over {args.timeout} s")]
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("SWEEP-RESULT "):
            results = json.loads(line[len("SWEEP-RESULT ") :])
            for r in results:
                r["seconds"] = round(time.time() - t0, 1)
            return results
    return [
        dict(
            test=name,
            family=family(name),
            status="load/run error",
            detail=f"child exited {p.returncode} without a result: " + one_line(p.stderr[-800:]),
        )
    ]


def _file_status(results):
    """A test file's status: its worst case (order: the first non-ok status found)."""
    statuses = [r["status"] for r in results]
    for s in STATUS_ORDER[1:]:
        if s in statuses:
            return s
    return "ok"


def print_tables(results, out=sys.stdout):
    by_file = {}
    for r in results:
        by_file.setdefault(r["test"], []).append(r)
    table = {}
    for test, rs in by_file.items():
        table.setdefault(family(test), {}).setdefault(_file_status(rs), 0)
        table[family(test)][_file_status(rs)] += 1
    cols = [s for s in STATUS_ORDER if any(s in t for t in table.values())]
    header = f"{'family':<12}" + "".join(f"{c:>18}" for c in cols) + f"{'total':>8}"
    print(header, file=out)
    for fam in FAMILIES:
        if fam in table:
            row = table[fam]
            print(f"{fam:<12}" + "".join(f"{row.get(c, 0):>18}" for c in cols) + f"{sum(row.values()):>8}", file=out)
    total = {c: sum(t.get(c, 0) for t in table.values()) for c in cols}
    print(f"{'all':<12}" + "".join(f"{total[c]:>18}" for c in cols) + f"{sum(total.values()):>8}", file=out)
    print("(one row per test file; a file counts under its worst case)", file=out)


def print_failures(results, out=sys.stdout):
    for status in STATUS_ORDER[1:]:
        rs = [r for r in results if r["status"] == status]
        if rs:
            print(f"\n== {status} ({len(rs)} cases)", file=out)
            for r in sorted(rs, key=lambda r: (r["test"], r.get("case", 0))):
                print(f"  {r['test']}[{r.get('case', 0)}]: {r.get('detail', '')[:300]}", file=out)


def _write_json(path, results):
    results.sort(key=lambda r: (r["test"], r.get("case", 0)))
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", help="directory of pnnx's upstream test_*.py files")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test file")
    ap.add_argument("--json", default="sweep_pnnx_tests.json", help="where to write every case")
    ap.add_argument("--only", nargs="*", help="test file names to run (default: all)")
    ap.add_argument("--report", metavar="JSON", help="print the tables of an earlier sweep's JSON and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            results = json.load(f)
        print_tables(results)
        print_failures(results)
        return 0
    if args.child:
        try:
            results = run_one(args.child, _pnnx_executable(), args.timeout)
        except BaseException as e:
            name = os.path.basename(args.child)[:-3]
            results = [
                dict(
                    test=name,
                    family=family(name),
                    status="load/run error",
                    detail=f"sweep child: {type(e).__name__}: {one_line(e)}",
                )
            ]
        sys.stdout.write("\nSWEEP-RESULT " + json.dumps(results) + "\n")
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown of whatever the test left behind
    if not args.tests or not os.path.isdir(args.tests):
        ap.error("--tests must name the directory holding pnnx's test_*.py files")
    files = sorted(f for f in os.listdir(args.tests) if f.startswith("test_") and f.endswith(".py"))
    if args.only:
        wanted = {f if f.endswith(".py") else f + ".py" for f in args.only}
        files = [f for f in files if f in wanted]
    results = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {pool.submit(_launch, os.path.join(os.path.abspath(args.tests), f), args): f for f in files}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            rs = fut.result()
            results.extend(rs)
            print(f"[{i}/{len(files)}] {futures[fut]}: {_file_status(rs)}", file=sys.stderr, flush=True)
            _write_json(args.json, results)  # kept current, so an interrupted sweep leaves its results
    _write_json(args.json, results)
    print_tables(results)
    print_failures(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
