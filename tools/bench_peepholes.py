"""Each model-specific rule on and off, over the tools/bench.py models it fires on.

    python tools/bench_peepholes.py                       # every model in /tmp/pmx_bench
    python tools/bench_peepholes.py --models densenet121 --rounds 5 --threads 1

For every model already prepared by tools/bench.py (model.pnnx.param/.bin, input.npy,
expected.npy in --cache), the model is compiled once with every pass and once more with
each peephole that fires on it disabled (`--disable NAME`). Each round loads every
variant in this process and runs them one run of each in turn: the host this was built
on drifts by tens of percent over seconds, and variants measured in fresh processes one
after another had compared moments of the host (docs/performance.md); interleaved, a
drift slows every variant alike. Each latency is the median of --runs runs after 10
warm-ups, the table shows the median over rounds, the ratio off/on (above 1: the rule
pays) and the worst relative error against torch of either variant.
"""

import argparse
import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench

PEEPHOLES = ("batch_norm_as_elementwise", "fold_affine_relu", "pool_before_pointwise", "negate_silu_weights")
WARM = 10


def interleaved(paths, runs, threads):
    """([median ms], [output 0]) of each file's session, their runs taking turns."""
    from pmx.runtime import InferenceSession, SessionOptions

    options = SessionOptions()
    options.intra_op_num_threads = threads  # 0: the session's default
    sessions = [InferenceSession(str(p), options) for p in paths]
    feed = {sessions[0].get_inputs()[0].name: np.load(pathlib.Path(paths[0]).parent / "input.npy")}
    times = [[] for _ in sessions]
    for k in range(WARM + runs):
        for s, t in zip(sessions, times):
            t0 = time.perf_counter()
            s.run(None, feed)
            if k >= WARM:
                t.append(time.perf_counter() - t0)
    return [1000 * float(np.median(t)) for t in times], [s.run(None, feed)[0] for s in sessions]


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


def rel_err(got, expected):
    got = got.reshape(expected.shape)
    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-12))


def measure(d, variants, runs, rounds, threads):
    names = list(variants)
    samples = {n: [] for n in names}
    for _ in range(rounds):
        ms, outputs = interleaved([variants[n] for n in names], runs, threads)
        for n, m in zip(names, ms):
            samples[n].append(m)
    expected = np.load(d / "expected.npy")
    return {
        n: dict(ms=float(np.median(samples[n])), samples=samples[n], rel_err=rel_err(out, expected))
        for n, out in zip(names, outputs)
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default="/tmp/pmx_bench")
    p.add_argument("--models", default=None, help="comma-separated model directories in --cache")
    p.add_argument("--runs", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the session's default)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cache = pathlib.Path(a.cache)
    dirs = [cache / m for m in a.models.split(",")] if a.models else sorted(cache.iterdir())
    print(f"{bench.cpu_description()}; {a.rounds} rounds x {a.runs} runs; threads: {a.threads or 'default'}")
    print("| model | rule off | ms with | ms without | without/with | rel err with / without |")
    print("|---|---|---:|---:|---:|---|")
    results = {}
    for d in dirs:
        if not (d / "model.pnnx.param").exists() or not (d / "expected.npy").exists():
            continue
        variants = compile_variants(d)
        if len(variants) == 1:
            continue
        res = results[d.name] = measure(d, variants, a.runs, a.rounds, a.threads)
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
