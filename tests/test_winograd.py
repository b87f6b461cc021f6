"""Winograd F(2x2, 3x3): the conv_winograd kernel against torch, the compiler's rule and
prepack_weights, --tune's candidates, and the shape rule's errors."""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import bind_context, compare_with_torch, kernel_pool, rel_error, run_kernel
from hypothesis import given
from hypothesis import strategies as st
from test_e2e_cnn_blocks import _rand
from test_kernels_cnn import FAST, assert_close, signed_input

from pmx.compiler.driver import compile_model
from pmx.compiler.passes.tune import candidates
from pmx.runtime import InferenceSession
from pmx.runtime.kernels import winograd
from pmx.runtime.kernels.winograd import transform_weights

ACTIVATIONS = {"": lambda y: y, "maximum(@0,0)": F.relu, "mul(@0,sigmoid(@0))": F.silu}


@pytest.fixture
def two_threads():
    return kernel_pool(2)


@contextlib.contextmanager
def split_everything():
    """Every conv_winograd splits over the threads it is given, however small (the
    property test's shapes are far below SPLIT_MIN_MACS). A context manager, not a
    fixture: hypothesis runs many examples per function-scoped fixture."""
    min_macs = winograd.SPLIT_MIN_MACS
    winograd.SPLIT_MIN_MACS = 0
    try:
        yield
    finally:
        winograd.SPLIT_MIN_MACS = min_macs


def torch_reference(x, w, b, pads, act):
    pt, pl, pb, pr = pads
    y = F.conv2d(
        F.pad(torch.from_numpy(x), (pl, pr, pt, pb)), torch.from_numpy(w), None if b is None else torch.from_numpy(b)
    )
    return ACTIVATIONS[act](y), y


def run_winograd(x, w, b, pads, act, variant, threads=None):
    inputs = [x, transform_weights(w)] + ([b] if b is not None else [])
    (got,) = run_kernel("conv_winograd", inputs, {"pads": pads}, expr=act, variant=variant, threads=threads)
    return got


