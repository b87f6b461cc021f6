"""Load-time benchmark: how long InferenceSession(path) takes, per model.

    python tools/bench_load.py                       # models under /tmp/pmx_bench
    python tools/bench_load.py --json now.json       # also save the numbers
    python tools/bench_load.py --previous before.json  # "previous ms": its median

For each <dir>/<model>/model.pmx prints a markdown table: nodes, tensors, the median of
--repeat constructions in this process (after one warm-up, so imports and page cache are
excluded), and the first construction in a fresh process (imports excluded, the file's
pages may still be cached; median over --fresh processes, since one is noisy). Fresh
processes run with bytecode enabled (without PYTHONDONTWRITEBYTECODE), or each would
pay for recompiling the sources. --num-threads N passes num_threads=N to the
constructor, so the fresh process also pays for finding BLAS (runtime/parallel.py), as
an application that sets its thread count does.
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
import bench

MODELS = bench.TORCHVISION_CNNS + ("vit_b_16",)

# Timed in a child process: the first construction after `import pmx.runtime`.
_FRESH = """
import sys, time
from pmx.runtime import InferenceSession
threads = int(sys.argv[2]) if sys.argv[2] != "-" else None
t0 = time.perf_counter()
InferenceSession(sys.argv[1], num_threads=threads)
print((time.perf_counter() - t0) * 1e3)
"""


def in_process(path, repeat, num_threads=None):
    from pmx.runtime import InferenceSession

    sess = InferenceSession(path, num_threads=num_threads)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        InferenceSession(path, num_threads=num_threads)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), len(sess.model.nodes), len(sess.model.tensors)


def fresh_process(path, runs, num_threads=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", _FRESH, path, str(num_threads or "-")],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        times.append(float(out.split()[-1]))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/pmx_bench")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--fresh", type=int, default=5, help="fresh processes per model")
    ap.add_argument("--num-threads", type=int, help="num_threads= for the constructor (default: not given)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--previous", help="results of an earlier --json run, for the last column")
    args = ap.parse_args()
    previous = json.loads(pathlib.Path(args.previous).read_text()) if args.previous else {}
    results = {}
    print("| model | nodes | tensors | load ms median | load ms fresh process | previous ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        path = str(pathlib.Path(args.dir) / name / "model.pmx")
        median, nodes, tensors = in_process(path, args.repeat, args.num_threads)
        fresh = fresh_process(path, args.fresh, args.num_threads)
        results[name] = dict(nodes=nodes, tensors=tensors, median_ms=median, fresh_ms=fresh)
        prev = previous.get(name, {}).get("median_ms")
        prev_s = f"{prev:.1f}" if prev is not None else "-"
        print(f"| {name} | {nodes} | {tensors} | {median:.1f} | {fresh:.1f} | {prev_s} |", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
