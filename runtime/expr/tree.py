"""The expression grammar and the trees it parses to; everything else in the package reads
these trees.

Grammar (the prefix form pnnx writes in `pnnx.Expression expr=`, which pmx also stores):

    expr    := call | input | literal
    call    := NAME "(" expr ("," expr)* ")"
    input   := "@" DIGITS                      -- the node's i-th input
    literal := number | "inf" | "-inf" | "nan" | "True" | "False"

Only the functions in FUNCTIONS are accepted; strings are parsed here and never passed
to eval.

Trees are nested tuples: ("@", i) for inputs, ("#", value) for literals, and
(name, arg, ...) for calls, so equal subtrees compare equal (used for CSE) and a tree is
immutable and hashable: the compiler's nodes and the loaded model's nodes hold trees
(built with at() and call()), and text exists only in files (parse, to_text). Exact
wraps a tree as a memo key where a literal's type matters.
"""

import math
import re

import numpy as np

from pmx.runtime.errors import PmxFormatError
from pmx.runtime.expr.functions import FUNCTIONS

MAX_EXPR_LENGTH = 1 << 16
MAX_DEPTH = 200

# a number, or a complex one as pnnx writes it: "%e+%ej", the "+" kept before a negative part
_TOKEN = re.compile(
    r"\s*(?:(@\d+)|([A-Za-z_][A-Za-z_0-9]*)"
    r"|([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?:\+?[-+](?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?j)?)"
    r"|(-inf)|(\()|(\))|(,))"
)


def at(i):
    """The tree of the node's i-th input, @i."""
    return ("@", i)


def call(name, *args):
    """The tree name(args...): each arg a tree, or a Python number or bool (a literal)."""
    if FUNCTIONS.get(name) != len(args):
        raise ValueError(f"{name} takes {FUNCTIONS.get(name)} arguments, got {len(args)}")
    return (name, *(a if isinstance(a, tuple) else ("#", a) for a in args))


def parse(text: str, num_inputs: int | None = None):
    """Parse an expression string into a tree. Raises PmxFormatError on anything else.
    Only the file boundaries call it: the pnnx frontend, and the loader, once per
    distinct expression of a file; everything between holds trees."""
    if not isinstance(text, str) or not text or len(text) > MAX_EXPR_LENGTH:
        raise PmxFormatError(f"expression must be a non-empty string under {MAX_EXPR_LENGTH} chars")
    tokens = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise PmxFormatError(f"expression {text[:80]!r}: unexpected character at {pos}: {text[pos : pos + 10]!r}")
        tokens.append(m)
        pos = m.end()
    tree, i = _parse_at(tokens, 0, text, 0)
    if i != len(tokens):
        raise PmxFormatError(f"expression {text[:80]!r}: trailing text after a complete expression")
    if num_inputs is not None:
        for idx in sorted(inputs_used(tree)):
            if idx >= num_inputs:
                raise PmxFormatError(f"expression {text[:80]!r} uses @{idx} but the node has {num_inputs} inputs")
    return tree


def _parse_at(tokens, i, text, depth):
    if depth > MAX_DEPTH:
        raise PmxFormatError(f"expression {text[:80]!r} nests deeper than {MAX_DEPTH}")
    if i >= len(tokens):
        raise PmxFormatError(f"expression {text[:80]!r} ends early")
    inp, name, num, neginf = tokens[i].group(1), tokens[i].group(2), tokens[i].group(3), tokens[i].group(4)
    if inp:
        return ("@", int(inp[1:])), i + 1
    if num:
        if num.endswith("j"):
            return ("#", complex(num.replace("+-", "-"))), i + 1
        value = float(num) if any(c in num for c in ".eE") else int(num)
        return ("#", value), i + 1
    if neginf:
        return ("#", -math.inf), i + 1
    if name in ("inf", "nan"):
        return ("#", float(name)), i + 1
    if name in ("True", "False"):
        return ("#", name == "True"), i + 1
    if name is None:
        raise PmxFormatError(f"expression {text[:80]!r}: expected a value at token {i}")
    if name not in FUNCTIONS:
        raise PmxFormatError(f"expression {text[:80]!r}: unknown function {name!r}")
    if i + 1 >= len(tokens) or tokens[i + 1].group(5) is None:
        raise PmxFormatError(f"expression {text[:80]!r}: {name} must be followed by '('")
    i += 2
    args = []
    while True:
        arg, i = _parse_at(tokens, i, text, depth + 1)
        args.append(arg)
        if i < len(tokens) and tokens[i].group(7):
            i += 1
            continue
        if i < len(tokens) and tokens[i].group(6):
            i += 1
            break
        raise PmxFormatError(f"expression {text[:80]!r}: expected ',' or ')' after argument of {name}")
    if len(args) != FUNCTIONS[name]:
        raise PmxFormatError(f"expression {text[:80]!r}: {name} takes {FUNCTIONS[name]} arguments, got {len(args)}")
    return (name, *args), i


