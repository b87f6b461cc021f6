"""Each model-specific rule on and off, over the tools/bench.py models it fires on.

    python tools/bench_peepholes.py                       # every model in /tmp/pmx_bench
    python tools/bench_peepholes.py --models densenet121 --rounds 7

For every model already prepared by tools/bench.py (model.pnnx.param/.bin, input.npy,
expected.npy in --cache), the model is compiled once with every pass and once more with
each peephole that fires on it disabled (`--disable NAME`). Every file then runs in
fresh processes (session defaults: the threads a user gets), the variants of a model
taking turns in an order rotated every round, or with --interleaved all in one process per
round, one run of each in turn; each latency is the median of --runs runs after warm-up, and the table shows the median over rounds, the ratio off/on (above 1:
the rule pays) and the worst relative error against torch of either variant.
"""

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

PEEPHOLES = ("batch_norm_as_elementwise", "fold_affine_relu", "pool_before_pointwise", "negate_silu_weights")


def worker(path, runs, threads):
    from pmx.runtime import InferenceSession, SessionOptions

    options = SessionOptions()
    options.intra_op_num_threads = threads  # 0: the session's default
    sess = InferenceSession(path, options)
    x = np.load(pathlib.Path(path).parent / "input.npy")
    feed = {sess.get_inputs()[0].name: x}
    for _ in range(max(10, runs // 2)):
        out = sess.run(None, feed)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    np.save(pathlib.Path(path).with_suffix(".out.npy"), out[0])
    print(json.dumps(dict(ms=1000 * float(np.median(times)))))


def interleaved(paths, runs, threads):
    """All variants in this process, one run of each in turn: the host's speed drifts by
    tens of percent over seconds here, and a drift then slows every variant alike."""
    from pmx.runtime import InferenceSession, SessionOptions

    options = SessionOptions()
    options.intra_op_num_threads = threads
    sessions = [InferenceSession(str(p), options) for p in paths]
    x = np.load(pathlib.Path(paths[0]).parent / "input.npy")
    feed = {sessions[0].get_inputs()[0].name: x}
    times = [[] for _ in sessions]
    for k in range(runs + 10):
        for s, t in zip(sessions, times):
            t0 = time.perf_counter()
            s.run(None, feed)
            if k >= 10:
                t.append(time.perf_counter() - t0)
    for s, p in zip(sessions, paths):
        np.save(pathlib.Path(p).with_suffix(".out.npy"), s.run(None, feed)[0])
    return [1000 * float(np.median(t)) for t in times]


def compile_variants(d):
    """model.pmx with every pass, and peep_<name>.pmx without each peephole that fires."""
    from pmx.compiler.driver import compile_model

    param, weights = str(d / "model.pnnx.param"), str(d / "model.pnnx.bin")
    result = compile_model(param, weights, output=str(d / "peep_all.pmx"))
    fired = sorted({p for p, _, n in result.rule_hits if p in PEEPHOLES and n}, key=PEEPHOLES.index)
    variants = {"all": d / "peep_all.pmx"}
    for name in fired:
        variants[name] = d / f"peep_{name}.pmx"
        compile_model(param, weights, output=str(variants[name]), disabled={name})
    return variants


def run_worker(path, runs, threads):
    p = subprocess.run(
        [sys.executable, __file__, "--worker", str(path), "--runs", str(runs), "--threads", str(threads)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if p.returncode != 0:
        raise RuntimeError(f"{path}: {p.stderr.strip()[-300:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["ms"]


def rel_err(path, expected):
    got = np.load(pathlib.Path(path).with_suffix(".out.npy")).reshape(expected.shape)
    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-12))


def measure(d, variants, runs, rounds, threads, in_process):
    names = list(variants)
    samples = {n: [] for n in names}
    for r in range(rounds):
        if in_process:
            for n, ms in zip(names, interleaved([variants[n] for n in names], runs, threads)):
                samples[n].append(ms)
            continue
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(run_worker(variants[n], runs, threads))
    expected = np.load(d / "expected.npy")
    return {
        n: dict(ms=float(np.median(s)), samples=s, rel_err=rel_err(variants[n], expected)) for n, s in samples.items()
    }


def cpu_name():
    for line in (
        pathlib.Path("/proc/cpuinfo").read_text().splitlines() if pathlib.Path("/proc/cpuinfo").exists() else ()
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", default=None)
    p.add_argument("--cache", default="/tmp/pmx_bench")
    p.add_argument("--models", default=None, help="comma-separated model directories in --cache")
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the session's default)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--interleaved",
        action="store_true",
        help="per round, one process running the variants' runs in turn (else a process per variant)",
    )
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.runs, a.threads)
    cache = pathlib.Path(a.cache)
    dirs = [cache / m for m in a.models.split(",")] if a.models else sorted(cache.iterdir())
    print(f"CPU: {cpu_name()}; {a.rounds} rounds x {a.runs} runs; threads: {a.threads or 'default'}")
    print("| model | rule off | ms with | ms without | without/with | rel err with / without |")
    print("|---|---|---:|---:|---:|---|")
    results = {}
    for d in dirs:
        if not (d / "model.pnnx.param").exists() or not (d / "expected.npy").exists():
            continue
        variants = compile_variants(d)
        if len(variants) == 1:
            continue
        res = results[d.name] = measure(d, variants, a.runs, a.rounds, a.threads, a.interleaved)
        on = res["all"]
        for name in list(variants)[1:]:
            off = res[name]
            print(
                f"| {d.name} | {name} | {on['ms']:.2f} | {off['ms']:.2f} | {off['ms'] / on['ms']:.3f} "
                f"| {on['rel_err']:.1e} / {off['rel_err']:.1e} |",
                flush=True,
            )
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
