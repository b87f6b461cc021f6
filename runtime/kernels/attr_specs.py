"""What each op's attributes must be, declared where its kernel registers
(`register("softmax", ..., attrs=dict(axis=AXIS))`) and checked by the loader on every
node of a file before a shape rule or kernel reads them, so a missing, mistyped or
out-of-range attribute is a PmxFormatError naming the node and the attribute instead of
a KeyError or IndexError inside a kernel.

A spec is a function `check(value, attrs, ranks) -> None | str`: None when `value` is
acceptable, else what was expected (for the message). `attrs` are the node's attributes
(a spec may depend on another, declared before it: a pool's stride has as many entries
as its kernel) and `ranks` the rank of each input, None where the input is absent.
Values are what the loader reads from a file: int, float, bool, str, None, or a tuple
of one of these (an empty list reads as ()); a tuple holds one type throughout (it is
read from one typed vector), so specs look at its first entry's. Specs bound what the
attributes and input ranks decide; relations with input sizes (groups dividing the
channels) stay with the shape rules, which run right after. They run once per distinct
attribute set and input ranks of a file, so they are written to be cheap.

Every attribute a kernel reads (in its shape rule, scratch rule or factory) is declared:
tests/conftest.py records the reads of the whole test suite and fails on one its op does
not declare. An attribute the op does not declare is refused: the session reads some for
every node (sized_at_run), and a file carrying one was damaged, forged, or written by a
newer pmx whose meaning this runtime would miss (which the format version guards:
runtime/fileformat.py). Attributes the compiler writes for itself are declared UNREAD.
"""

from pmx.runtime.dtypes import NAME_TO_ENUM
from pmx.runtime.record import Record

MISSING = object()  # what a check sees for an absent required attribute


class Spec(Record):
    """One attribute: its check, and whether a file must carry it (kernels read an
    optional one with .get and a default)."""

    __slots__ = ("check", "required")

    def __init__(self, check, required=True):
        self.check, self.required = check, required


def optional(check):
    return Spec(check, required=False)


def as_specs(attrs):
    """{name: Spec} from a registration's attrs (a bare check is a required attribute)."""
    return {name: s if isinstance(s, Spec) else Spec(s) for name, s in (attrs or {}).items()}


def problem(specs, attrs, ranks):
    """(attribute name, message) for the first attribute of `attrs` that breaks `specs`,
    or None when all pass."""
    if not specs.keys() >= attrs.keys():
        name = next(name for name in attrs if name not in specs)
        return name, f"is not an attribute this op takes ({', '.join(specs) or 'it takes none'})"
    for name, spec in specs.items():
        value = attrs.get(name, MISSING)
        if value is MISSING and not spec.required:
            continue
        expected = spec.check(value, attrs, ranks)
        if expected is not None:
            found = "is missing" if value is MISSING else f"is {_short(value)}"
            return name, f"{found}; expected {expected}"
    return None


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- ranks ------------------------------------------------------------------------------


def input_rank(i):
    """The rank of input i (None when absent)."""
    return lambda attrs, ranks: ranks[i] if i < len(ranks) else None


FIRST_INPUT_RANK = input_rank(0)


def ranks_from(i):
    """The ranks of inputs i.. added up (None when one is absent): the dims of operands
    read for their shapes only, counted one input after another (reshape's like inputs)."""

    def rank(attrs, ranks):
        rest = ranks[i:]
        return None if None in rest else sum(rest)

    return rank


def widest_input(attrs, ranks):
    """The highest rank among the inputs (concat's and cross's operands)."""
    return max((r for r in ranks if r is not None), default=None)


def at_least_1d(attrs, ranks):
    """Input 0's rank, a 0-d input counting as 1-d (cumsum and topk take dim 0 or -1)."""
    return None if not ranks or ranks[0] is None else max(ranks[0], 1)


def weight_spatial(attrs, ranks):
    """Spatial dims of a convolution: its weight's (input 1) rank less 2."""
    return None if len(ranks) < 2 or ranks[1] is None or ranks[1] < 3 else ranks[1] - 2


def length_of(name, times=1):
    """Entries of attribute `name` (a tuple checked before), `times` over."""
    return lambda attrs, ranks: len(attrs[name]) * times


