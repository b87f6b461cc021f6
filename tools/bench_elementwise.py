"""Measure numexpr against the numpy ufunc sequence for the elementwise expressions pmx
fuses, over tensor sizes, on this machine. choose_kernels.py's rule is derived from
this table (its docstring holds the numbers).

    python tools/bench_elementwise.py [--quick]

For each expression and size it prints the median time of each backend (both write into
a preallocated float32 output, as in an InferenceSession) and numpy/numexpr (> 1: numexpr wins).
"""

import argparse
import sys
import time

import numpy as np

from pmx.runtime import expr as E

EXPRESSIONS = {
    # name: (expression, number of same-shape inputs)
    "add": ("add(@0,@1)", 2),
    "relu": ("maximum(@0,0)", 1),
    "add_relu": ("maximum(add(@0,@1),0)", 2),
    "relu6": ("minimum(maximum(@0,0),6)", 1),
    "leaky_relu": ("where(gt(@0,0),@0,mul(@0,0.01))", 1),
    "prelu": ("where(gt(@0,0),@0,mul(@0,@1))", 2),
    "elu": ("where(gt(@0,0),@0,mul(1.0,expm1(@0)))", 1),
    "softplus": ("where(gt(mul(@0,1.0),20.0),@0,div(log1p(exp(mul(@0,1.0))),1.0))", 1),
    "sigmoid": ("sigmoid(@0)", 1),
    "tanh": ("tanh(@0)", 1),
    "exp": ("exp(@0)", 1),
    "silu": ("mul(@0,sigmoid(@0))", 1),
    "hardswish": ("mul(@0,div(minimum(maximum(add(@0,3),0),6),6))", 1),
    "gelu_erf": ("mul(mul(@0,0.5),add(erf(mul(@0,0.7071067811865476)),1))", 1),
    "gelu_tanh": ("mul(mul(@0,0.5),add(tanh(mul(0.7978845608028654,add(@0,mul(0.044715,mul(@0,mul(@0,@0)))))),1))", 1),
    "affine_add_relu": ("maximum(add(add(mul(@0,1.5),0.25),@1),0)", 2),
    "residual_5op": ("maximum(sub(add(@0,mul(@1,0.5)),sqrt(abs(@0))),0)", 2),
}

SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]


def bench(fn, min_time=0.05, max_reps=2000):
    fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure(sizes=SIZES, names=None):
    rng = np.random.default_rng(0)
    rows = []
    for name, (text, nin) in EXPRESSIONS.items():
        if names and name not in names:
            continue
        tree = E.parse(text, nin)
        ops = E.size(tree) - len(E.inputs_used(tree))
        for n in sizes:
            inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(nin)]
            out = np.empty(n, np.float32)
            t_np = bench(E.compile_numpy(tree, inputs, out))
            t_ne = bench(E.compile_numexpr(tree, inputs, out))
            rows.append(dict(name=name, ops=ops, numel=n, numpy_us=t_np * 1e6, numexpr_us=t_ne * 1e6))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--only", action="append")
    p.add_argument("--threads", type=int, help="numexpr threads (default: numexpr's)")
    args = p.parse_args(argv)
    sizes = [1 << 12, 1 << 16, 1 << 20] if args.quick else SIZES
    import numexpr

    if args.threads:
        numexpr.set_num_threads(args.threads)
    print(f"numexpr {numexpr.__version__} threads {numexpr.nthreads}, numpy {np.__version__}")
    print(f"{'expression':<16} {'ops':>3} {'numel':>9} {'numpy us':>10} {'numexpr us':>11} {'np/ne':>6}")
    for r in measure(sizes, args.only):
        ratio = r["numpy_us"] / r["numexpr_us"]
        print(
            f"{r['name']:<16} {r['ops']:>3} {r['numel']:>9} {r['numpy_us']:>10.1f} {r['numexpr_us']:>11.1f} {ratio:>6.2f}"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
