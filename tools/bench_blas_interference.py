"""Runs right after the caller's own BLAS work: does OpenBLAS's idle pool get in the way?

    python tools/bench_blas_interference.py                     # the example model
    python tools/bench_blas_interference.py a.pmx b.pmx --runs 200

OpenBLAS's pool threads spin for its thread timeout after each multi-threaded call
(2^28 cycles by default, ~0.1 s), on the cores pmx's worker thread needs. pmx leaves
BLAS's settings alone; the user can shorten the timeout or give BLAS one thread. For
each model and setup, in a fresh process per round (rounds alternate between setups),
this prints the median of --runs runs back to back and of --runs runs each right after
a float32 --matmul x --matmul matrix product (on BLAS's own threads). Setups:
  default               numpy, then pmx, as they come
  timeout 4             OPENBLAS_THREAD_TIMEOUT=4 set by the user: idle BLAS threads sleep at once
  BLAS on one thread    OPENBLAS_NUM_THREADS=1: pmx splits GEMMs over its own threads
Models default to tools/example/cnn.pnnx.param compiled into a temporary directory.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

SETUPS = {
    "default": {},
    "timeout 4": {"OPENBLAS_THREAD_TIMEOUT": "4"},
    "BLAS on one thread": {"OPENBLAS_NUM_THREADS": "1"},
}

_IMPORTS = "import numpy as np\nimport pmx.runtime\n"

_WORKER = """
import json, sys, time
path, runs, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
session = pmx.runtime.InferenceSession(path)
feed = {i.name: np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
        .astype(np.float32) for i in session.get_inputs()}
a = np.random.default_rng(1).standard_normal((size, size)).astype(np.float32)
for _ in range(10):
    session.run(None, feed)
    a @ a
plain, after = [], []
for _ in range(runs):
    t0 = time.perf_counter()
    session.run(None, feed)
    plain.append(time.perf_counter() - t0)
for _ in range(runs):
    a @ a
    t0 = time.perf_counter()
    session.run(None, feed)
    after.append(time.perf_counter() - t0)
median = lambda v: sorted(v)[len(v) // 2] * 1e3
print(json.dumps(dict(plain_ms=median(plain), after_matmul_ms=median(after))))
"""


def measure(path, setup, runs, size):
    extra_env = SETUPS[setup]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS")
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # or each process recompiles the sources
    env.update(extra_env)
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS + _WORKER, str(path), str(runs), str(size)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"{path} ({setup}): {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def example_model(directory):
    root = pathlib.Path(__file__).resolve().parent / "example"
    out = pathlib.Path(directory) / "cnn.pmx"
    subprocess.run(
        [sys.executable, "-m", "pmx.compiler.cli", "compile", str(root / "cnn.pnnx.param"), "-o", str(out)],
        check=True,
        capture_output=True,
    )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", help=".pmx files (default: the example model)")
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--matmul", type=int, default=384, help="side of the caller's square float32 matmul")
    p.add_argument("--json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = [pathlib.Path(m) for m in args.models] or [example_model(tmp)]
        results = {}
        for path in models:
            rounds = {setup: [] for setup in SETUPS}
            for _ in range(args.rounds):
                for setup in SETUPS:
                    rounds[setup].append(measure(path, setup, args.runs, args.matmul))
            results[str(path)] = {
                setup: {key: statistics.median(r[key] for r in got) for key in got[0]} for setup, got in rounds.items()
            }
    print(f"| model | setup | back to back ms | right after a {args.matmul}x{args.matmul} matmul ms | ratio |")
    print("|---|---|---:|---:|---:|")
    for path, by_setup in results.items():
        for setup, r in by_setup.items():
            name = pathlib.Path(path).parent.name if pathlib.Path(path).name == "model.pmx" else pathlib.Path(path).stem
            print(
                f"| {name} | {setup} | {r['plain_ms']:.2f} | "
                f"{r['after_matmul_ms']:.2f} | {r['after_matmul_ms'] / r['plain_ms']:.2f} |"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
