"""Serving concurrent requests: K host threads sharing one InferenceSession against K
worker processes, pmx against onnxruntime.

    # in the torchvision venv (tools/bench.py exports the models into --cache)
    python tools/bench_concurrency.py --models mobilenet_v3_small,resnet18 --k 1,2,4

For each model, contender and K, in fresh processes: "threads" is one process whose one
InferenceSession (1 intra-op thread) is called by K threads at once; "processes" is K
processes, each with its own InferenceSession (1 intra-op thread) on the same file (pmx
shares the weights through the page cache). All callers start together after loading and
warming up, run for --seconds, and the table gives the total runs per second (median of
--rounds). No thread environment variable is set.
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
import bench  # the model set and exports

_WORKER = """
import json, sys, threading, time
import numpy as np
contender, model_dir, callers, start_at, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
x = np.load(model_dir + "/input.npy")
if contender == "pmx":
    from pmx.runtime import InferenceSession
    sess = InferenceSession(model_dir + "/model.pmx", num_threads=1)
else:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    sess = ort.InferenceSession(model_dir + "/model.onnx", so, providers=["CPUExecutionProvider"])
feed = {sess.get_inputs()[0].name: x}
counts = [0] * callers

def caller(k):
    for _ in range(20):
        sess.run(None, feed)
    time.sleep(max(0.0, start_at - time.time()))
    end = start_at + seconds
    while time.time() < end:
        sess.run(None, feed)
        counts[k] += 1

threads = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(sum(counts)))
"""

THREAD_VARIABLES = ("OMP_", "OPENBLAS_", "MKL_", "NUMEXPR_")


def runs_per_second(contender, model_dir, k, mode, seconds, margin):
    env = {key: v for key, v in os.environ.items() if not key.startswith(THREAD_VARIABLES)}
    start_at = time.time() + margin
    processes, callers = (k, 1) if mode == "processes" else (1, k)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, contender, str(model_dir), str(callers), str(start_at), str(seconds)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    total = 0
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            return None
        total += json.loads(out.strip().splitlines()[-1])
    return total / seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mobilenet_v3_small,resnet18")
    p.add_argument("--k", default="1,2,4")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--margin", type=float, default=8.0, help="seconds allowed for import, load and warm-up")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache", default="/tmp/pmx_bench")
    args = p.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    head = ["model", "contender", "mode"] + [f"K={k} runs/s" for k in ks]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * len(ks)]
    for name in args.models.split(","):
        model_dir, _ = bench.prepare(name, args.cache)
        for mode in ("threads", "processes"):
            for contender in ("pmx", "onnxruntime"):
                cells = []
                for k in ks:
                    got = [
                        runs_per_second(contender, model_dir, k, mode, args.seconds, args.margin)
                        for _ in range(args.rounds)
                    ]
                    got = [g for g in got if g is not None]
                    cells.append(f"{statistics.median(got):,.0f}" if got else "error")
                lines.append("| " + " | ".join([name, contender, mode] + cells) + " |")
        print(f"{name}: done", file=sys.stderr)
    print(
        f"\n{time.strftime('%Y-%m-%d')} · {bench.cpu_description()} · {os.cpu_count()} CPUs · 1 intra-op thread "
        f"per InferenceSession · {args.seconds:g} s per measurement, median of {args.rounds}\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
