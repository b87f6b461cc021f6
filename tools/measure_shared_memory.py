"""Measure how much memory processes that load the same .pmx file share.

Weights are used straight from the mmap of the file (read-only np.frombuffer views), so
every process that maps the file uses the same page-cache pages: N processes should cost
about one copy of the weights plus N times the private part (interpreter, numpy, arena).

    python tools/measure_shared_memory.py [--mb 100] [--procs 4]

Builds a model of a few big nn.Linear layers (~100 MB of float32 weights), exports it
with pnnx and compiles it in a temporary directory, then starts 1 and then N worker
processes that each create an InferenceSession and run it once, and reads RSS and PSS
from /proc/<pid>/smaps_rollup (PSS divides each shared page among the processes that map
it, so the sum of PSS is the real total). For contrast, one more round has each worker
copy the weights into private memory, as a loader that reads the file would.
Linux only (smaps_rollup, Linux >= 4.14).
"""

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import textwrap

WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from pmx.runtime import InferenceSession

    mode = sys.argv[2]
    if mode != "baseline":
        sess = InferenceSession(sys.argv[1])
        arg = sess.get_inputs()[0]
        sess.run(None, {arg.name: np.ones(arg.shape, np.float32)})
        if mode == "private":  # what reading the weights into memory would cost
            copies = [np.array(c, copy=True) for c in sess.model.constants.values()]
    sys.stdout.write("ready\\n")
    sys.stdout.flush()
    sys.stdin.readline()
""")


def build_model(directory, mb):
    import pnnx
    import torch
    import torch.nn as nn

    width = 2048
    layers = max(1, round(mb * 1e6 / (width * width * 4)))

    class Big(nn.Module):  # named layers: pnnx writes Python, where `self.0` is no name
        def __init__(self):
            super().__init__()
            self.names = [f"fc{i}" for i in range(layers)]
            for name in self.names:
                setattr(self, name, nn.Linear(width, width))

        def forward(self, x):
            for name in self.names:
                x = torch.relu(getattr(self, name)(x))
            return x

    model = Big().eval()
    cwd = os.getcwd()
    try:
        os.chdir(directory)  # pnnx writes side files into the working directory
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            pnnx.export(model, os.path.join(directory, "big.pt"), (torch.rand(1, width),))
    finally:
        os.chdir(cwd)
    from pmx.compiler.driver import compile_model

    out = os.path.join(directory, "big.pmx")
    r = compile_model(os.path.join(directory, "big.pnnx.param"), os.path.join(directory, "big.pnnx.bin"), out)
    return out, r.constant_bytes


def smaps_rollup(pid):
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def measure(path, procs, mode):
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, path, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(procs)
    ]
    try:
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker failed to start")
        return [smaps_rollup(w.pid) for w in workers]
    finally:
        for w in workers:
            w.stdin.close()
            w.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=100, help="weights to build, in MB (default 100)")
    ap.add_argument("--procs", type=int, default=4)
    args = ap.parse_args()
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as d:
        path, weight_bytes = build_model(d, args.mb)
        print(f"model: {path}, {os.path.getsize(path) / mib:.1f} MiB file, {weight_bytes / mib:.1f} MiB of weights\n")
        rows = []
        for label, n, mode in [
            ("imports only (baseline)", 1, "baseline"),
            ("1 process, mmap", 1, "mmap"),
            (f"{args.procs} processes, mmap", args.procs, "mmap"),
            (f"{args.procs} processes, private copy", args.procs, "private"),
        ]:
            stats = measure(path, n, mode)
            rows.append(
                (
                    label,
                    n,
                    sum(s["Rss"] for s in stats) / n,
                    sum(s["Pss"] for s in stats),
                    sum(s.get("Shared_Clean", 0) for s in stats) / n,
                    sum(s["Rss"] for s in stats),
                )
            )
        print(f"{'':<30} {'RSS/proc':>10} {'PSS/proc':>10} {'shared/proc':>12} {'sum RSS':>10} {'sum PSS':>10}")
        for label, n, rss, pss, shared, total_rss in rows:
            print(
                f"{label:<30} {rss / mib:>8.1f}Mi {pss / n / mib:>8.1f}Mi {shared / mib:>10.1f}Mi "
                f"{total_rss / mib:>8.1f}Mi {pss / mib:>8.1f}Mi"
            )
        one, many = rows[1][3], rows[2][3]
        base = rows[0][3]
        print(
            f"\nsum PSS: 1 process {one / mib:.1f} MiB, {args.procs} processes {many / mib:.1f} MiB "
            f"({many / one:.2f}x; {(many - args.procs * base) / mib:.1f} MiB above {args.procs} bare interpreters, "
            f"weights {weight_bytes / mib:.1f} MiB)"
        )
        print(f"private copies instead: {rows[3][3] / mib:.1f} MiB for {args.procs} processes")


if __name__ == "__main__":
    main()
