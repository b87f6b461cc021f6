"""Batch inference throughput and per-worker memory: one process against 1 and 2 workers.

    python tools/bench_batch.py [--rows 512] [--batch 32] [--size 96] [--repeat 3]
    # torchvision models (the venv of tools/bench.py): img/s per batch size
    python tools/bench_batch.py --models resnet18,mobilenet_v3_small [--batches 1,8,32] [--baseline DIR]

With --models: each model is exported by tools/bench.py's prepare into --cache (pnnx
files, model_dynamic.onnx) and compiled with `pmx compile ... --dynamic in0:0` into
model_dyn.pmx; then pmx (and pmx-baseline, the pmx package in --baseline DIR, on the same
file) and onnxruntime each run in a fresh process per round, --threads threads, the
contenders taking turns in an order rotated every round. A worker times each batch size
(--seconds of runs after two warm-up runs, at least 3) and reports img/s from the median
run; the table shows the median over the rounds and the CPU it ran on.

Builds a CNN of plain 3x3 convolutions with ~40 MB of float32 weights, exports it with
pnnx and compiles it in a temporary directory, then measures rows/s for
  - a loop in this process (one InferenceSession, the process's default thread count, then 1),
  - 1 and 2 spawned worker processes, each one Predictor with 1 thread, splitting the rows
    (timed from a start signal sent once every worker has opened the file and run once),
and, for each worker, its memory from /proc/PID/smaps_rollup after its last batch:
USS (private pages), PSS (its share of every page; the sum over processes is the real
total) and shared (pages other processes map too, e.g. the weights in the page cache).
Linux only (smaps_rollup, Linux >= 4.14). Rows/s is the median over --repeat rounds.
"""

import argparse
import contextlib
import io
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def build_model(directory, size):
    """A ResNet-ish stack of plain convs: 3->64->128->256->512 (stride 2) and four
    512->512 3x3 convs, global pooling and a linear head (~11 M weights, ~44 MB)."""
    import pnnx
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            shapes = [(3, 64, 2), (64, 128, 2), (128, 256, 2), (256, 512, 2)] + [(512, 512, 1)] * 4
            self.names = [f"conv{i}" for i in range(len(shapes))]
            for name, (cin, cout, stride) in zip(self.names, shapes):
                setattr(self, name, nn.Conv2d(cin, cout, 3, stride, 1))
            self.head = nn.Linear(512, 1000)

        def forward(self, x):
            for name in self.names:
                x = torch.relu(getattr(self, name)(x))
            return self.head(x.mean((2, 3)))

    torch.manual_seed(0)
    model = Net().eval()
    weights_mb = sum(p.numel() for p in model.parameters()) * 4 / 1e6
    cwd = os.getcwd()
    try:
        os.chdir(directory)
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            pnnx.export(model, os.path.join(directory, "model.pt"), (torch.rand(1, 3, size, size),))
    finally:
        os.chdir(cwd)
    from pmx.compiler.driver import compile_model

    path = os.path.join(directory, "model.pmx")
    compile_model(os.path.join(directory, "model.pnnx.param"), os.path.join(directory, "model.pnnx.bin"), path)
    return path, weights_mb


def memory(pid="self"):
    """USS, PSS and shared MB of a process (smaps_rollup)."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                fields[parts[0][:-1]] = int(parts[1]) / 1024
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    shared = fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0)
    return {"uss": uss, "pss": fields.get("Pss", 0), "shared": shared, "rss": fields.get("Rss", 0)}


def worker(path, x, batch, ready, go, measure, results):
    from pmx.runtime import Predictor

    p = Predictor(path, num_threads=1)
    p({"in0": x[:batch]})  # bind the arena before the clock starts
    ready.put(os.getpid())
    go.wait()
    t0 = time.perf_counter()
    for i in range(0, len(x), batch):
        p({"in0": x[i : i + batch]})
    results.put(time.perf_counter() - t0)
    measure.wait()  # every worker still alive, so pages they all map count as shared
    results.put(memory())


def run_workers(path, x, batch, n):
    ctx = multiprocessing.get_context("spawn")
    ready, results, go, measure = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    parts = np.array_split(x, n)
    procs = [ctx.Process(target=worker, args=(path, part, batch, ready, go, measure, results)) for part in parts]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    t0 = time.perf_counter()
    go.set()
    for _ in procs:
        results.get(timeout=600)
    wall = time.perf_counter() - t0
    measure.set()
    mems = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return len(x) / wall, mems


def run_loop(path, x, batch, threads=None):
    from pmx.runtime import Predictor

    p = Predictor(path, num_threads=threads)
    p({"in0": x[:batch]})
    t0 = time.perf_counter()
    for i in range(0, len(x), batch):
        p({"in0": x[i : i + batch]})
    return len(x) / (time.perf_counter() - t0), p.session.get_session_options().intra_op_num_threads


# --- --models: img/s per batch size, pmx against onnxruntime -----------------------------

_BATCH_WORKER = """
import json, sys, time
import numpy as np
contender, model_dir, batches = sys.argv[1:4]
threads, seconds = int(sys.argv[4]), float(sys.argv[5])
x1 = np.load(model_dir + "/input.npy")
if contender.startswith("pmx"):
    from pmx.runtime import InferenceSession
    sess = InferenceSession(model_dir + "/model_dyn.pmx", num_threads=threads)
else:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model_dir + "/model_dynamic.onnx", opts, providers=["CPUExecutionProvider"])
name = sess.get_inputs()[0].name
out = {}
for b in [int(v) for v in batches.split(",")]:
    feed = {name: np.ascontiguousarray(np.repeat(x1, b, axis=0))}
    for _ in range(2):
        sess.run(None, feed)
    times, start = [], time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    out[b] = b / float(np.median(times))
print(json.dumps(out))
"""


def prepare_dynamic(name, cache):
    """tools/bench.py's export of `name` into cache/name, plus model_dyn.pmx compiled with
    a free batch dim (pmx compile --dynamic in0:0)."""
    import subprocess

    import bench

    d, _ = bench.prepare(name, cache)
    if not (d / "model_dyn.pmx").exists():
        subprocess.run(
            bench.compile_command(d, "model_dyn.pmx") + ["--dynamic", "in0:0"], check=True, capture_output=True
        )
    return d


def batch_rates(contender, d, args):
    """{batch: img/s} of one fresh worker process."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    if contender == "pmx-baseline":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.baseline, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-c", _BATCH_WORKER, contender, str(d), args.batches, str(args.threads), str(args.seconds)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{contender} on {d.name}: {p.stderr.strip()[-300:]}")
    return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


def models_main(args):
    import math
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import bench

    contenders = ["pmx"] + (["pmx-baseline"] if args.baseline else []) + ["onnxruntime"]
    batches = [int(b) for b in args.batches.split(",")]
    names = args.models.split(",")
    print(
        f"{time.strftime('%Y-%m-%d')} · {bench.cpu_description()} · {os.cpu_count()} CPUs · load average "
        f"{os.getloadavg()[0]:.1f} · {args.threads} threads · img/s, median of {args.rounds} fresh processes per "
        f"contender (contenders alternating), each the median run of {args.seconds:g} s per batch size\n"
    )
    cols = [f"{c} b{b}" for c in contenders for b in batches]
    ratio_cols = [f"pmx/ort b{b}" for b in batches]
    if args.baseline:
        ratio_cols += [f"pmx/base b{b}" for b in batches]
    print("| model | " + " | ".join(cols + ratio_cols) + " |")
    print("|---|" + "---:|" * (len(cols) + len(ratio_cols)))
    ratios = {}
    for name in names:
        d = prepare_dynamic(name, args.cache)
        samples = {c: [] for c in contenders}
        for r in range(args.rounds):
            k = r % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                samples[c].append(batch_rates(c, d, args))
        med = {c: {b: statistics.median(s[b] for s in samples[c]) for b in batches} for c in contenders}
        row = [med["pmx"][b] / med["onnxruntime"][b] for b in batches]
        if args.baseline:
            row += [med["pmx"][b] / med["pmx-baseline"][b] for b in batches]
        ratios[name] = row
        cells = [f"{med[c][b]:.1f}" for c in contenders for b in batches] + [f"{v:.2f}" for v in row]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    means = [math.exp(sum(math.log(r[i]) for r in ratios.values()) / len(ratios)) for i in range(len(ratio_cols))]
    print("| geomean | " + " | ".join([""] * len(cols) + [f"{m:.2f}" for m in means]) + " |")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="torchvision models: img/s per batch size (see above)")
    ap.add_argument("--batches", default="1,8,32", help="with --models")
    ap.add_argument("--baseline", default=None, metavar="DIR", help="with --models: a folder holding another pmx")
    ap.add_argument("--rounds", type=int, default=3, help="with --models: fresh processes per contender")
    ap.add_argument("--seconds", type=float, default=2.0, help="with --models: timed runs per batch size")
    ap.add_argument("--threads", type=int, default=2, help="with --models")
    ap.add_argument("--cache", default="/tmp/pmx_bench", help="with --models")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=96, help="image height and width")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.models:
        return models_main(args)
    x = np.random.default_rng(0).random((args.rows, 3, args.size, args.size), dtype=np.float32)
    with tempfile.TemporaryDirectory() as d:
        path, weights_mb = build_model(d, args.size)
        print(
            f"model: {weights_mb:.1f} MB of weights, .pmx {os.path.getsize(path) / 1e6:.1f} MB; {args.rows} rows of "
            f"3x{args.size}x{args.size}, batches of {args.batch}; {os.cpu_count()} cores, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        rows = {}
        mem = {}
        for _ in range(args.repeat):
            rate, threads = run_loop(path, x, args.batch)
            rows.setdefault(f"1 process, {threads} threads", []).append(rate)
            rate, _ = run_loop(path, x, args.batch, threads=1)
            rows.setdefault("1 process, 1 thread", []).append(rate)
            for n in (1, 2):
                rate, m = run_workers(path, x, args.batch, n)
                rows.setdefault(f"{n} worker{'s' if n > 1 else ''} x 1 thread", []).append(rate)
                mem[n] = m
    print(f"\n| {'run':<26} | rows/s (median of {args.repeat}) |")
    print(f"|{'-' * 28}|{'-' * 26}|")
    for name, rates in rows.items():
        print(f"| {name:<26} | {statistics.median(rates):>24.1f} |")
    print("\n| workers | worker | USS MB | PSS MB | shared MB | RSS MB |")
    print("|---------|--------|--------|--------|-----------|--------|")
    for n, ms in mem.items():
        for i, m in enumerate(ms):
            print(f"| {n} | {i} | {m['uss']:.1f} | {m['pss']:.1f} | {m['shared']:.1f} | {m['rss']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
