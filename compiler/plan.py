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

from dataclasses import dataclass, field
from types import MappingProxyType

from pmx.compiler.options import CompileOptions
from pmx.runtime.errors import PmxInternalError


@dataclass(frozen=True)
class Plan:
    # the graph's nodes in the execution order the file stores (the runtime never sorts)
    order: tuple
    # root Value uid -> arena byte offset, for every non-constant tensor that is no view
    offsets: MappingProxyType
    # Value uid -> (target Value, byte offset, strides or None): the tensor is a view of
    # the target's bytes (a reshape, a concat slice, an in-place output) and has no buffer
    aliases: MappingProxyType
    arena_size: int
    # the most bytes alive at one step: no plan of these buffers can be smaller
    lower_bound: int
    # runtime/plan.py naive_bytes: one buffer per tensor, nothing reused
    naive_bytes: int
    # input name -> [(min, max) per dim] (max -1: unbounded), for inputs with dims that
    # may change at run time
    dynamic: MappingProxyType
    # output Value uid -> [its dims that follow the dynamic input dims]
    dynamic_outputs: MappingProxyType
    # why input dims that could have been dynamic are fixed, for the compile summary
    fixed_reasons: tuple
    # --tune: (node, rule's variant, chosen, {variant: median s}, {variant: [median s per round]})
    tune_report: tuple
    # (pass, nodes before, nodes after) per pass run, in order; the file stores them
    pass_stats: tuple
    # (rule set, rule, hits) per rule of each rule-table pass run (compiler/rewrite.py)
    rule_hits: tuple
    # what the compile decided that the user should know
    notes: tuple


@dataclass
class PassContext:
    """One compile's options, and what its passes have found so far: each field below
    `options` is filled by the pass named beside it, and `plan(graph)` freezes them."""

    options: CompileOptions = field(default_factory=CompileOptions)
    notes: list = field(default_factory=list)  # the driver (placeholder sizes)
    pass_stats: list = field(default_factory=list)  # run_pipeline
    rule_hits: list = field(default_factory=list)  # every rule_pass
    dynamic: dict = field(default_factory=dict)  # mark_dynamic_dims
    dynamic_outputs: dict = field(default_factory=dict)  # mark_dynamic_dims
    fixed_reasons: list = field(default_factory=list)  # mark_dynamic_dims
    tune_report: list = field(default_factory=list)  # tune
    aliases: dict = field(default_factory=dict)  # alias_views, alias_concat, write_inplace
    offsets: dict | None = None  # plan_memory, with the three below
    arena_size: int = 0
    lower_bound: int = 0
    naive_bytes: int = 0

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
