"""Batch inference throughput and per-worker memory: one process against 1 and 2 workers.

    python tools/bench_batch.py [--rows 512] [--batch 32] [--size 96] [--repeat 3]

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=96, help="image height and width")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
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