def to_text(tree) -> str:
    """Inverse of parse()."""
    kind = tree[0]
    if kind == "@":
        return f"@{tree[1]}"
    if kind == "#":
        v = tree[1]
        if isinstance(v, bool):
            return "True" if v else "False"
        if isinstance(v, float):
            if math.isnan(v):
                return "nan"
            if math.isinf(v):
                return "inf" if v > 0 else "-inf"
            return repr(float(np.float32(v))) if float(np.float32(v)) == v else repr(v)
        if isinstance(v, complex):
            return f"{v.real!r}{'+' if v.imag >= 0 else ''}{v.imag!r}j"
        return str(v)
    return kind + "(" + ",".join(to_text(a) for a in tree[1:]) + ")"


# Activations a conv/linear/matmul epilogue commonly holds, by the tree fuse_activation
# leaves (x = the GEMM's output, @0), for people reading profiles and `pmx inspect`.
_NAMED_EPILOGUES = {
    "maximum(@0,0)": "relu",
    "minimum(maximum(@0,0),6)": "relu6",
    "sigmoid(@0)": "sigmoid",
    "tanh(@0)": "tanh",
    "mul(@0,sigmoid(@0))": "silu",
    "mul(@0,div(minimum(maximum(add(@0,3),0),6),6))": "hardswish",
    "div(minimum(maximum(add(@0,3),0),6),6)": "hardsigmoid",
}


def describe_node_expr(op, tree) -> str:
    """What a node's expression does, for people: an elementwise node's whole
    expression; on other ops the fused epilogue after the kernel, by name where it is a
    common activation (relu, relu6, hardswish, ...), else as an expression of @0."""
    if tree is None:
        return ""
    text = to_text(tree)
    if op == "elementwise":
        return text
    return "+" + _NAMED_EPILOGUES.get(text, text)


def inputs_used(tree) -> set:
    if tree[0] == "@":
        return {tree[1]}
    if tree[0] == "#":
        return set()
    out = set()
    for a in tree[1:]:
        out |= inputs_used(a)
    return out


def substitute(tree, mapping):
    """Replace ("@", i) leaves by mapping[i] (trees). Used when fusing expressions."""
    if tree[0] == "@":
        return mapping[tree[1]]
    if tree[0] == "#":
        return tree
    return (tree[0], *(substitute(a, mapping) for a in tree[1:]))


def size(tree) -> int:
    if tree[0] in ("@", "#"):
        return 1
    return 1 + sum(size(a) for a in tree[1:])


class Exact:
    """A tree as a memo key that tells its literals apart: trees are tuples, and Python
    has 1 == 1.0 == True and 0.0 == -0.0, so add(@0,1) and add(@0,1.0) (an integer and a
    float result for an integer input) or where(c,0.0,@0) and where(c,-0.0,@0) compare
    equal and would share a memoized dtype, plan or desugared tree. repr keeps each
    literal's type and sign."""

    __slots__ = ("tree", "text", "_hash")

    def __init__(self, tree):
        self.tree, self.text = tree, repr(tree)
        self._hash = hash(self.text)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, Exact) and self.text == other.text
