"""Derive schema/layout.py from the code flatc generates (schema/pmx_generated.py).

The runtime reads .pmx headers with a reader of its own (runtime/load.py), which needs
each field's vtable slot, number type and default, and the enum values. Importing the
generated module (and the flatbuffers package under it) for that cost the runtime's import
5 ms, so tools/regen_schema.py writes them once into schema/layout.py, a module of plain
literals, by running each generated accessor against a probe that notes what it asks for.
tests/test_packaging.py checks that the committed layout.py is what this derives, so the
generated code stays the one place that decides the layout.
"""

import inspect
from types import SimpleNamespace

ENUMS = ("DType", "TensorKind", "AttrKind")


class _Probe:
    """Stands in for flatbuffers' Table (hence the method names) while one generated
    accessor runs, noting the vtable slot it asks for and the number type it reads."""

    Pos = 0
    Bytes = b""

    def __init__(self, present):
        self.present, self.slot, self.flags, self.scalar = present, None, None, False

    def Offset(self, slot):
        self.slot = slot
        return 4 if self.present else 0

    def Get(self, flags, off):
        self.flags, self.scalar = flags, True
        return 0

    def GetVectorAsNumpy(self, flags, off):
        self.flags = flags
        return 0

    def VectorLen(self, off):
        return 0

    def Indirect(self, off):  # a table field
        return 0

    def String(self, off):
        return None


def field_layout(accessor):
    """(vtable slot, struct code of the scalar or vector element or None, default when
    absent, stored in the table itself) of the field a generated accessor reads."""
    absent, present = _Probe(False), _Probe(True)
    default = accessor(SimpleNamespace(_tab=absent))
    accessor(SimpleNamespace(_tab=present))
    code = present.flags.packer_type.format[-1] if present.flags else None
    return absent.slot, code, default, present.scalar


def _is_field_accessor(name, member):
    return (
        inspect.isfunction(member)
        and name != "Init"
        and not name.startswith("GetRootAs")
        and list(inspect.signature(member).parameters) == ["self"]
    )


def derive(generated):
    """{"TABLES": {table: {accessor: layout}}, enum name: {member: value}} of a generated module."""
    tables = {}
    for name, cls in vars(generated).items():
        if isinstance(cls, type) and getattr(cls, "__slots__", None) == ["_tab"]:
            tables[name] = {a: field_layout(m) for a, m in vars(cls).items() if _is_field_accessor(a, m)}
    enums = {e: {k: v for k, v in vars(getattr(generated, e)).items() if isinstance(v, int)} for e in ENUMS}
    return {"TABLES": tables, **enums}


def _literal(layout):
    return repr(layout).replace("'", '"')  # the quotes ruff format writes


def render(generated) -> str:
    """The source of schema/layout.py."""
    derived = derive(generated)
    lines = [
        '"""Field layouts and enum values of schema/pmx.fbs, for the runtime\'s reader.',
        "",
        "Written by tools/regen_schema.py from schema/pmx_generated.py (schema/derive_layout.py);",
        'do not edit. A table field is (vtable slot, struct code, default, stored inline)."""',
    ]
    for enum in ENUMS:
        lines.append(f"\n\nclass {enum}:")
        lines += [f"    {k} = {v}" for k, v in derived[enum].items()]
    lines.append("\n\nTABLES = {")
    for table, fields in derived["TABLES"].items():
        lines.append(f'    "{table}": {{')
        lines += [f'        "{a}": {_literal(layout)},' for a, layout in fields.items()]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"
