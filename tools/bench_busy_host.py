"""Latency on an idle and on a busy host, as users run pmx: no environment variable set.

    # in the torchvision venv (tools/bench.py exports the models into --cache)
    python tools/bench_busy_host.py --baseline /tmp/base            # CNNs + small models
    python tools/bench_busy_host.py --models resnet18,mobilenet_v3_small --busy 0,1,4

For each model and host state (0, 1 or 4 other processes busy-looping on the cores:
`python -c "while True: pass"`), the contenders run in fresh processes, taking turns:

- pmx: the environment with no thread variable (OMP_*, OPENBLAS_*, MKL_*, NUMEXPR_*);
  InferenceSession defaults, as a user gets them;
- pmx-blas1: the same with OPENBLAS_NUM_THREADS=1 (the old advice for a busy host);
- pmx-baseline: another checkout's runtime (--baseline DIR holding its `pmx` package) on
  the same .pmx files, environment as for pmx; pmx-baseline-blas1 (not run by default):
  that runtime with OPENBLAS_NUM_THREADS=1;
- onnxruntime: 2 intra-op threads (1 inter-op), environment as for pmx.

Each process warms up --warm runs, then reports the median of --runs timed runs; a process
stops early after --budget seconds of running (a collapsed contender can take seconds per
run), and the table marks such a median with the runs it had. Each cell is the median
over --rounds processes. Prints a markdown table: ms per state, and busy/idle ratios; the
last columns compare pmx's slowdown with onnxruntime's on the same host.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench  # the model set, exports and the CPU description

CONTENDERS = ("pmx", "pmx-blas1", "pmx-baseline", "onnxruntime")
THREAD_VARIABLES = ("OMP_", "OPENBLAS_", "MKL_", "NUMEXPR_", "GOTO_", "VECLIB_")

_WORKER = """
import json, sys, time
import numpy as np
contender, model_dir, warm, runs, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
x = np.load(model_dir + "/input.npy")
if contender.startswith("pmx"):
    from pmx.runtime import InferenceSession
    sess = InferenceSession(model_dir + "/model.pmx")
else:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    sess = ort.InferenceSession(model_dir + "/model.onnx", so, providers=["CPUExecutionProvider"])
feed = {sess.get_inputs()[0].name: x}
start = time.perf_counter()
for _ in range(warm):
    sess.run(None, feed)
    if time.perf_counter() - start > budget / 2:
        break
times = []
for _ in range(runs):
    t0 = time.perf_counter()
    sess.run(None, feed)
    times.append(time.perf_counter() - t0)
    if time.perf_counter() - start > budget:
        break
print(json.dumps(dict(ms=sorted(times)[len(times) // 2] * 1e3, runs=len(times))))
"""


def environment(contender, baseline):
    env = {k: v for k, v in os.environ.items() if not k.startswith(THREAD_VARIABLES)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if contender.endswith("-blas1"):
        env["OPENBLAS_NUM_THREADS"] = "1"
    if contender.startswith("pmx-baseline"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (baseline, env.get("PYTHONPATH")) if p)
    return env


def measure(contender, model_dir, args):
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, contender, str(model_dir), str(args.warm), str(args.runs), str(args.budget)],
        env=environment(contender, args.baseline),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        return dict(error=(done.stderr.strip().splitlines() or ["failed"])[-1][:120])
    return json.loads(done.stdout.strip().splitlines()[-1])


def busy_processes(n):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def one_state(contenders, model_dir, args):
    """{contender: [samples]} over args.rounds rounds, the order rotated each round."""
    samples = {c: [] for c in contenders}
    for r in range(args.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            samples[c].append(measure(c, model_dir, args))
    return samples


def summary(samples):
    good = [s for s in samples if "ms" in s]
    if not good:
        return dict(error=samples[0].get("error", "failed"))
    return dict(
        ms=statistics.median(s["ms"] for s in good), runs=min(s["runs"] for s in good), all_ms=[s["ms"] for s in good]
    )


def fmt(cell, want_runs):
    if "ms" not in cell:
        return "error"
    text = f"{cell['ms']:.2f}" if cell["ms"] < 100 else f"{cell['ms']:,.0f}"
    return text + (f" ({cell['runs']} runs)" if cell["runs"] < want_runs else "")


def table(results, states, contenders, want_runs):
    head = ["model", "contender"] + [f"{'idle' if n == 0 else f'{n} busy'} ms" for n in states]
    head += [f"{n} busy / idle" for n in states if n]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for model, by_state in results.items():
        for c in contenders:
            cells = [by_state[n][c] for n in states]
            row = [model, c] + [fmt(x, want_runs) for x in cells]
            idle = cells[0].get("ms")
            row += [
                f"{by_state[n][c]['ms'] / idle:.2f}" if idle and "ms" in by_state[n][c] else "-" for n in states if n
            ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def slowdown_table(results, states, contenders):
    """pmx's busy/idle ÷ onnxruntime's busy/idle per busy state and pmx contender."""
    busy = [n for n in states if n]
    mine = [c for c in contenders if c.startswith("pmx")]
    head = ["model"] + [f"{c} @ {n} busy" for n in busy for c in mine]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for model, by_state in results.items():
        row = [model]
        for n in busy:
            for c in mine:
                try:
                    ratio = (by_state[n][c]["ms"] / by_state[0][c]["ms"]) / (
                        by_state[n]["onnxruntime"]["ms"] / by_state[0]["onnxruntime"]["ms"]
                    )
                    row.append(f"{ratio:.2f}")
                except (KeyError, ZeroDivisionError):
                    row.append("-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated (default: bench.py's CNNs and small models)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--busy", default="0,1,4", help="numbers of busy processes; 0 (idle) first")
    p.add_argument("--warm", type=int, default=60)
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=30.0, help="seconds of runs per process at most")
    p.add_argument("--baseline", default=None, metavar="DIR", help="a folder holding another checkout's pmx package")
    p.add_argument("--cache", default="/tmp/pmx_bench")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = args.models.split(",") if args.models else list(bench.TORCHVISION_CNNS) + list(bench.SMALL_MODELS)
    contenders = [c for c in args.contenders.split(",") if not c.startswith("pmx-baseline") or args.baseline]
    states = [int(n) for n in args.busy.split(",")]
    results = {}
    for name in names:
        model_dir, _ = bench.prepare(name, args.cache)
        results[name] = {}
        for n in states:
            procs = busy_processes(n)
            try:
                time.sleep(0.5 if n else 0)
                results[name][n] = {c: summary(s) for c, s in one_state(contenders, model_dir, args).items()}
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
        print(f"{name}: done", file=sys.stderr)
    print(
        f"\n{time.strftime('%Y-%m-%d')} · {bench.cpu_description()} · {os.cpu_count()} CPUs · no thread variables "
        f"set (pmx-blas1: OPENBLAS_NUM_THREADS=1) · onnxruntime 2 intra-op threads · median of {args.runs} runs "
        f"after {args.warm} warm-ups, median of {args.rounds} fresh processes\n"
    )
    print(table(results, states, contenders, args.runs))
    print("\npmx's busy/idle ÷ onnxruntime's busy/idle (at most 1.5 is the target)\n")
    print(slowdown_table(results, states, contenders))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
