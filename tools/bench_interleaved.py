"""Idle latency of pmx against another checkout, with the contenders' runs interleaved.

    # in the torchvision venv, models exported by tools/bench.py into --cache
    python tools/bench_interleaved.py --baseline /tmp/base
    python tools/bench_interleaved.py --baseline /tmp/base --models squeezenet1_1 --contenders pmx,pmx-baseline-blas1

The host this was built on changes speed by tens of percent over seconds (one process's
medians: 3.7-4.1 ms or 5.4-5.9 ms for the same model, switching mid-process), so
contenders measured one after another in fresh processes compare sittings, not
runtimes. Here each contender is one long-lived worker process (environment as in
tools/bench_busy_host.py: no thread variable set; `-blas1`: OPENBLAS_NUM_THREADS=1;
`pmx-baseline*`: the pmx package in --baseline DIR; `-deterministic`:
SessionOptions.use_deterministic_compute), and the parent asks the workers in
turn for a burst of --burst timed runs, --bursts times, after a pause that lets spinning
BLAS threads of the previous worker go to sleep. A drift of the host then slows every
contender alike. Prints per model the median run time of each contender and its ratio to
the first, and the geometric means of those ratios over the CNNs and the small models.
"""

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench
from bench_busy_host import environment

_WORKER = """
import json, sys, time
import numpy as np
from pmx.runtime import InferenceSession, SessionOptions
path, warm, threads, deterministic = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
options = SessionOptions()
options.intra_op_num_threads = threads  # 0: the session's default
options.use_deterministic_compute = deterministic
sess = InferenceSession(path, options)
feed = {sess.get_inputs()[0].name: np.load(path.rsplit("/", 1)[0] + "/input.npy")}
for _ in range(warm):
    sess.run(None, feed)
print("ready", flush=True)
for line in sys.stdin:
    times = []
    for _ in range(int(line)):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    print(json.dumps(times), flush=True)
"""


def model_file(contender, model_dir, args):
    """With --own-files, the baseline runs the file its own compiler wrote."""
    own = args.own_files and contender.startswith("pmx-baseline")
    return pathlib.Path(model_dir) / ("model.baseline.pmx" if own else "model.pmx")


def compile_files(model_dir, args):
    """model.pmx by this checkout's compiler, model.baseline.pmx by the baseline's, the two
    compiles alternating --compiles times; returns the median seconds of each (fresh
    processes, imports included, as `pmx compile` runs)."""
    d = pathlib.Path(model_dir)
    seconds = {"pmx": [], "pmx-baseline": []}
    for _ in range(args.compiles):
        for c, out in (("pmx", "model.pmx"), ("pmx-baseline", "model.baseline.pmx")):
            t0 = time.perf_counter()
            subprocess.run(
                bench.compile_command(d, out), env=environment(c, args.baseline), check=True, capture_output=True
            )
            seconds[c].append(time.perf_counter() - t0)
    return {c: statistics.median(t) for c, t in seconds.items()}


def start(contender, model_dir, args):
    path = model_file(contender, model_dir, args)
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _WORKER,
            str(path),
            str(args.warm),
            str(args.threads),
            "1" if contender.endswith("-deterministic") else "0",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=environment(contender, args.baseline),
    )
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{contender} worker failed on {model_dir}")
    return p


def interleave(contenders, model_dir, args):
    workers = {c: start(c, model_dir, args) for c in contenders}
    times = {c: [] for c in contenders}
    try:
        for k in range(args.bursts):
            order = contenders[k % len(contenders) :] + contenders[: k % len(contenders)]
            for c in order:
                time.sleep(args.pause)
                workers[c].stdin.write(f"{args.burst}\n")
                workers[c].stdin.flush()
                times[c] += json.loads(workers[c].stdout.readline())
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait()
    return {c: 1000 * statistics.median(t) for c, t in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated (default: bench.py's CNNs and small models)")
    p.add_argument("--contenders", default="pmx,pmx-baseline,pmx-baseline-blas1")
    p.add_argument("--baseline", default=None, metavar="DIR", help="a folder holding another checkout's pmx package")
    p.add_argument("--warm", type=int, default=30)
    p.add_argument("--burst", type=int, default=5)
    p.add_argument("--bursts", type=int, default=24, help="0: no runs (with --own-files, compile times only)")
    p.add_argument("--pause", type=float, default=0.3, help="seconds before each burst")
    p.add_argument("--cache", default="/tmp/pmx_bench")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads of every session (0: the default)")
    p.add_argument(
        "--own-files",
        action="store_true",
        help="each checkout compiles its own files (model.pmx, model.baseline.pmx) first, and compile "
        "times are reported too",
    )
    p.add_argument("--compiles", type=int, default=3, help="with --own-files: compiles per checkout and model")
    a = p.parse_args()
    names = a.models.split(",") if a.models else list(bench.TORCHVISION_CNNS) + list(bench.SMALL_MODELS)
    contenders = a.contenders.split(",")
    print(
        f"{time.strftime('%Y-%m-%d')} · {bench.cpu_description()} · {os.cpu_count()} CPUs · idle · median of "
        f"{a.burst * a.bursts} runs per contender in bursts of {a.burst}, contenders interleaved\n"
    )
    print(
        "| model | "
        + " | ".join(f"{c} ms" for c in contenders)
        + " | "
        + " | ".join(f"{c} / {contenders[0]}" for c in contenders[1:])
        + " |"
    )
    print("|---|" + "---:|" * (2 * len(contenders) - 1))
    ratios, compile_s = {}, {}
    for name in names:
        if a.own_files:
            compile_s[name] = compile_files(pathlib.Path(a.cache) / name, a)
        if not a.bursts:  # compile times only
            continue
        ms = interleave(contenders, pathlib.Path(a.cache) / name, a)
        ratios[name] = [ms[c] / ms[contenders[0]] for c in contenders[1:]]
        print(
            f"| {name} | "
            + " | ".join(f"{ms[c]:.2f}" for c in contenders)
            + " | "
            + " | ".join(f"{r:.3f}" for r in ratios[name])
            + " |",
            flush=True,
        )
    for label, group in (("CNNs", bench.TORCHVISION_CNNS), ("small models", bench.SMALL_MODELS)):
        rows = [ratios[n] for n in names if n in group and n in ratios]
        if rows:
            means = [math.exp(sum(math.log(r[i]) for r in rows) / len(rows)) for i in range(len(contenders) - 1)]
            cells = [f"geomean, {label}"] + [""] * len(contenders) + [f"{m:.3f}" for m in means]
            print("| " + " | ".join(cells) + " |")
    if compile_s:
        print(f"\nCompile, seconds (median of {a.compiles} alternating `python -m pmx.compiler` processes)\n")
        print("| model | pmx s | pmx-baseline s | pmx / pmx-baseline |\n|---|---:|---:|---:|")
        for name, c in compile_s.items():
            print(f"| {name} | {c['pmx']:.2f} | {c['pmx-baseline']:.2f} | {c['pmx'] / c['pmx-baseline']:.3f} |")


if __name__ == "__main__":
    main()
