"""runtime/record.py: the runtime's data classes (not dataclasses, for import time)."""

import inspect
import sys

import pytest

import pmx.runtime
from pmx.runtime.record import FrozenRecord, Record
from pmx.runtime.session import NodeArg


class _Point(Record):
    __slots__ = ("x", "y")

    def __init__(self, x, y=0):
        self.x, self.y = x, y


def test_record_equality_repr_replace():
    p = _Point(1, 2)
    assert p == _Point(1, 2) and p != _Point(1, 3) and p != (1, 2)
    assert repr(p) == "_Point(x=1, y=2)"
    q = p.replace(y=5)
    assert (q.x, q.y, p.y) == (1, 5, 2), "replace copies; the original keeps its fields"
    with pytest.raises(TypeError, match="no fields"):
        p.replace(z=1)
    with pytest.raises(TypeError):
        hash(p)  # mutable: unhashable, as a dataclass with eq is


def test_node_arg_is_read_only_and_hashable_like_onnxruntimes():
    a = NodeArg("x", (1, None), "tensor(float)")
    assert (a.name, a.shape, a.type) == ("x", (1, None), "tensor(float)")
    assert a == NodeArg("x", (1, None), "tensor(float)") and hash(a) == hash(NodeArg("x", (1, None), "tensor(float)"))
    assert repr(a) == "NodeArg(name='x', shape=(1, None), type='tensor(float)')"
    with pytest.raises(AttributeError, match="read-only"):
        a.name = "y"
    assert isinstance(a, FrozenRecord)


def test_runtime_defines_no_dataclasses():
    """Each @dataclass costs ~0.7 ms of `import pmx.runtime` (it executes generated code)."""
    assert pmx.runtime
    found = [
        f"{name}.{cls.__name__}"
        for name, mod in list(sys.modules.items())
        if name.startswith("pmx.runtime")
        for cls in vars(mod).values()
        if inspect.isclass(cls) and "__dataclass_fields__" in vars(cls)
    ]
    assert not found, found
