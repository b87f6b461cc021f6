"""Node counts and memory plan per model: pnnx ops, nodes after the pipeline, and the
arena against the live-bytes lower bound of the stored order and the naive sum (one
buffer per tensor, no reuse), with and without the optimizing passes.

    python tools/bench_memory.py                           # test-suite models
    python tools/bench_memory.py --tv                      # + torchvision models (a venv with torchvision)
    ... --check                                            # also run and compare with torch

Test-suite models are the CNN blocks of tests/test_e2e_cnn_blocks.py and
tests/test_passes.py, exported with pnnx into /tmp/pmx_bench_exports. Torchvision models
(random weights) reuse the export cache of tools/check_torchvision.py
(/tmp/tv_exports/<model>_b1/model.pnnx.param) and its model builder.

Targets (issue): arena within 5% of the lower bound on every model, and at most half the
naive sum on every CNN.
"""

import argparse
import contextlib
import functools
import importlib.util
import io
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
TV_MODELS = [
    "resnet18",
    "mobilenet_v2",
    "densenet121",
    "googlenet",
    "squeezenet1_1",
    "shufflenet_v2_x1_0",
    "efficientnet_b0",
]
SUITE_DIR = pathlib.Path("/tmp/pmx_bench_exports")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def suite_models():
    """(name, module, inputs) for the test-suite CNNs."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    models = []
    blocks = _load(ROOT / "tests" / "test_e2e_cnn_blocks.py", "pmx_bench_blocks")
    torch.manual_seed(0)
    models.append(("tiny_cnn", blocks.randomize_bn(blocks.TinyCNN()), (torch.rand(1, 3, 17, 17),)))
    for name, factory, inputs, _ in getattr(blocks, "CASES", []):
        if name in {m[0] for m in models}:
            continue
        torch.manual_seed(0)
        models.append((name, blocks.randomize_bn(factory()), inputs()))
    passes = ROOT / "tests" / "test_passes.py"
    if passes.exists():
        tp = _load(passes, "pmx_bench_passes")
        for name, factory, inputs in getattr(tp, "BENCH_MODELS", []):
            torch.manual_seed(0)
            models.append(("passes_" + name, factory(), inputs()))
    return models


@contextlib.contextmanager
def quiet():
    """pnnx prints from C++ straight to fd 1; keep the table readable."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def export_suite(name, module, inputs):
    from helpers import export_pnnx

    d = SUITE_DIR / name
    if (d / "model.pnnx.param").exists():
        return str(d / "model")
    with quiet():
        return export_pnnx(d, module, inputs)


def compile_stats(prefix, no_opt=False):
    from pmx.compiler import pnnx
    from pmx.compiler.driver import compile_graph
    from pmx.compiler.options import CompileOptions

    graph = pnnx.load(prefix + ".pnnx.param", prefix + ".pnnx.bin")
    ops_in = len(graph.nodes)
    plan = compile_graph(graph, CompileOptions(no_opt=no_opt))
    kinds = {}
    for v in graph.values():
        if v.uid in plan.aliases and v.producer is not None:
            target = plan.aliases[v.uid][0]
            kind = (
                "view"
                if v.producer.op == "reshape"
                else "concat"
                if target.producer is not None and target.producer.op == "concat"
                else "inplace"
            )
            kinds[kind] = kinds.get(kind, 0) + 1
    # "CNN" for the half-the-naive-sum target: one output, at least two convolutions
    # (the op-coverage blocks return many tensors that all live to the end)
    cnn = len(graph.outputs) == 1 and sum(n.op == "conv" for n in graph.nodes) >= 2
    return dict(
        ops_in=ops_in,
        nodes=len(graph.nodes),
        arena=plan.arena_size,
        lb=plan.lower_bound,
        naive=plan.naive_bytes,
        kinds=kinds,
        cnn=cnn,
        graph=graph,
    )


