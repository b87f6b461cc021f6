"""Record: the base of the runtime's small data classes.

Each subclass names its fields in __slots__ and writes its own __init__; Record adds ==,
repr and replace() over those fields, FrozenRecord also refuses assignment and hashes.
Not dataclasses: @dataclass executes the code it generates, a cost per class, and the
runtime's seven took a large share of what `import pmx.runtime` cost after numpy
(docs/performance.md, "Kernel measurements").
"""


class Record:
    __slots__ = ()

    def _values(self):
        return tuple(getattr(self, f) for f in self.__slots__)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # fields may change

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f)!r}' for f in self.__slots__)})"

    def replace(self, **changes):
        """A copy with the named fields changed."""
        unknown = set(changes) - set(self.__slots__)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(unknown)}")
        new = object.__new__(type(self))
        for f in self.__slots__:
            object.__setattr__(new, f, changes.get(f, getattr(self, f)))
        return new


class FrozenRecord(Record):
    """A Record whose fields are set once, in __init__ (with object.__setattr__)."""

    __slots__ = ()

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __hash__(self):
        return hash(self._values())


def set_fields(record, fields):
    """Set every field of `record` from `fields`, which must name exactly its fields (for
    records made by keyword only)."""
    if set(fields) != set(record.__slots__):
        raise TypeError(f"{type(record).__name__} takes exactly the fields {record.__slots__}")
    for name in record.__slots__:
        object.__setattr__(record, name, fields[name])