def _resolve(n, attrs, ranks):
    return n(attrs, ranks) if callable(n) else n


# --- scalars ----------------------------------------------------------------------------


def _bounds(lo, hi):
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    return f" >= {lo}" if lo is not None else (f" <= {hi}" if hi is not None else "")


def _within(v, lo, hi):
    return (lo is None or v >= lo) and (hi is None or v <= hi)


def integer(lo=None, hi=None):
    """An int (not a bool) in [lo, hi] (each a number, a function as in ints(), or None)."""

    def check(v, attrs, ranks):
        low, high = _resolve(lo, attrs, ranks), _resolve(hi, attrs, ranks)
        if (low is None and lo is not None) or (high is None and hi is not None):
            return "an int, but the input it depends on is absent"
        if type(v) is not int or not _within(v, low, high):
            return f"an int{_bounds(low, high)}"

    return check


def number(lo=None, nonzero=False, none=False):
    """An int or float (not a bool); `none`: or None."""

    def check(v, attrs, ranks):
        if none and v is None:
            return None
        if type(v) not in (int, float) or (lo is not None and not v >= lo) or (nonzero and v == 0):
            return f"a number{_bounds(lo, None)}{' other than 0' if nonzero else ''}{' or None' if none else ''}"

    return check


def _flag(v, attrs, ranks):
    if not (type(v) is bool or (type(v) is int and v in (0, 1))):
        return "a bool (or 0 or 1)"


def _true(v, attrs, ranks):
    if v is not True:
        return "True (the op sizes its output when it runs)"


def one_of(*choices):
    def check(v, attrs, ranks):
        if type(v) is not str or v not in choices:
            return "one of " + ", ".join(map(repr, choices))

    return check


def _string(v, attrs, ranks):
    if type(v) is not str:
        return "a string"


def _unread(v, attrs, ranks):
    """Stored by the compiler for itself; no kernel reads it."""


INT = integer()
NON_NEGATIVE = integer(0)
POSITIVE = integer(1)
NUMBER = number()
FLAG = _flag
TRUE = _true
STRING = _string
UNREAD = optional(_unread)
DTYPE = one_of(*NAME_TO_ENUM)


def axis(rank=FIRST_INPUT_RANK):
    """An int in [-rank, rank): an axis of the input whose rank `rank` gives."""

    def check(v, attrs, ranks):
        r = rank(attrs, ranks)
        if r is None:
            return "an axis, but the input it indexes is absent"
        if type(v) is not int or not -r <= v < r:
            return f"an axis of a rank-{r} input: an int in [{-r}, {r - 1}]"

    return check


AXIS = axis()


# --- tuples -----------------------------------------------------------------------------


def _bounds_of(given):
    """A function (attrs, ranks) -> the values of `given` (numbers, None, or functions of
    (attrs, ranks) such as length_of("kernel") or input_rank(0)), or None when one of the
    functions finds the input it reads absent."""
    dynamic = [(k, b) for k, b in enumerate(given) if callable(b)]
    if not dynamic:
        return lambda attrs, ranks: given

    def resolve(attrs, ranks):
        values = list(given)
        for k, b in dynamic:
            values[k] = b(attrs, ranks)
            if values[k] is None:
                return None
        return values

    return resolve


def ints(length=None, lo=None, hi=None, min_length=0, max_length=None):
    """A tuple of ints, each in [lo, hi], of `length` entries or between `min_length` and
    `max_length` (each a number, or a function as in _bounds_of)."""
    bounds = _bounds_of((length, min_length, max_length, lo, hi))

    def check(v, attrs, ranks):
        values = bounds(attrs, ranks)
        if values is None:
            return "a tuple of ints, but an input it depends on is absent or too small"
        n, least, most, low, high = values
        if (
            type(v) is not tuple
            or (n is not None and len(v) != n)
            or len(v) < least
            or (most is not None and len(v) > most)
            or (
                v
                and (
                    type(v[0]) is not int or (low is not None and min(v) < low) or (high is not None and max(v) > high)
                )
            )
        ):
            size = (
                f"{n} "
                if n is not None
                else (f"{least} to {most} " if most is not None else f"at least {least} " if least else "")
            )
            return f"a tuple of {size}ints{_bounds(low, high).replace(' ', ' each ', 1)}"

    return check


