"""Attribute specs (runtime/kernels/attr_specs.py): a file whose node carries a missing,
mistyped, out-of-range or unknown attribute is a PmxFormatError naming the node (index,
op, name) and the attribute, raised by the loader before any shape rule or kernel reads
it, never an internal error. The files here are forged the way a hostile writer would:
a compiled graph's attributes edited, then written with valid checksums."""

import collections
import pathlib
import re

import numpy as np
import pytest
from attr_reads import record_reads

from pmx.compiler import pnnx
from pmx.compiler.driver import compile_graph
from pmx.compiler.options import CompileOptions
from pmx.compiler.write import write
from pmx.runtime import InferenceSession, PmxFormatError
from pmx.runtime.kernels import attr_specs
from pmx.runtime.kernels.registry import REGISTRY, Kernel, all_kernels, get

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"


@pytest.fixture(scope="module")
def graph():
    """The example CNN compiled (convs, a depthwise conv, pools, a reshape, linear and a
    softmax over a rank-2 input): the compiler's graph, its Plan and the options, ready
    to write."""
    g = pnnx.load(str(EXAMPLE) + ".pnnx.param", str(EXAMPLE) + ".pnnx.bin")
    options = CompileOptions()
    return g, compile_graph(g, options), options


def _forged(compiled, tmp_path, op, edit):
    """The graph written with edit(attrs) applied to the first `op` node's attributes
    (restored afterwards); returns (path, that node's index, its name)."""
    graph, plan, options = compiled
    j, node = next((j, n) for j, n in enumerate(graph.nodes) if n.op == op)
    saved = dict(node.attrs)
    edit(node.attrs)
    try:
        path = tmp_path / f"{op}.pmx"
        write(graph, plan, options, str(path), check_loads=False)  # a forged file
    finally:
        node.attrs.clear()
        node.attrs.update(saved)
    return path, j, node.name


def _without(name):
    return lambda attrs: attrs.pop(name)


def _setting(name, value):
    return lambda attrs: attrs.__setitem__(name, value)


# (op, edit, what the message says after "attribute '<name>' ")
CASES = [
    ("softmax", _without("axis"), "axis", r"is missing; expected an axis of a rank-2 input: an int in \[-2, 1\]"),
    ("softmax", _setting("axis", 2), "axis", r"is 2; expected an axis of a rank-2 input"),
    ("softmax", _setting("axis", -3), "axis", r"is -3; expected an axis of a rank-2 input"),
    ("softmax", _setting("axis", 1.0), "axis", r"is 1.0; expected an axis"),
    ("softmax", _setting("axis", True), "axis", r"is True; expected an axis"),
    ("conv", _setting("stride", (2,)), "stride", r"is \(2,\); expected a tuple of 2 ints each >= 1"),
    ("conv", _setting("stride", ("2", "2")), "stride", r"is \('2', '2'\); expected a tuple of 2 ints"),
    ("conv", _setting("stride", 2), "stride", r"is 2; expected a tuple of 2 ints"),
    ("conv", _setting("dilation", (1, 0)), "dilation", r"is \(1, 0\); expected a tuple of 2 ints each >= 1"),
    ("conv", _setting("pads", (1, 1, 1)), "pads", r"is \(1, 1, 1\); expected a tuple of 4 ints each >= 0"),
    ("conv", _setting("pads", (1, -1, 1, 1)), "pads", r"is \(1, -1, 1, 1\); expected a tuple of 4 ints each >= 0"),
    ("conv", _without("pads"), "pads", r"is missing; expected a tuple of 4 ints"),
    ("conv", _setting("groups", 0), "groups", r"is 0; expected an int >= 1"),
    ("conv", _setting("padding_mode", "mirror"), "padding_mode", r"is 'mirror'; expected one of 'zeros', 'reflect'"),
    ("conv", _setting("kernel_size", (3, 3)), "kernel_size", r"is not an attribute this op takes \(stride, pads"),
    (
        "adaptive_avg_pool",
        _setting("output_size", (1, 1, 1, 1, 1)),
        "output_size",
        r"is \(1, 1, 1, 1, 1\); expected a tuple of 1 to 4 ints each >= 0",
    ),
    ("reshape", _setting("shape", (1, -5)), "shape", r"is \(1, -5\); expected a tuple of ints each >= -1"),
    ("linear", _setting("axis", 1), "axis", r"is not an attribute this op takes \(it takes none\)"),
]