@st.composite
def winograd_case(draw):
    pads = tuple(draw(st.integers(0, 3)) for _ in range(4))
    # odd and even output sizes (a last tile half outside the output), down to one output
    h = draw(st.integers(max(1, 3 - pads[0] - pads[2]), 11))
    w = draw(st.integers(max(1, 3 - pads[1] - pads[3]), 11))
    return dict(
        batch=draw(st.integers(1, 3)),
        cin=draw(st.integers(1, 9)),
        cout=draw(st.integers(1, 9)),
        size=(h, w),
        pads=pads,
        bias=draw(st.booleans()),
        act=draw(st.sampled_from(sorted(ACTIVATIONS))),
        variant=draw(st.sampled_from(["winograd", "winograd_1t"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _case_arrays(c):
    x = signed_input((c["batch"], c["cin"]) + c["size"], c["seed"])
    w = signed_input((c["cout"], c["cin"], 3, 3), c["seed"] + 1)
    b = signed_input((c["cout"],), c["seed"] + 2) if c["bias"] else None
    return x, w, b


@FAST
@given(winograd_case())
def test_winograd_matches_torch(c):
    x, w, b = _case_arrays(c)
    want, pre = torch_reference(x, w, b, c["pads"], c["act"])
    assert_close(run_winograd(x, w, b, c["pads"], c["act"], c["variant"]), want, pre)


@FAST
@given(winograd_case())
def test_winograd_split_over_threads_matches_torch(c):
    """Channel-split input transform and output-channel-split GEMM/output parts; with
    one channel (or one output channel) one part is empty."""
    x, w, b = _case_arrays(c)
    want, pre = torch_reference(x, w, b, c["pads"], c["act"])
    with split_everything():
        got = run_winograd(x, w, b, c["pads"], c["act"], "winograd", threads=2)
    assert_close(got, want, pre)


def test_winograd_big_enough_to_split_by_itself(two_threads):
    x, w, b = signed_input((2, 64, 22, 22), 0), signed_input((64, 64, 3, 3), 1), signed_input((64,), 2)
    assert winograd.SPLIT_MIN_MACS <= 16 * 64 * 64 * 2 * 12 * 12  # 11x11 tiles -> 12x12 planes
    want, pre = torch_reference(x, w, b, (1, 1, 1, 1), "maximum(@0,0)")
    got = run_winograd(x, w, b, (1, 1, 1, 1), "maximum(@0,0)", "winograd", threads=two_threads)
    assert_close(got, want, pre)


def test_winograd_batch_in_chunks(monkeypatch):
    """A batch whose scratch would pass CHUNK_SCRATCH_BYTES runs in chunks of images (two,
    two, then one here), the chunks of one size sharing a phase buffer."""
    x, w, b = signed_input((5, 6, 9, 7), 0), signed_input((4, 6, 3, 3), 1), signed_input((4,), 2)
    per_image = winograd.winograd_scratch(None, [x[:1]], [np.empty((1, 4, 9, 7), np.float32)], bind_context())
    monkeypatch.setattr(winograd, "CHUNK_SCRATCH_BYTES", 2 * per_image + 100)
    assert winograd._chunk(x.shape, (5, 4, 9, 7), np.float32) == 2
    want, pre = torch_reference(x, w, b, (1, 1, 1, 1), "maximum(@0,0)")
    for _ in range(2):
        assert_close(run_winograd(x, w, b, (1, 1, 1, 1), "maximum(@0,0)", "winograd"), want, pre)


def test_winograd_runs_twice_with_new_inputs():
    """The padded phases persist between runs: their borders must stay zero while the
    interior is overwritten."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get

    x = signed_input((1, 4, 6, 5), 0)
    w, b = signed_input((3, 4, 3, 3), 1), signed_input((3,), 2)
    node = KernelNode("conv_winograd", {"pads": (1, 2, 1, 0)}, "", "winograd")
    out = np.empty((1, 3, 6, 5), np.float32)
    run = get("conv_winograd").make(node, [x, transform_weights(w), b], [out], bind_context())
    for seed in (3, 4):
        x[...] = signed_input(x.shape, seed)
        run()
        assert_close(out, torch_reference(x, w, b, (1, 2, 1, 0), "")[0])


def test_transform_weights_is_g_g_gt_in_float64():
    w = np.random.default_rng(0).standard_normal((2, 3, 3, 3))
    g = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    u = transform_weights(w)
    assert u.shape == (4, 4, 2, 3) and u.dtype == np.float64
    for k in range(2):
        for c in range(3):
            np.testing.assert_allclose(u[:, :, k, c], g @ w[k, c] @ g.T, rtol=1e-14)


@pytest.mark.parametrize(
    "shapes, message",
    [
        ([(1, 4, 6, 6), (4, 4, 2, 5)], "do not fit"),
        ([(1, 4, 6, 6), (3, 3, 2, 4)], "do not fit"),
        ([(4, 6, 6), (4, 4, 2, 4)], "do not fit"),
        ([(1, 4, 6, 6), (4, 4, 2, 4), (3,)], "bias"),
        ([(1, 4, 1, 6), (4, 4, 2, 4)], "smaller than the 3x3 kernel"),
    ],
)
def test_shape_rule_names_what_does_not_fit(shapes, message):
    from helpers import KernelNode

    pads = (0, 1, 0, 1)
    with pytest.raises(ValueError, match=message):
        winograd.winograd_infer(KernelNode("conv_winograd", {"pads": pads}), shapes, [np.float32] * len(shapes))


# --- compiler: rule, prepack_weights, tune ------------------------------------------------


class ResidualPair(torch.nn.Module):
    """Two 3x3 convs with 64 channels on 16x16 (8x8 = 64 tiles): Winograd by the rule;
    a 3x3 stride-2 and a 16-channel 3x3 conv that stay GEMMs."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():  # the same weights in every test (the export is cached)
            torch.manual_seed(0)
            self.a = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False)
            self.bn = torch.nn.BatchNorm2d(64)
            self.b = torch.nn.Conv2d(64, 64, 3, padding=1)
            self.down = torch.nn.Conv2d(64, 16, 3, stride=2, padding=1)
            self.small = torch.nn.Conv2d(16, 16, 3, padding=1)
            with torch.no_grad():
                self.bn.running_mean.uniform_(-0.5, 0.5)
                self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        y = torch.relu(self.bn(self.a(x)))
        y = torch.relu(self.b(y) + x)
        return self.small(self.down(y))


def _ops(path):
    return [(n.name, n.op, n.variant) for n in InferenceSession(str(path)).model.nodes]


def test_rule_picks_winograd_and_prepack_stores_transformed_weights(exporter, tmp_path):
    module = ResidualPair().eval()
    inputs = (_rand(1, 64, 16, 16),)
    prefix = exporter("winograd_pair", module, inputs)
    sess, got, _ = compare_with_torch(prefix, module, inputs, tmp_path / "w.pmx")
    ops = _ops(tmp_path / "w.pmx")
    assert sum(op == "conv_winograd" for _, op, _ in ops) == 2, ops
    assert sum(op == "conv" for _, op, _ in ops) == 2, ops  # stride 2, and 16 channels
    # the 3x3 weights are gone from the file; only the transformed ones remain
    shapes = {a.shape for a in sess.model.constants.values()}
    assert (64, 64, 3, 3) not in shapes and (4, 4, 64, 64) in shapes, shapes
    # more images than compiled for: the GEMM columns span the batch
    batch = (_rand(3, 64, 16, 16, seed=5),)
    with torch.no_grad():
        want = module(*batch).numpy()
    (got3,) = sess.run(None, {"in0": batch[0].numpy()})
    assert rel_error(got3, want) <= 1e-4
    # without prepack_weights the same convs run as im2col GEMMs, with the same result
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "g.pmx"), disabled={"prepack_weights"})
    assert not any(op == "conv_winograd" for _, op, _ in _ops(tmp_path / "g.pmx"))
    (plain,) = InferenceSession(str(tmp_path / "g.pmx")).run(None, {"in0": inputs[0].numpy()})
    assert rel_error(got[0], plain) <= 1e-5


def test_winograd_follows_dynamic_image_sizes(exporter, tmp_path):
    """Dims 2 and 3 dynamic: conv_winograd's shape rule re-plans odd, tiny and larger
    images (tile counts change, down to a single output)."""
    module = ResidualPair().eval()
    prefix = exporter("winograd_pair", module, (_rand(1, 64, 16, 16),))
    compile_model(
        prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "d.pmx"), dynamic={"in0": {2: (1, -1), 3: (1, -1)}}
    )
    assert sum(op == "conv_winograd" for _, op, _ in _ops(tmp_path / "d.pmx")) == 2
    sess = InferenceSession(str(tmp_path / "d.pmx"))
    for seed, shape in enumerate([(2, 64, 9, 13), (1, 64, 1, 1), (1, 64, 40, 33)]):
        x = _rand(*shape, seed=seed)
        with torch.no_grad():
            want = module(x).numpy()
        (got,) = sess.run(None, {"in0": x.numpy()})
        assert got.shape == want.shape and rel_error(got, want) <= 1e-4, shape