def target_shape(copies_dims_of=None, min_length=0):
    """A target shape: each entry a size >= 0, -1 (inferred from the element count, or
    the input's own size), or -2-k: dim k of input `copies_dims_of` (an index, or a rank
    rule such as ranks_from(1): of the dims it counts) (the compiler writes these so the
    shape follows dims that change at run time)."""
    rank_of = input_rank(copies_dims_of) if isinstance(copies_dims_of, int) else copies_dims_of

    def lowest(attrs, ranks):
        rank = None if rank_of is None else rank_of(attrs, ranks)
        return -1 - (rank or 0)

    return ints(lo=lowest, min_length=min_length)


def or_empty(check):
    """() (the kernel's default for every entry), or what `check` accepts."""
    return lambda v, attrs, ranks: None if v == () else check(v, attrs, ranks)


def defaulting(default, check):
    """`check` that sees an absent attribute as `default` (the kernel's .get default):
    for a spec whose acceptance depends on the inputs, so absence is not always fine
    (attention's masks: one per mask input)."""
    return lambda v, attrs, ranks: check(default if v is MISSING else v, attrs, ranks)


def numbers(length=None, lo=None):
    """A tuple of ints or floats, each >= lo, of `length` entries (as ints())."""
    bounds = _bounds_of((length,))

    def check(v, attrs, ranks):
        values = bounds(attrs, ranks)
        n = None if values is None else values[0]
        if (
            values is None
            or type(v) is not tuple
            or (n is not None and len(v) != n)
            or (v and (type(v[0]) not in (int, float) or (lo is not None and not min(v) >= lo)))
        ):
            return f"a tuple of {f'{n} ' if n is not None else ''}numbers{_bounds(lo, None).replace(' ', ' each ', 1)}"

    return check


def words(*choices, length=None):
    """A tuple of strings, each one of `choices`, of `length` entries (as ints())."""
    bounds, allowed = _bounds_of((length,)), frozenset(choices)

    def check(v, attrs, ranks):
        values = bounds(attrs, ranks)
        if values is None:
            return "a tuple of strings, but the inputs that set its length are missing"
        n = values[0]
        if (
            type(v) is not tuple
            or (n is not None and len(v) != n)
            or (v and (type(v[0]) is not str or not allowed.issuperset(v)))
        ):
            return f"a tuple of {f'{n} ' if n is not None else ''}strings, each one of {', '.join(map(repr, choices))}"

    return check


def distinct_axes(rank=FIRST_INPUT_RANK, length=None, min_length=0):
    """A tuple of distinct axes of the input whose rank `rank` gives (-1 and rank - 1 are
    one axis), of `length` entries or at least `min_length`."""
    bounds = _bounds_of((rank, length))

    def check(v, attrs, ranks):
        values = bounds(attrs, ranks)
        if values is None:
            return "axes, but the input they index is absent"
        r, n = values
        if (
            type(v) is not tuple
            or (n is not None and len(v) != n)
            or len(v) < min_length
            or (v and (type(v[0]) is not int or min(v) < -r or max(v) >= r or len({e % r for e in v}) != len(v)))
        ):
            size = f"{n} " if n is not None else (f"at least {min_length} " if min_length else "")
            return f"a tuple of {size}distinct axes of a rank-{r} input, each in [{-r}, {r - 1}]"

    return check


AXES = distinct_axes()


def permutation(rank=FIRST_INPUT_RANK):
    def check(v, attrs, ranks):
        r = rank(attrs, ranks)
        if r is None or type(v) is not tuple or (v and type(v[0]) is not int) or sorted(v) != list(range(r)):
            return f"a permutation of 0..{r - 1 if r is not None else '?'}"

    return check


def twice(length):
    """Two entries for each one `length` (a number or function, as in ints()) counts:
    pads, begins then ends."""

    def n(attrs, ranks):
        one = _resolve(length, attrs, ranks)
        return None if one is None else 2 * one

    return n
