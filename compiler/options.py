"""CompileOptions: what the user asked of one compile (`pmx compile`'s flags,
compile_model's arguments), one frozen value passed explicitly to the driver, the
pipeline's passes and the writer."""

from dataclasses import dataclass, field
from types import MappingProxyType


def _frozen(mapping):
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class CompileOptions:
    # tensors to keep readable after a run, by name (--keep)
    keep: tuple = ()
    # check the graph and its aliases after every pass (--verify)
    verify: bool = False
    # optional passes not to run (--disable NAME); no_opt: none of them (--no-opt)
    disabled: frozenset = frozenset()
    no_opt: bool = False
    # {input name: {dim: (min, max)}} input dims that may change at run time (max -1:
    # unbounded; (n, n) fixes the dim at n) (--dynamic, --shape); the driver passes the
    # pipeline these checked against the export, with the dims pnnx wrote as '?' added
    dynamic: MappingProxyType = field(default_factory=dict)
    # make dim 0 of every input dynamic where the model allows it (off: --static)
    auto_batch: bool = True
    # {input name: shape} to plan memory at, for inputs pnnx wrote with '?' dims (--shape)
    plan_shapes: MappingProxyType = field(default_factory=dict)
    # choose kernels by timing them on this machine (--tune)
    tune: bool = False
    # {key: value} strings stored in the file (--meta KEY=VALUE)
    metadata: MappingProxyType = field(default_factory=dict)

    def __post_init__(self):
        # the containers given become read-only copies, so no pass can change the options
        object.__setattr__(self, "keep", tuple(self.keep or ()))
        object.__setattr__(self, "disabled", frozenset(self.disabled or ()))
        object.__setattr__(
            self, "dynamic", MappingProxyType({name: _frozen(dims) for name, dims in (self.dynamic or {}).items()})
        )
        object.__setattr__(self, "plan_shapes", _frozen(self.plan_shapes))
        object.__setattr__(self, "metadata", _frozen(self.metadata))