def check_outputs(prefix, module, inputs, out_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import compare_with_torch

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            compare_with_torch(prefix, module, inputs, out_path)
        return "ok"
    except Exception as e:  # reported in the table
        return f"FAIL {type(e).__name__}: {str(e)[:60]}"


def row(name, prefix, cnn=None, check=None):
    opt = compile_stats(prefix)
    base = compile_stats(prefix, no_opt=True)
    r = dict(
        model=name,
        ops_in=opt["ops_in"],
        nodes_noopt=base["nodes"],
        nodes=opt["nodes"],
        arena=opt["arena"],
        lb=opt["lb"],
        naive=opt["naive"],
        naive_noopt=base["naive"],
        arena_noopt=base["arena"],
        cnn=opt["cnn"] if cnn is None else cnn,
        kinds=opt["kinds"],
    )
    r["over_lb"] = opt["arena"] / max(opt["lb"], 1) - 1
    r["vs_naive"] = opt["arena"] / max(opt["naive"], 1)
    r["vs_naive_noopt"] = opt["arena"] / max(base["naive"], 1)
    r["check"] = check() if check else ""
    return r


def print_table(rows):
    mb = 1e6
    print(
        "| model | CNN | pnnx ops | nodes --no-opt | nodes | aliases view/concat/inplace | arena MB "
        "| lower bound MB | arena/LB-1 | naive MB | arena/naive | arena --no-opt MB | naive --no-opt MB | check |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        k = r["kinds"]
        kinds = f"{k.get('view', 0)}/{k.get('concat', 0)}/{k.get('inplace', 0)}"
        print(
            f"| {r['model']} | {'y' if r['cnn'] else ''} | {r['ops_in']} | {r['nodes_noopt']} | {r['nodes']} "
            f"| {kinds} | {r['arena'] / mb:.3f} | {r['lb'] / mb:.3f} | {100 * r['over_lb']:.1f}% "
            f"| {r['naive'] / mb:.3f} | {r['vs_naive']:.2f} | {r['arena_noopt'] / mb:.3f} "
            f"| {r['naive_noopt'] / mb:.3f} | {r['check']} |"
        )
        sys.stdout.flush()
    worst = max((r["over_lb"] for r in rows), default=0)
    cnn_worst = max((r["vs_naive"] for r in rows if r["cnn"]), default=0)
    print(
        f"\nworst arena over lower bound: {100 * worst:.1f}% (target <= 5%); "
        f"worst CNN arena/naive: {cnn_worst:.2f} (target <= 0.5)"
    )


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tv", action="store_true", help="torchvision models (needs torchvision)")
    p.add_argument("--no-suite", action="store_true")
    p.add_argument("--models", help="comma-separated torchvision model names")
    p.add_argument("--check", action="store_true", help="also run each model and compare with torch")
    args = p.parse_args(argv)
    rows = []
    suite = []
    if not args.no_suite:
        sys.path.insert(0, str(ROOT / "tests"))
        try:
            suite = suite_models()
        except ImportError as e:  # the torchvision venv has no pytest: run the suite part in the test venv
            print(f"test-suite models skipped: {e}", file=sys.stderr)
        for name, module, inputs in suite:
            try:
                prefix = export_suite(name, module, inputs)
                path = str(SUITE_DIR / name / "m.pmx")
                check = functools.partial(check_outputs, prefix, module, inputs, path) if args.check else None
                rows.append(row(name, prefix, check=check))
            except Exception as e:
                print(f"{name}: skipped ({type(e).__name__}: {str(e)[:100]})", file=sys.stderr)
    if args.tv or args.models:
        tv = _load(ROOT / "tools" / "check_torchvision.py", "pmx_check_torchvision")
        import torch

        for name in args.models.split(",") if args.models else TV_MODELS:
            model = tv.traceable(name, tv.build(name))
            x = torch.rand(1, 3, 224, 224, generator=torch.Generator().manual_seed(2)) * 2 - 1
            with quiet():
                prefix = tv.export(name, model, x)
            check = functools.partial(check_outputs, prefix, model, (x,), prefix + ".bench.pmx") if args.check else None
            rows.append(row(name, prefix, cnn=True, check=check))
    print_table(rows)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
