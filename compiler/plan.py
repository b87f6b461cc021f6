"""The Plan: everything a compile decides about a graph besides its nodes, as one frozen
value that the pipeline returns and the writer (compiler/write.py) and CompileResult
consume; and the PassContext, which carries the options to the pipeline's passes and
collects what they find until the Plan is made from it.

The memory part has the shape of the runtime's re-planned Layout (runtime/replan.py):
arena offsets per root buffer, views (aliases) of other tensors' bytes, the arena size;
keyed by Value uid where the Layout is keyed by tensor index. It is planned by the
placement passes at the end of the pipeline (order, alias_views, alias_concat,
write_inplace, plan_memory: compiler/passes/), over the node list they keep as it is.
"""

from types import MappingProxyType

from pmx.compiler.options import CompileOptions
from pmx.runtime.errors import PmxInternalError
from pmx.runtime.record import FrozenRecord, set_fields


class Plan(FrozenRecord):
    """Made by PassContext.plan; every field by keyword."""

    __slots__ = (
        # the graph's nodes in the execution order the file stores (the runtime never sorts)
        "order",
        # root Value uid -> arena byte offset, for every non-constant tensor that is no view
        "offsets",
        # Value uid -> (target Value, byte offset, strides or None): the tensor is a view of
        # the target's bytes (a reshape, a concat slice, an in-place output) and has no buffer
        "aliases",
        "arena_size",
        # the most bytes alive at one step: no plan of these buffers can be smaller
        "lower_bound",
        # runtime/plan.py naive_bytes: one buffer per tensor, nothing reused
        "naive_bytes",
        # input name -> [(min, max) per dim] (max -1: unbounded), for inputs with dims that
        # may change at run time
        "dynamic",
        # output Value uid -> [its dims that follow the dynamic input dims]
        "dynamic_outputs",
        # why input dims that could have been dynamic are fixed, for the compile summary
        "fixed_reasons",
        # --tune: (node, rule's variant, chosen, {variant: median s}, {variant: [median s per round]})
        "tune_report",
        # (pass, nodes before, nodes after) per pass run, in order; the file stores them
        "pass_stats",
        # (rule set, rule, hits) per rule of each rule-table pass run (compiler/rewrite.py)
        "rule_hits",
        # what the compile decided that the user should know
        "notes",
    )

    def __init__(self, **fields):
        set_fields(self, fields)


class PassContext:
    """One compile's options, and what its passes have found so far: each field below
    `options` is filled by the pass named beside it, and `plan(graph)` freezes them."""

    def __init__(self, options=None, placeholders=None):
        self.options = CompileOptions() if options is None else options
        # {(input name, dim): (min, max)}: '?' dims no --shape sized, which canonicalize
        # plans at a placeholder size (compiler/passes/placeholder.py)
        self.placeholders = dict(placeholders or {})
        self.notes = []  # canonicalize (placeholder sizes), mark_dynamic_dims (reshapes read per image)
        self.pass_stats = []  # run_pipeline
        self.rule_hits = []  # every rule_pass
        self.dynamic = {}  # mark_dynamic_dims
        self.dynamic_outputs = {}  # mark_dynamic_dims
        self.fixed_reasons = []  # mark_dynamic_dims
        self.tune_report = []  # tune
        self.aliases = {}  # alias_views, alias_concat, write_inplace
        self.offsets = None  # plan_memory, with the three below
        self.arena_size = 0
        self.lower_bound = 0
        self.naive_bytes = 0

    def plan(self, graph) -> Plan:
        """The Plan of `graph` as it stands; PmxInternalError before memory is planned."""
        if self.offsets is None:
            raise PmxInternalError(f"{graph.source}: no memory plan: the pipeline ended without plan_memory")
        return Plan(
            order=tuple(graph.nodes),
            offsets=MappingProxyType(dict(self.offsets)),
            aliases=MappingProxyType(dict(self.aliases)),
            arena_size=self.arena_size,
            lower_bound=self.lower_bound,
            naive_bytes=self.naive_bytes,
            dynamic=MappingProxyType({name: list(ranges) for name, ranges in self.dynamic.items()}),
            dynamic_outputs=MappingProxyType(dict(self.dynamic_outputs)),
            fixed_reasons=tuple(self.fixed_reasons),
            tune_report=tuple(self.tune_report),
            pass_stats=tuple(self.pass_stats),
            rule_hits=tuple(self.rule_hits),
            notes=tuple(self.notes),
        )
