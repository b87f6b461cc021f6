"""CompileOptions: what the user asked of one compile (`pmx compile`'s flags,
compile_model's arguments), one frozen value passed explicitly to the driver, the
pipeline's passes and the writer."""

from types import MappingProxyType

from pmx.runtime.record import FrozenRecord


def _frozen(mapping):
    return MappingProxyType(dict(mapping or {}))


class CompileOptions(FrozenRecord):
    """The containers given become read-only copies, so no pass can change the options.
    A plain record rather than a dataclass: @dataclass generates and executes code at
    import, a cost every `pmx compile` pays."""

    __slots__ = (
        # tensors to keep readable after a run, by name (--keep)
        "keep",
        # check the graph and its aliases after every pass (--verify)
        "verify",
        # optional passes not to run (--disable NAME); no_opt: none of them (--no-opt)
        "disabled",
        "no_opt",
        # {input name: {dim: (min, max)}} input dims that may change at run time (max -1:
        # unbounded; (n, n) fixes the dim at n) (--dynamic, --shape); the driver passes the
        # pipeline these checked against the export, with the dims pnnx wrote as '?' added
        "dynamic",
        # make dim 0 of every input dynamic where the model allows it (off: --static)
        "auto_batch",
        # {input name: shape} to plan memory at, for inputs pnnx wrote with '?' dims (--shape)
        "plan_shapes",
        # {input name: numpy dtype name} for inputs pnnx wrote no dtype for (--dtype)
        "input_dtypes",
        # choose kernels by timing them on this machine (--tune)
        "tune",
        # {key: value} strings stored in the file (--meta KEY=VALUE)
        "metadata",
    )

    def __init__(
        self,
        keep=(),
        verify=False,
        disabled=(),
        no_opt=False,
        dynamic=None,
        auto_batch=True,
        plan_shapes=None,
        input_dtypes=None,
        tune=False,
        metadata=None,
    ):
        values = {
            "keep": tuple(keep or ()),
            "verify": verify,
            "disabled": frozenset(disabled or ()),
            "no_opt": no_opt,
            "dynamic": MappingProxyType({name: _frozen(dims) for name, dims in (dynamic or {}).items()}),
            "auto_batch": auto_batch,
            "plan_shapes": _frozen(plan_shapes),
            "input_dtypes": _frozen(input_dtypes),
            "tune": tune,
            "metadata": _frozen(metadata),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes):
        """A copy with the named fields changed (read-only copies of them, as __init__ makes)."""
        return CompileOptions(**{**{f: getattr(self, f) for f in self.__slots__}, **changes})
