"""The dims a compile may leave open, as users write them: `pmx compile`'s --dynamic and
--shape strings, and compile_model's dynamic= and shape= keywords, which take the same
strings or plain Python structures. Everything becomes one form:

    dynamic      {input name: {dim: (min, max)}}   max UNBOUNDED (-1): no upper end;
                                                    (n, n) fixes the dim at n
    plan_shapes  {input name: (size or None, ...)}  the size memory is planned for
                                                    (a range's lower end; None for '?')

Accepted spellings (the CLI's flag takes the strings; the keywords take all of them):

    dynamic="in0:0,2"  or  ["in0:0", "in1:1"]       dims of any size (1 and up)
    dynamic={"in0": [0, 2]}                           the same
    dynamic={"in0": {0: (1, 16), 2: (32, None)}}      ranges; None or -1: no upper end
    shape="in0=1..16x3x224x224"  or  a list of them   per dim N, A..B, A.. or ? ; "in0=": 0-d
    shape={"in0": "1..16x3x224x224"}                  the same
    shape={"in0": (1, 3, 224, 224)}                   fixed sizes (None: '?')

and the dtypes of inputs pnnx wrote none for (a 0-d input of an ONNX model), from
--dtype strings and compile_model's dtype= keyword:

    input_dtypes {input name: numpy dtype name}
    dtype="in0=int32"  or  a list of them             numpy names: float32, int64, bool, ...
    dtype={"in0": "int32"}  or  {"in0": np.int32}     the same
"""

import numpy as np

from pmx.runtime.dim_ranges import UNBOUNDED
from pmx.runtime.dtypes import NAME_TO_ENUM
from pmx.runtime.errors import PmxInputError

DYNAMIC_FORMS = (
    'dynamic="in0:0,2", a list of such strings, {"in0": [0, 2]}, or {"in0": {0: (1, 16)}} (max None: unbounded)'
)
SHAPE_FORMS = (
    'shape="in0=1..16x3x224x224" (per dim N, A..B, A.. or ?; "in0=" for a 0-d input), a list of such '
    'strings, {"in0": "1..16x3x224x224"}, or {"in0": (1, 3, 224, 224)}'
)


def shape_text(shape):
    """[1, ?, 64]: a shape with '?' dims as messages show it ('?' for no shape at all)."""
    return "?" if shape is None else "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def shape_template(shape):
    """--shape's value for a shape with its '?' dims left to fill in: 1x<n>x64."""
    return "x".join("<n>" if d is None else str(d) for d in shape)


def _bad(keyword, value, forms, why=""):
    detail = f" ({why})" if why else ""
    return PmxInputError(f"{keyword}={value!r}{detail}: expected {forms}")


DYNAMIC_TEXT = "NAME:DIM[,DIM...], e.g. in0:0"
DTYPE_FORMS = 'dtype="in0=int32", a list of such strings, or {"in0": "int32"}'
DTYPE_TEXT = f"NAME=DTYPE, e.g. in0=int32 (one of {', '.join(NAME_TO_ENUM)})"
SHAPE_TEXT = "NAME=DIMxDIMx..., each dim N, A..B, A.. or ?, e.g. in0=1..16x3x224x224 (in0= for a 0-d input)"


def parse_dynamic_text(spec, keyword="--dynamic", forms=DYNAMIC_TEXT):
    """'in0:0,2' -> ('in0', {0: (1, UNBOUNDED), 2: (1, UNBOUNDED)})."""
    name, sep, dims = str(spec).partition(":")
    try:
        if not (sep and name):
            raise ValueError
        return name, {int(d): (1, UNBOUNDED) for d in dims.split(",")}
    except ValueError:
        raise _bad(keyword, spec, forms) from None


def parse_shape_text(spec, keyword="--shape", forms=SHAPE_TEXT):
    """'in0=1..16x3x?' -> ('in0', {dim: (min, max)}, plan shape). In the plan shape a
    range gives its lower end and '?' None; 'in0=' is a 0-d input."""
    name, sep, dims = str(spec).partition("=")
    if not sep or not name:
        raise _bad(keyword, spec, forms)
    ranges, plan = {}, []
    for i, d in enumerate(dims.split("x") if dims else ()):
        rng = _dim_range(d)
        if rng is None:
            raise _bad(keyword, spec, forms, f"dim {i} {d!r} is not N, A..B, A.. or ?")
        ranges[i] = rng
        plan.append(None if d == "?" else rng[0])
    return name, ranges, tuple(plan)


