"""Latency with 1 and 2 threads while another process keeps one core busy.

    python tools/bench_busy_host.py a.pmx b.pmx --runs 50

For each model, in fresh processes alternating between thread counts, prints the median
run time with num_threads=1 and =2, first on the idle host, then with a busy-looping
process started beside it (`python -c "while True: pass"`). On a 2-core host a second
thread can then only help while the busy process is off its core; the number to watch is
2-thread time / 1-thread time with the host busy (at most 1.1 is the target).
BLAS is given one thread in the measured processes (OPENBLAS_NUM_THREADS=1, as the README
recommends), unless --blas-threads says otherwise.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

_WORKER = """
import json, sys, time
import numpy as np
from pmx.runtime import InferenceSession
path, threads, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sess = InferenceSession(path, num_threads=threads)
feed = {i.name: np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
        .astype(np.float32) for i in sess.get_inputs()}
for _ in range(50):  # past the thread choice's first two trials (runtime/parallel.py RunChooser)
    sess.run(None, feed)
times = []
for _ in range(runs):
    t0 = time.perf_counter()
    sess.run(None, feed)
    times.append(time.perf_counter() - t0)
print(json.dumps(sorted(times)[len(times) // 2] * 1e3))
"""


def measure(path, threads, runs, blas_threads):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(blas_threads), OMP_NUM_THREADS=str(threads))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-c", _WORKER, str(path), str(threads), str(runs)], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{path}: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


def medians(path, runs, rounds, blas_threads):
    got = {1: [], 2: []}
    for _ in range(rounds):
        for threads in (1, 2):
            got[threads].append(measure(path, threads, runs, blas_threads))
    return {t: statistics.median(v) for t, v in got.items()}


def name_of(path):
    p = pathlib.Path(path)
    return p.parent.name if p.name == "model.pmx" else p.stem


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help=".pmx files")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blas-threads", type=int, default=1)
    args = p.parse_args()
    rows = []
    for path in args.models:
        idle = medians(path, args.runs, args.rounds, args.blas_threads)
        busy_process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            busy = medians(path, args.runs, args.rounds, args.blas_threads)
        finally:
            busy_process.kill()
            busy_process.wait()
        rows.append((name_of(path), idle, busy))
        print(f"{name_of(path)}: done", file=sys.stderr)
    print(f"BLAS threads {args.blas_threads}; medians of {args.runs} runs, median of {args.rounds} processes\n")
    print("| model | idle 1 thread ms | idle 2 threads ms | busy 1 thread ms | busy 2 threads ms | busy 2/1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, idle, busy in rows:
        print(f"| {name} | {idle[1]:.2f} | {idle[2]:.2f} | {busy[1]:.2f} | {busy[2]:.2f} | {busy[2] / busy[1]:.2f} |")


if __name__ == "__main__":
    main()