def test_tune_times_winograd_for_3x3_convs(exporter, tmp_path):
    module = ResidualPair().eval()
    inputs = (_rand(1, 64, 16, 16),)
    prefix = exporter("winograd_pair", module, inputs)
    compare_with_torch(prefix, module, inputs, tmp_path / "t.pmx", tune=True)
    r = compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "t2.pmx"), tune=True)
    stored = {name: (op, variant) for name, op, variant in _ops(tmp_path / "t2.pmx")}
    tuned_3x3 = [(node, chosen, times) for node, _, chosen, times, _ in r.tuned if "winograd" in times]
    assert len(tuned_3x3) == 3, "every 3x3 stride-1 conv (a, b, small; not down) has Winograd candidates"
    for node, chosen, times in tuned_3x3:
        assert {"gemm", "winograd"} == set(times), times
        op, variant = stored[node.name]
        assert variant == chosen and op == ("conv_winograd" if chosen.startswith("winograd") else "conv")


def test_candidates_only_for_convs_winograd_computes():
    from pmx.compiler.ir import Node, Value

    def conv(k=3, stride=1, groups=1, mode="zeros"):
        x = Value("x", (1, 4, 8, 8))
        w = Value("w", (4, 4 // groups, k, k), data=np.zeros((4, 4 // groups, k, k), np.float32))
        attrs = dict(stride=(stride, stride), pads=(1, 1, 1, 1), dilation=(1, 1), groups=groups, padding_mode=mode)
        return Node("conv", "c", [x, w], [Value("y", (1, 4, 8, 8))], attrs)

    assert "winograd" in candidates(conv())
    for other in (conv(k=5), conv(stride=2), conv(groups=2), conv(mode="reflect")):
        assert not any(v.startswith("winograd") for v in candidates(other))


def test_winograd_never_computes_on_stale_scratch():
    """Every position the transforms read was written in this run (the discarded ones
    too), so whatever the shared scratch held before cannot overflow or turn into NaN:
    scratch full of float32 max raises nothing with floating-point errors as errors."""
    from helpers import KernelNode

    from pmx.runtime.kernels.registry import get, node_scratch_nbytes

    x = signed_input((2, 5, 7, 6), 0)
    w, b = signed_input((3, 5, 3, 3), 1), signed_input((3,), 2)
    node = KernelNode("conv_winograd", {"pads": (1, 1, 1, 1)}, "", "winograd_1t")
    u = transform_weights(w)
    out = np.empty((2, 3, 7, 6), np.float32)
    stale = np.full(
        node_scratch_nbytes(node, [x, u, b], [out], bind_context()) // 4, np.finfo(np.float32).max, np.float32
    )
    run = get("conv_winograd").make(node, [x, u, b], [out], bind_context(None, stale.view(np.uint8)))
    with np.errstate(all="raise"):
        run()
    assert_close(out, torch_reference(x, w, b, (1, 1, 1, 1), "")[0])
