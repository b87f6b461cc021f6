"""compile_model(): .param + .bin -> .pmx, the function behind `pmx compile`."""

import os
import time

from pmx.compiler import pnnx
from pmx.compiler.ir import Node
from pmx.compiler.options import CompileOptions
from pmx.compiler.passes import PIPELINE, run_pipeline
from pmx.compiler.plan import PassContext, Plan
from pmx.compiler.shape_specs import (
    dtype_option,
    dynamic_option,
    merge_dynamic,
    shape_option,
    shape_template,
    shape_text,
)
from pmx.compiler.write import write
from pmx.runtime.dim_ranges import UNBOUNDED, in_range, range_text
from pmx.runtime.errors import PmxCompileError, PmxError
from pmx.runtime.record import Record, set_fields


class CompileResult(Record):
    """What compile_model reports: sizes, timings and what the passes decided."""

    __slots__ = (
        "output",
        "replaced",  # True where `output` existed and the compile replaced it
        "ops_in",
        "ops_out",
        "constants",
        "constant_bytes",
        "file_bytes",
        "arena_bytes",
        "lower_bound_bytes",
        "naive_bytes",
        "seconds",
        "pass_stats",
        "rule_hits",  # (pass, rule, hits) per rule of each rule-table pass run
        "dynamic",  # input name -> [(min, max) per dim]
        "notes",  # e.g. which input dims are fixed and why
        # --tune: (node, rule's variant, chosen, {variant: median s}, {variant: [median s per round]})
        "tuned",
    )

    def __init__(self, **fields):
        set_fields(self, fields)

    def __repr__(self):
        """One line a person reads (the fields are attributes: result.arena_bytes, ...)."""
        from pmx.runtime.dim_ranges import format_ranges

        said = [f"{n} takes {format_ranges(r)}" for n, r in self.dynamic.items()]
        said += [f"note: {note}" for note in self.notes]
        return (
            f"<CompileResult {self.output}: {self.ops_in} pnnx ops -> {self.ops_out} nodes, "
            f"file {_size_text(self.file_bytes)}, arena {_size_text(self.arena_bytes)}, "
            f"{self.seconds * 1e3:.0f} ms{''.join('; ' + s for s in said)}>"
        )


def _size_text(nbytes):
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