@pytest.mark.parametrize("op, edit, name, message", CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_a_bad_attribute_is_a_format_error_naming_node_and_attribute(graph, tmp_path, op, edit, name, message):
    path, j, node_name = _forged(graph, tmp_path, op, edit)
    where = re.escape(f"{path}: node {j} ({op} '{node_name}'): attribute '{name}' ")
    with pytest.raises(PmxFormatError, match=f"^{where}{message}"):
        InferenceSession(str(path))


def test_attributes_are_checked_before_any_shape_rule_or_kernel(graph, tmp_path, monkeypatch):
    """The softmax without an axis had reached its factory (KeyError at bind: "internal
    error"); now nothing of its kernel runs."""
    path, _, _ = _forged(graph, tmp_path, "softmax", _without("axis"))
    called = []
    softmax = get("softmax")
    monkeypatch.setitem(
        REGISTRY,
        "softmax",
        softmax.replace(
            infer=lambda *a: called.append("infer") or softmax.infer(*a),
            make=lambda *a: called.append("make") or softmax.make(*a),
        ),
    )
    with pytest.raises(PmxFormatError, match="attribute 'axis' is missing"):
        InferenceSession(str(path))
    assert called == []


def test_the_forged_files_differ_only_in_the_attribute(graph, tmp_path):
    """The unedited graph writes a file that loads and runs (so each case above fails on
    its edit alone)."""
    path, _, _ = _forged(graph, tmp_path, "softmax", lambda attrs: None)
    sess = InferenceSession(str(path))
    x = np.load(str(EXAMPLE) + "_input.npy")
    (y,) = sess.run(None, {sess.get_inputs()[0].name: x})
    np.testing.assert_allclose(y, np.load(str(EXAMPLE) + "_expected.npy"), rtol=1e-4, atol=1e-5)


# --- the specs themselves -------------------------------------------------------------


def test_every_op_declares_its_attributes_as_specs():
    for op, k in all_kernels().items():
        for name, spec in k.attrs.items():
            assert isinstance(spec, attr_specs.Spec) and callable(spec.check), (op, name)


def test_problem_reports_the_first_failing_attribute():
    specs = attr_specs.as_specs(
        dict(
            kernel=attr_specs.ints(min_length=1, lo=1),
            stride=attr_specs.ints(attr_specs.length_of("kernel"), lo=1),
            ceil_mode=attr_specs.optional(attr_specs.FLAG),
        )
    )
    assert attr_specs.problem(specs, {"kernel": (3, 3), "stride": (1, 1)}, (4,)) is None
    assert attr_specs.problem(specs, {"kernel": (3, 3), "stride": (1, 1), "ceil_mode": 1}, (4,)) is None
    assert attr_specs.problem(specs, {"kernel": (3, 3), "stride": (1,)}, (4,)) == (
        "stride",
        "is (1,); expected a tuple of 2 ints each >= 1",
    )
    assert attr_specs.problem(specs, {"kernel": (3, 3), "stride": (1, 1), "ceil_mode": 2}, (4,)) == (
        "ceil_mode",
        "is 2; expected a bool (or 0 or 1)",
    )
    assert attr_specs.problem(specs, {"stride": (1, 1)}, (4,))[0] == "kernel"
    long_value = tuple(range(100))
    _, message = attr_specs.problem(specs, {"kernel": long_value}, (4,))
    assert len(message) < 200 and message.startswith("is (0, 1, 2")


def test_axes_are_distinct_and_in_range():
    axes = attr_specs.AXES
    assert axes((0, -1), {}, (3,)) is None and axes((), {}, (0,)) is None
    for bad in ((0, 3), (-4,), (1, -2), (0.0,), 0):
        assert axes(bad, {}, (3,)) is not None, bad
    assert attr_specs.AXIS(0, {}, (None,)) == "an axis, but the input it indexes is absent"


# --- the recorder conftest.py runs the suite under --------------------------------------


def test_the_recorder_notes_reads_of_undeclared_attributes():
    """record_reads (tests/attr_reads.py) sees reads with [], get and `in`, from the shape
    rule, the factory and the callable it returns, and only of undeclared names."""

    def infer(node, shapes, dtypes):
        return [(shapes[0], dtypes[0])] if node.attrs["axis"] == 0 and "keep" not in node.attrs else []

    def make(node, inputs, outputs, ctx):
        attrs = node.attrs
        return lambda: attrs.get("late", 1)

    registry = {"toy": Kernel("toy", make, infer, attrs=dict(axis=attr_specs.AXIS))}
    node = collections.namedtuple("Node", "op name attrs expr variant")("toy", "n", {"axis": 0}, "", "")
    with record_reads(registry) as undeclared:
        registry["toy"].infer(node, [(2,)], [np.float32])
        registry["toy"].make(node, [], [], None)()
    assert undeclared == {("toy", "keep"): 1, ("toy", "late"): 1}
    assert registry["toy"].infer is infer and registry["toy"].make is make  # restored
