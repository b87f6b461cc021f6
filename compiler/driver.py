"""compile_model(): .param + .bin -> .pmx, the function behind `pmx compile`."""

import os
import time
from dataclasses import dataclass, field

from pmx.compiler import pnnx
from pmx.compiler.ir import Node
from pmx.compiler.passes import OPTIONAL, PIPELINE, run_pipeline
from pmx.compiler.write import write
from pmx.runtime.errors import PmxCompileError, PmxError


@dataclass
class CompileResult:
    output: str
    ops_in: int
    ops_out: int
    constants: int
    constant_bytes: int
    file_bytes: int
    arena_bytes: int
    lower_bound_bytes: int
    naive_bytes: int
    seconds: float
    pass_stats: list = field(default_factory=list)
    rule_hits: list = field(default_factory=list)  # (pass, rule, hits) per rule of each rule-table pass run
    dynamic: dict = field(default_factory=dict)   # input name -> [(min, max) per dim]
    notes: list = field(default_factory=list)     # e.g. which input dims are fixed and why
    # --tune: (node, rule's variant, chosen, {variant: median s}, {variant: [median s per round]})
    tuned: list = field(default_factory=list)


def default_output(param_path):
    base = param_path
    for suffix in (".pnnx.param", ".param"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base + ".pmx"


def _plan_dynamic_inputs(graph, dynamic, plan_shapes):
    """Inputs pnnx wrote with '?' dims: give them the planning shape the user chose
    (--shape) and declare those dims dynamic."""
    dynamic = {k: dict(v) for k, v in (dynamic or {}).items()}
    for v in graph.inputs:
        if v.shape is not None and None not in v.shape:
            continue
        plan = (plan_shapes or {}).get(v.name)
        if plan is None or v.shape is None or len(plan) != len(v.shape) or any(
                p is None or (d is not None and d != p) for p, d in zip(plan, v.shape)):
            shown = "x".join("?" if d is None else str(d) for d in v.shape) if v.shape else "?"
            raise PmxCompileError(
                f"{graph.source}: input {v.name} has dynamic dims ({shown}); give the size to plan memory for, "
                f"with ranges where wanted, e.g. --shape {v.name}={shown.replace('?', '1..', 1).replace('?', '224')}")
        for d, (recorded, size) in enumerate(zip(v.shape, plan)):
            if recorded is None:
                dynamic.setdefault(v.name, {}).setdefault(d, (1, -1))
        v.shape = tuple(plan)
    return dynamic


def compile_graph(graph, keep=(), verify=False, disabled=(), no_opt=False, dynamic=None, auto_batch=True,
                  plan_shapes=None, tune=False):
    """Run the pipeline on a parsed graph. `dynamic` = {input name: {dim: (min, max)}}
    (max -1 = unbounded) declares input dims that may change at run time; with
    auto_batch, dim 0 of every input is made dynamic too when the model allows it.
    `plan_shapes` = {input name: shape} gives the size to plan for to inputs that pnnx
    wrote with '?' dims (those dims become dynamic). With `tune`, kernels are chosen by
    timing the candidates on this machine (compiler/passes/tune.py) at the planned
    shapes."""
    dynamic = _plan_dynamic_inputs(graph, dynamic, plan_shapes)
    graph.tune = tune
    graph.tune_report = []
    graph.dynamic_request = dict(dynamic or {})
    graph.auto_batch = auto_batch
    by_name = {v.name: v for v in graph.values()}
    kept = []
    for name in keep:
        if name not in by_name:
            sample = ", ".join(sorted(by_name)[:12])
            raise PmxCompileError(f"--keep {name}: no tensor of that name in {graph.source} (some names: {sample})")
        kept.append(by_name[name])
    graph.kept = kept
    disabled = set(disabled) | (OPTIONAL if no_opt else set())
    unknown = set(disabled) - {p.name for p in PIPELINE}
    if unknown:
        raise PmxCompileError(f"unknown pass name(s) {sorted(unknown)}; passes: {[p.name for p in PIPELINE]}")
    if verify:
        # pnnx records no shape for 0-d results and index lists; infer_shapes fills them
        graph.verify(after="pnnx frontend", require_shapes=False)
    run_pipeline(graph, verify=verify, disabled=disabled)
    inputs = {v.uid for v in graph.inputs}
    for i, v in enumerate(graph.outputs):
        if v.uid not in inputs and not v.is_constant and v not in kept:
            v.name = f"out{i}"
    return graph


def _internal_error(e, source):
    """A pass or rule crashed (usually on a parameter of a type pnnx never writes): name
    the node being compiled (the innermost frame with a `node` local) and the code site."""
    where, site, tb = "", "", e.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("node")
        if isinstance(node, Node):
            where = f" {node.where()}:"
        site = "/".join(tb.tb_frame.f_code.co_filename.split(os.sep)[-2:]) + f":{tb.tb_lineno}"
        tb = tb.tb_next
    detail = " ".join(str(e).split())[:300]  # one line, as the CLI prints it
    return PmxCompileError(f"{source}:{where} cannot compile: {type(e).__name__}: {detail} "
                           f"(internal error at {site}; check the op's parameters)")


def compile_model(param_path, bin_path=None, output=None, keep=(), verify=False, disabled=(),
                  no_opt=False, dynamic=None, auto_batch=True, plan_shapes=None, tune=False, metadata=None,
                  _fail_after_bytes=None):
    """metadata: {key: value} strings stored in the file (pmx compile --meta KEY=VALUE),
    read back as InferenceSession.get_modelmeta().custom_metadata_map."""
    t0 = time.perf_counter()
    param_path = os.fspath(param_path)
    bin_path = None if bin_path is None else os.fspath(bin_path)
    output = None if output is None else os.fspath(output)
    if bin_path is None:
        bin_path = param_path[: -len(".param")] + ".bin" if param_path.endswith(".param") else param_path + ".bin"
    output = output or default_output(param_path)
    for src in (param_path, bin_path):
        if os.path.exists(output) and os.path.exists(src) and os.path.samefile(output, src):
            raise PmxCompileError(f"refusing to overwrite the input file {src} with the compiled model; choose another -o")
    graph = pnnx.load(param_path, bin_path)
    ops_in = len(graph.nodes)
    try:
        compile_graph(graph, keep=keep, verify=verify, disabled=disabled, no_opt=no_opt,
                      dynamic=dynamic, auto_batch=auto_batch, plan_shapes=plan_shapes, tune=tune)
    except PmxError:
        raise
    except Exception as e:  # a malformed model must not escape as a bare crash
        raise _internal_error(e, param_path) from e
    graph.metadata = dict(metadata or {})
    size = write(graph, output, _fail_after_bytes=_fail_after_bytes)
    consts = [v for v in graph.values() if v.is_constant]
    return CompileResult(
        output=output, ops_in=ops_in, ops_out=len(graph.nodes), constants=len(consts),
        constant_bytes=sum(v.nbytes for v in consts), file_bytes=size, arena_bytes=graph.arena_size,
        lower_bound_bytes=graph.lower_bound, naive_bytes=graph.naive_bytes,
        seconds=time.perf_counter() - t0, pass_stats=list(graph.pass_stats), rule_hits=list(graph.rule_hits),
        dynamic=dict(graph.dynamic), notes=list(graph.fixed_reasons), tuned=list(graph.tune_report))