def default_output(param_path):
    base = param_path
    for suffix in (".pnnx.param", ".param"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base + ".pmx"


def _plan_dynamic_inputs(graph, options):
    """Inputs pnnx wrote with '?' dims get the shape memory is planned for, and those dims
    become dynamic: any size (1..), or the range asked for; a fixed size asked for fixes
    them. The size planned for is the one given (`options.plan_shapes`, from --shape: a
    range's lower end), else a placeholder the canonicalize pass chooses
    (compiler/passes/placeholder.py): the runtime plans memory again at the first run's
    shape, as for any new shape. With --static (no auto_batch) a '?' dim needs a given
    size: --static promises the planned shapes. Returns the dynamic dims requested,
    checked, with the '?' ones, and the '?' dims left to a placeholder,
    {(input name, dim): (min, max)}."""
    plan_shapes = options.plan_shapes
    dynamic = _check_requested_shapes(graph, options.dynamic, plan_shapes)
    unplanned = {}  # (input name, dim) -> (min, max): '?' dims without a size to plan for
    for v in graph.inputs:
        if v.shape is not None and None not in v.shape:
            continue
        plan = plan_shapes.get(v.name)
        if v.shape is None:
            if plan is None or None in plan:
                raise PmxCompileError(
                    f"{graph.source}: input {v.name} has no recorded shape; give the shape to "
                    f"compile for, e.g. --shape {v.name}=1x3x224x224 (--shape {v.name}= for a 0-d input)"
                )
            v.shape = tuple(plan)
            continue
        plan = list(plan or [None] * len(v.shape))
        dims = dynamic.setdefault(v.name, {})
        for d, recorded in enumerate(v.shape):
            if recorded is not None:
                plan[d] = recorded
                continue
            lo, hi = dims.setdefault(d, (1, UNBOUNDED))
            if lo == hi:
                plan[d] = lo
            elif plan[d] is None:
                unplanned[(v.name, d)] = (lo, hi)
            elif not in_range(plan[d], lo, hi):
                raise PmxCompileError(
                    f"{graph.source}: input {v.name}: the size {plan[d]} to plan dim {d} for is "
                    f"outside its range {range_text(lo, hi)}"
                )
        v.shape = tuple(plan)
    if unplanned and not options.auto_batch:
        raise PmxCompileError(_static_needs_shapes(graph, unplanned))
    return dynamic, unplanned


def _type_inputs(graph, input_dtypes, plan_shapes):
    """Inputs get the dtype given (--dtype) where pnnx wrote none (the frontend leaves
    their dtype None): it writes none for a 0-d input (an ONNX model's), and no guess is
    safe (a length is an integer, a scale a float). A dtype given for an input pnnx typed
    must agree with it."""
    by_name = {v.name: v for v in graph.inputs}
    for name, dtype in input_dtypes.items():
        v = by_name.get(name)
        if v is None:
            raise PmxCompileError(
                f"--dtype {name}={dtype}: the model has no input {name} (inputs: {', '.join(by_name)})"
            )
        if v.recorded_dtype is not None and v.recorded_dtype != dtype:
            raise PmxCompileError(f"--dtype {name}={dtype}: {graph.source} records input {name} as {v.recorded_dtype}")
        v.dtype = v.recorded_dtype = dtype
    v = next((v for v in graph.inputs if v.dtype is None), None)
    if v is not None:
        no_shape = v.shape is None and v.name not in plan_shapes
        missing, what, flags = "dtype", "it", f"--dtype {v.name}=int64 (or float32, ...)"
        if no_shape:  # `--shape NAME=` (no dims) says it is 0-d
            missing, what, flags = "dtype or shape", "them", f"--shape {v.name}= {flags}"
        raise PmxCompileError(
            f"{graph.source}: input {v.name} has no recorded {missing} (pnnx writes none for a 0-d "
            f"input, nor for uint16/32/64, which pmx does not take); give {what}, e.g. {flags}"
        )


def _static_needs_shapes(graph, unplanned):
    v = next(v for v in graph.inputs if v.name == next(iter(unplanned))[0])
    shown = "x".join("?" if d is None else str(d) for d in v.shape)
    return (
        f"{graph.source}: input {v.name} has dynamic dims ({shown}) and --static keeps the shapes the "
        f"model is compiled for: give them, --shape {v.name}={shape_template(v.shape)} with each <n> a size (or drop --static: "
        f"the dims then take any size)"
    )


def _check_requested_shapes(graph, dynamic, plan_shapes):
    """--shape and --dynamic against the export: each names an input the model has, a
    --shape has the input's rank, and on a dim pnnx recorded with a fixed size a fixed
    size must equal it and a range must contain it (the model is checked and its memory
    planned at the recorded size; a range opens the dim around it: 1..16 on a recorded
    batch of 1 makes the batch dynamic). Returns `dynamic` with non-negative dims."""
    inputs = {v.name: v for v in graph.inputs}
    for name in [*plan_shapes, *dynamic]:
        if name not in inputs:
            listed = ", ".join(f"{n} {shape_text(v.shape)}" for n, v in inputs.items())
            raise PmxCompileError(
                f"{graph.source}: --shape/--dynamic names input {name!r}; the model's inputs are {listed or 'none'}"
            )
    for name, plan in plan_shapes.items():
        v = inputs[name]
        if v.shape is not None and len(plan) != len(v.shape):
            raise PmxCompileError(
                f"{graph.source}: input {name} was exported as {shape_text(v.shape)}; the "
                f"requested shape {_request_text(plan, {}, len(plan))} has rank {len(plan)}, "
                f"not {len(v.shape)}"
            )
    checked = {}
    for name, dims in dynamic.items():
        v = inputs[name]
        rank = len(v.shape) if v.shape is not None else len(plan_shapes.get(name, ()))
        checked[name] = {}
        for dim, rng in dims.items():
            if not -rank <= dim < rank:
                raise PmxCompileError(f"{graph.source}: --dynamic {name}:{dim}: input {name} has rank {rank}")
            checked[name][dim % rank] = rng
    for name in {*plan_shapes, *checked}:
        _check_one_input(graph.source, inputs[name], plan_shapes.get(name), checked.get(name, {}))
    return checked


def _check_one_input(source, v, plan, dims):
    if v.shape is None:
        return
    given = _request_text(plan, dims, len(v.shape))

    def refuse(why):
        raise PmxCompileError(
            f"{source}: input {v.name} was exported as {shape_text(v.shape)}; the requested shape {given} {why}"
        )

    for d, recorded in enumerate(v.shape):
        if recorded is None:
            continue
        if d in dims:
            lo, hi = dims[d]
            if lo == hi and lo != recorded:
                refuse(f"fixes dim {d} at {lo}: only its '?' dims can take another fixed size")
            if not in_range(recorded, lo, hi):
                refuse(
                    f"allows {range_text(lo, hi)} in dim {d}, without its exported size {recorded}: the model "
                    f"is compiled at that size, so a range must include it (e.g. "
                    f"{range_text(min(lo, recorded), hi if hi == UNBOUNDED else max(hi, recorded))})"
                )
        elif plan is not None and plan[d] is not None and plan[d] != recorded:
            refuse(f"plans dim {d} at {plan[d]}: only its '?' dims can take another size")


def _request_text(plan, dims, rank):
    """The request as --shape spells it: 1..16x3x224x224."""
    rank = len(plan) if plan is not None else rank
    parts = []
    for d in range(rank):
        if d in dims:
            parts.append("?" if dims[d] == (1, UNBOUNDED) else range_text(*dims[d]))
        else:
            size = plan[d] if plan is not None else None
            parts.append("?" if size is None else str(size))
    return "x".join(parts)


def compile_graph(graph, options) -> Plan:
    """Run the pipeline on a parsed graph with `options` (a CompileOptions) and return
    its Plan. `options.dynamic` = {input name: {dim: (min, max)}} (max -1 = unbounded)
    declares input dims that may change at run time, (n, n) fixes a dim at n; with
    auto_batch, dim 0 of every input is made dynamic too when the model allows it.
    Requests are checked against the shapes pnnx recorded (_check_requested_shapes).
    `options.plan_shapes` = {input name: shape} gives the size to plan for to inputs that
    pnnx wrote with '?' dims (those dims become dynamic); without it they are planned at
    a placeholder size (_plan_dynamic_inputs). With `options.tune`, kernels are chosen by
    timing the candidates on this machine (compiler/passes/tune.py) at the planned shapes.
    `options.input_dtypes` types the inputs pnnx wrote no dtype for (_type_inputs)."""
    _type_inputs(graph, options.input_dtypes, options.plan_shapes)
    dynamic, placeholders = _plan_dynamic_inputs(graph, options)
    by_name = {v.name: v for v in graph.values()}
    kept = []
    for name in options.keep:
        if name not in by_name:
            sample = ", ".join(sorted(by_name)[:12])
            raise PmxCompileError(f"--keep {name}: no tensor of that name in {graph.source} (some names: {sample})")
        kept.append(by_name[name])
    graph.keep(kept)
    unknown = options.disabled - {p.name for p in PIPELINE}
    if unknown:
        raise PmxCompileError(f"unknown pass name(s) {sorted(unknown)}; passes: {[p.name for p in PIPELINE]}")
    if options.verify:
        # pnnx records no shape for 0-d results and index lists; infer_shapes fills them
        graph.verify(after="pnnx frontend", require_shapes=False)
    plan = run_pipeline(graph, PassContext(options.replace(dynamic=dynamic), placeholders=placeholders))
    inputs, kept = {v.uid for v in graph.inputs}, {v.uid for v in graph.kept}
    for i, v in enumerate(graph.outputs):
        if v.uid not in inputs and not v.is_constant and v.uid not in kept:
            v.name = f"out{i}"
    return plan


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
    return PmxCompileError(
        f"{source}:{where} cannot compile: {type(e).__name__}: {detail} "
        f"(internal error at {site}; check the op's parameters)"
    )


def compile_model(
    param_path,
    bin_path=None,
    output=None,
    keep=(),
    verify=False,
    disabled=(),
    no_opt=False,
    dynamic=None,
    auto_batch=True,
    plan_shapes=None,
    tune=False,
    metadata=None,
    shape=None,
    dtype=None,
    _fail_after_bytes=None,
):
    """Compile param_path (+ bin_path, default beside it) into `output` (default: the
    .param's name with .pmx, beside it); returns a CompileResult. The keywords are
    `pmx compile`'s flags:

    keep        tensor names to keep readable after a run (--keep)
    verify      check the graph after every pass (--verify)
    disabled    optional passes not to run (--disable); no_opt: none of them (--no-opt)
    dynamic     input dims that may change at run time (--dynamic): "in0:0,2", a list of
                such strings, {"in0": [0, 2]}, or {"in0": {0: (1, 16)}} (max None: unbounded)
    shape       sizes per dim (--shape): "in0=1..16x3x224x224" (N, A..B, A.. or ?; "in0="
                for a 0-d input), a list of such strings, {"in0": "1..16x3x224x224"}, or
                {"in0": (1, 3, 224, 224)} (None: '?')
    dtype       dtypes of inputs pnnx wrote none for, a 0-d input's (--dtype): "in0=int32",
                a list of such strings, or {"in0": "int32"}
    auto_batch  make dim 0 of every input dynamic where the model allows it (False: --static)
    tune        choose kernels by timing them on this machine (--tune)
    metadata    {key: value} strings stored in the file (--meta KEY=VALUE), read back as
                InferenceSession.get_modelmeta().custom_metadata_map
    plan_shapes {input name: shape} to plan memory at, for '?' dims (what shape= sets)

    A value of another form is a PmxInputError naming the keyword and the forms it takes
    (compiler/shape_specs.py)."""
    t0 = time.perf_counter()
    param_path = os.fspath(param_path)
    bin_path = None if bin_path is None else os.fspath(bin_path)
    output = None if output is None else os.fspath(output)
    if bin_path is None:
        bin_path = param_path[: -len(".param")] + ".bin" if param_path.endswith(".param") else param_path + ".bin"
    output = output or default_output(param_path)
    for src in (param_path, bin_path):
        if os.path.exists(output) and os.path.exists(src) and os.path.samefile(output, src):
            raise PmxCompileError(
                f"refusing to overwrite the input file {src} with the compiled model; choose another -o"
            )
    shape_dynamic, shape_plan = shape_option(shape)
    dynamic = merge_dynamic(dynamic_option(dynamic), shape_dynamic)
    plan_shapes = {**(plan_shapes or {}), **shape_plan}
    input_dtypes = dtype_option(dtype)
    graph = pnnx.load(param_path, bin_path)
    ops_in = len(graph.nodes)
    try:
        options = CompileOptions(
            keep=keep,
            verify=verify,
            disabled=disabled,
            no_opt=no_opt,
            dynamic=dynamic,
            auto_batch=auto_batch,
            plan_shapes=plan_shapes,
            input_dtypes=input_dtypes,
            tune=tune,
            metadata=metadata,
        )
        plan = compile_graph(graph, options)
    except PmxError:
        raise
    except Exception as e:  # a malformed model must not escape as a bare crash
        raise _internal_error(e, param_path) from e
    replaced = os.path.exists(output)
    size = write(graph, plan, options, output, _fail_after_bytes=_fail_after_bytes)
    consts = [v for v in graph.values() if v.is_constant]
    return CompileResult(
        output=output,
        replaced=replaced,
        ops_in=ops_in,
        ops_out=len(graph.nodes),
        constants=len(consts),
        constant_bytes=sum(v.nbytes for v in consts),
        file_bytes=size,
        arena_bytes=plan.arena_size,
        lower_bound_bytes=plan.lower_bound,
        naive_bytes=plan.naive_bytes,
        seconds=time.perf_counter() - t0,
        pass_stats=list(plan.pass_stats),
        rule_hits=list(plan.rule_hits),
        dynamic=dict(plan.dynamic),
        notes=list(plan.notes + plan.fixed_reasons),
        tuned=list(plan.tune_report),
    )
