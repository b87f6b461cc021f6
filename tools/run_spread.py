"""How far `pmx run`'s median moves between fresh processes: each case runs as
`pmx run MODEL --random --repeat N --json` in its own process, cases alternating, and
the table gives each process's median, the spread (largest / smallest median - 1) and
the threads each run reported.

    python tools/run_spread.py --processes 6 tools/example/cnn.pmx resnet18.pmx:8

A MODEL:B case draws random inputs of batch B (`--shape` on the first input, the
model's planned shape otherwise); the .pmx must allow that batch.
"""

import argparse
import json
import os
import platform
import subprocess
import sys


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _pmx():
    """The pmx entry point beside this interpreter (the venv under test)."""
    return os.path.join(os.path.dirname(sys.executable), "pmx")


def _shape_flag(model, batch):
    if batch is None:
        return []
    from pmx.runtime import InferenceSession

    sess = InferenceSession(model)
    first = sess.get_inputs()[0]
    planned = list(sess.model.tensors[sess.model.inputs[0]].shape)
    return ["--shape", f"{first.name}=" + "x".join(map(str, [batch, *planned[1:]]))]


def run_once(model, batch, repeat, threads):
    cmd = [_pmx(), "run", model, "--random", "--repeat", str(repeat), "--json", *_shape_flag(model, batch)]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    return result["median_ms"], result["threads"], result["warmup_runs"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+", metavar="MODEL[:BATCH]")
    p.add_argument("--processes", type=int, default=6)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    cases = []
    for spec in args.cases:
        model, _, batch = spec.partition(":")
        cases.append((model, int(batch) if batch else None))
    results = {c: [] for c in cases}
    for _ in range(args.processes):
        for c in cases:
            results[c].append(run_once(*c, args.repeat, args.threads))
    print(f"CPU: {_cpu_name()}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.2f} at the end")
    print(f"`pmx run --repeat {args.repeat}`, {args.processes} fresh processes per case, cases alternating\n")
    print("| model | batch | medians ms | spread | threads | warm-up runs |")
    print("|---|---:|---|---:|---|---|")
    for (model, batch), rows in results.items():
        medians = [m for m, _, _ in rows]
        spread = max(medians) / min(medians) - 1
        print(
            f"| {os.path.basename(model)} | {batch or 'planned'} | {', '.join(f'{m:.2f}' for m in medians)} | "
            f"{100 * spread:.1f}% | {','.join(str(t) for _, t, _ in rows)} | {','.join(str(w) for _, _, w in rows)} |"
        )


if __name__ == "__main__":
    main()