def _dim_range(d):
    """(min, max) of one --shape dim: N, A..B, A.. or ?; None when it is none of these."""
    try:
        if d == "?":
            return 1, UNBOUNDED
        if ".." in d:
            lo, hi = d.split("..")
            rng = (int(lo), int(hi) if hi else UNBOUNDED)
            return rng if rng[0] >= 1 and (rng[1] == UNBOUNDED or rng[1] >= rng[0]) else None
        n = int(d)
        return (n, n) if n >= 1 else None
    except ValueError:
        return None


def dynamic_option(value, keyword="dynamic", forms=DYNAMIC_FORMS):
    """compile_model's dynamic= in any DYNAMIC_FORMS spelling -> {name: {dim: (min, max)}}
    (the CLI's --dynamic strings too, whose errors then show `forms`)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        out = {}
        for spec in value:
            name, dims = parse_dynamic_text(spec, keyword, forms)
            out.setdefault(name, {}).update(dims)
        return out
    if not isinstance(value, dict):
        raise _bad(keyword, value, DYNAMIC_FORMS)
    return {name: _dims_of(keyword, value, name, dims) for name, dims in value.items()}


def _dims_of(keyword, value, name, dims):
    """One input's dims of a dynamic= dict: a list of dims, or {dim: (min, max)}."""
    if not isinstance(name, str):
        raise _bad(keyword, value, DYNAMIC_FORMS, f"input name {name!r} is not a string")
    if isinstance(dims, (list, tuple, set)):
        dims = dict.fromkeys(dims, (1, None))
    if not isinstance(dims, dict):
        raise _bad(keyword, value, DYNAMIC_FORMS, f"{name!r}: {dims!r} is neither a list of dims nor a dict")
    out = {}
    for d, rng in dims.items():
        lo, hi = rng if isinstance(rng, (list, tuple)) and len(rng) == 2 else (None, None)
        hi = UNBOUNDED if hi is None else hi
        ok = _is_int(d) and d >= 0 and _is_int(lo) and lo >= 1 and _is_int(hi) and (hi == UNBOUNDED or hi >= lo)
        if not ok:
            raise _bad(keyword, value, DYNAMIC_FORMS, f"{name!r}: dim {d!r} -> {rng!r}")
        out[d] = (lo, hi)
    return out


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def shape_option(value, keyword="shape", forms=SHAPE_FORMS):
    """compile_model's shape= in any SHAPE_FORMS spelling -> (dynamic, plan_shapes) (the
    CLI's --shape strings too, whose errors then show `forms`)."""
    if value is None:
        return {}, {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        value = [_shape_text(keyword, value, name, dims) for name, dims in value.items()]
    if not isinstance(value, (list, tuple)):
        raise _bad(keyword, value, SHAPE_FORMS)
    dynamic, plan_shapes = {}, {}
    for spec in value:
        name, ranges, plan = parse_shape_text(spec, keyword, forms)
        dynamic.setdefault(name, {}).update(ranges)
        plan_shapes[name] = plan
    return dynamic, plan_shapes


def _shape_text(keyword, value, name, dims):
    """One entry of a shape= dict as its --shape string."""
    if isinstance(dims, str):
        return f"{name}={dims}"
    if isinstance(dims, (list, tuple)) and all(d is None or (_is_int(d) and d >= 1) for d in dims):
        return f"{name}=" + "x".join("?" if d is None else str(d) for d in dims)
    raise _bad(keyword, value, SHAPE_FORMS, f"{name!r}: {dims!r}")


def merge_dynamic(*parts):
    """Several {name: {dim: (min, max)}} into one (later parts win per dim)."""
    out = {}
    for part in parts:
        for name, dims in part.items():
            out.setdefault(name, {}).update(dims)
    return out


def dtype_option(value, keyword="dtype", forms=DTYPE_FORMS):
    """compile_model's dtype= in any DTYPE_FORMS spelling -> {name: numpy dtype name} (the
    CLI's --dtype strings too, whose errors then show `forms`)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        pairs = [str(spec).partition("=")[::2] for spec in value]
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        raise _bad(keyword, value, forms)
    out = {}
    for name, dtype in pairs:
        try:
            name_of = np.dtype(dtype).name
        except TypeError:
            name_of = None
        if not (isinstance(name, str) and name) or name_of not in NAME_TO_ENUM:
            raise PmxInputError(
                f"{keyword} {name}={dtype}: {dtype!r} is not one of {', '.join(NAME_TO_ENUM)}; expected {forms}"
            )
        out[name] = name_of
    return out
