"""End-to-end: sequence models and dense-prediction blocks written here, exported with
pnnx, compiled, run, compared with torch (max|pmx - torch| / max|torch| <= 1e-4).

Covers nn.LSTM / nn.GRU / nn.RNN (layers, directions, batch_first, projections, given
initial states), ConvTranspose1d/2d (and 1d/2d/3d without a batch dim), interpolation in
every mode pnnx writes, pixel (un)shuffle, F.pad and the nn.*PadNd modules, Conv1d/Conv2d
padding modes and 1-d pools.
"""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


class LSTMTagger(nn.Module):
    """2-layer bidirectional LSTM over a float sequence, a Linear head on every step."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.head(y)


class LSTMWithState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 7, num_layers=2, proj_size=3)

    def forward(self, x, h0, c0):
        y, (h, c) = self.lstm(x, (h0, c0))
        return y, h, c


class GRUClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(5, 12, num_layers=2, batch_first=True)
        self.fc = nn.Linear(12, 4)

    def forward(self, x):
        y, h = self.gru(x)
        return F.softmax(self.fc(y[:, -1]), dim=-1), h


class ElmanRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.RNN(3, 6, nonlinearity="relu", bidirectional=True, bias=False)
        self.b = nn.RNN(12, 4)

    def forward(self, x, h0):
        y, h = self.a(x, h0)
        z, _ = self.b(y)
        return z, h


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.e1 = conv_block(3, 8)
        self.e2 = conv_block(8, 16)
        self.mid = conv_block(16, 16)
        self.up2 = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.d2 = conv_block(32, 16)
        self.d1 = conv_block(24, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        s1 = self.e1(x)
        s2 = self.e2(F.max_pool2d(s1, 2))
        m = self.mid(F.max_pool2d(s2, 2))
        y = self.d2(torch.cat([self.up2(m), s2], 1))
        y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
        y = self.d1(torch.cat([y, s1], 1))
        return self.out(y)


class YoloHead(nn.Module):
    """Upsample-and-concat neck, 1x1 prediction conv, decode boxes against a grid."""

    def __init__(self, anchors=3, classes=4):
        super().__init__()
        self.a, self.c = anchors, classes
        self.lat = nn.Conv2d(16, 8, 1)
        self.pred = nn.Conv2d(16, anchors * (5 + classes), 1)
        h, w = 8, 10
        gy, gx = torch.meshgrid(
            torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
        )
        self.register_buffer("grid", torch.stack([gx, gy], -1).view(1, 1, h, w, 2))
        anchor_wh = torch.tensor([[1.0, 1.5], [2.0, 1.0], [3.0, 2.5]])
        self.register_buffer("anchor_wh", anchor_wh.view(1, anchors, 1, 1, 2))

    def forward(self, deep, shallow):
        up = F.interpolate(self.lat(deep), scale_factor=2, mode="nearest")
        p = self.pred(torch.cat([up, shallow], 1))
        b, _, h, w = p.shape
        p = p.view(b, self.a, 5 + self.c, h, w).permute(0, 1, 3, 4, 2)
        xy, wh, conf = torch.split(p, [2, 2, 1 + self.c], dim=-1)
        xy = (torch.sigmoid(xy) + self.grid) * 8.0
        wh = torch.exp(wh) * self.anchor_wh
        return torch.cat([xy, wh, torch.sigmoid(conf)], -1)


class PixelShuffleSR(nn.Module):
    def __init__(self, r=2):
        super().__init__()
        self.head = nn.Conv2d(3, 16, 3, padding=1)
        self.up = nn.Conv2d(16, 3 * r * r, 3, padding=1)
        self.shuffle = nn.PixelShuffle(r)
        self.unshuffle = nn.PixelUnshuffle(r)

    def forward(self, x):
        y = self.shuffle(self.up(F.relu(self.head(x))))
        y = y + F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=False)
        return y, self.unshuffle(y)


class PadModes(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        a = self.c(F.pad(x, (1, 1, 1, 1), mode="reflect"))
        b = self.c(F.pad(x, (2, 0, 0, 2), mode="circular"))
        c = F.pad(a, (1, -1, 2, 0), value=0.25)
        d = nn.ReplicationPad2d((0, 1, 2, 0))(b)
        e = nn.ZeroPad2d(1)(x) + nn.ConstantPad2d(1, 2.0)(x) + nn.ReflectionPad2d(1)(x)
        return a, b, c, d, e


class SeqConv1d(nn.Module):
    """Conv1d with each padding mode, 1-d pools, ConvTranspose1d, 1-d resizes and pads."""

    def __init__(self):
        super().__init__()
        self.c_reflect = nn.Conv1d(4, 6, 3, padding=1, padding_mode="reflect")
        self.c_circ = nn.Conv1d(6, 6, 5, padding=2, padding_mode="circular")
        self.c_repl = nn.Conv1d(6, 6, 3, padding=2, dilation=2, padding_mode="replicate")
        self.up = nn.ConvTranspose1d(6, 4, 4, stride=2, padding=1)
        self.pool = nn.MaxPool1d(3, 2, padding=1)
        self.avg = nn.AvgPool1d(2)

    def forward(self, x):
        y = F.relu(self.c_reflect(x))
        y = self.c_circ(y) + self.c_repl(y)
        p = self.pool(y)
        a = self.avg(y) + F.adaptive_avg_pool1d(y, p.shape[-1])
        u = self.up(p)
        r = F.interpolate(u, size=23, mode="linear", align_corners=True)
        s = F.interpolate(a, scale_factor=1.5, mode="nearest")
        return r, s, nn.ReflectionPad1d(2)(u), F.pad(a, (3, 1), mode="replicate")


class ResizeZoo(nn.Module):
    def forward(self, x):
        return (
            F.interpolate(x, size=(7, 9), mode="bilinear", align_corners=True),
            F.interpolate(x, scale_factor=(1.5, 0.7), mode="bilinear"),
            F.interpolate(x, scale_factor=1.7, mode="nearest"),
            F.interpolate(x, scale_factor=1.7, mode="bilinear", recompute_scale_factor=True),
            F.interpolate(x, size=(4, 13), mode="bicubic", align_corners=True),
            F.interpolate(x, scale_factor=2, mode="nearest-exact"),
            F.interpolate(x, scale_factor=2.5, mode="area"),
            nn.Upsample(scale_factor=3)(x),
            nn.UpsamplingBilinear2d(scale_factor=2)(x),
            nn.UpsamplingNearest2d(size=(11, 5))(x),
        )


class ConvTransposeZoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1)
        self.b = nn.ConvTranspose2d(6, 6, 3, stride=(2, 3), padding=(0, 2), groups=3, dilation=(2, 1), bias=False)
        self.c = nn.ConvTranspose2d(6, 2, 1)

    def forward(self, x):
        return F.relu(self.a(x)), self.b(x), self.c(x)


def _seed():
    torch.manual_seed(0)


def test_lstm_tagger(check_model):
    _seed()
    check_model("lstm_tagger", LSTMTagger(), (torch.randn(3, 7, 6),))


def test_lstm_initial_states(check_model):
    _seed()
    inputs = (torch.randn(6, 2, 4), torch.randn(2, 2, 3), torch.randn(2, 2, 7))
    sess, got, _want = check_model("lstm_state", LSTMWithState(), inputs)
    assert [i.name for i in sess.get_inputs()] == ["in0", "in1", "in2"]
    assert [g.shape for g in got] == [(6, 2, 3), (2, 2, 3), (2, 2, 7)]


def test_gru_classifier(check_model):
    _seed()
    check_model("gru_classifier", GRUClassifier(), (torch.randn(2, 9, 5),))


def test_rnn_relu_bidirectional(check_model):
    _seed()
    check_model("rnn_relu", ElmanRNN(), (torch.randn(5, 3, 3) * 0.5, torch.randn(2, 3, 6) * 0.5))


def test_unet(check_model):
    _seed()
    check_model("tiny_unet", TinyUNet(), (torch.randn(1, 3, 16, 20),))


def test_yolo_head(check_model):
    _seed()
    check_model("yolo_head", YoloHead(), (torch.randn(2, 16, 4, 5), torch.randn(2, 8, 8, 10)))


def test_pixel_shuffle_sr(check_model):
    _seed()
    check_model("pixel_shuffle_sr", PixelShuffleSR(), (torch.randn(1, 3, 6, 7),))


def test_pad_modes(check_model):
    _seed()
    check_model("pad_modes", PadModes(), (torch.randn(2, 3, 6, 7),))


def test_conv1d_family(check_model):
    _seed()
    check_model("seq_conv1d", SeqConv1d(), (torch.randn(2, 4, 20),))


def test_resize_zoo(check_model):
    _seed()
    check_model("resize_zoo", ResizeZoo(), (torch.randn(1, 2, 5, 6),))


def test_conv_transpose_zoo(check_model):
    _seed()
    check_model("conv_transpose_zoo", ConvTransposeZoo(), (torch.randn(2, 6, 5, 4),))


class UnbatchedConvTranspose(nn.Module):
    """ConvTranspose1d/2d/3d on [C, *spatial] inputs (no batch dim), modules and F forms."""

    def __init__(self):
        super().__init__()
        self.a = nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.b = nn.ConvTranspose2d(
            4, 6, 3, stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2, dilation=(1, 2), bias=False
        )
        self.c = nn.ConvTranspose3d(4, 2, 2, stride=2, padding=(1, 0, 0))

    def forward(self, x, y, z, w1, w2, w3):
        return (
            self.a(x),
            self.b(y),
            self.c(z),
            F.conv_transpose1d(x, w1, stride=3, padding=1, output_padding=2, groups=2, dilation=2),
            F.conv_transpose2d(y, w2, stride=2, output_padding=1),
            F.conv_transpose3d(z, w3, padding=1, dilation=2, groups=4),
        )


UNBATCHED_CT = [(4, 7), (4, 5, 6), (4, 3, 2, 3), (4, 3, 3), (4, 2, 2, 3), (4, 1, 2, 2, 2)]


def test_conv_transpose_unbatched(check_model):
    _seed()
    module = UnbatchedConvTranspose()
    inputs = tuple(torch.randn(*s) for s in UNBATCHED_CT)
    _, got, _ = check_model("conv_transpose_unbatched", module, inputs)
    shapes = [(6, 14), (6, 10, 10), (2, 4, 4, 6), (6, 23), (2, 11, 14), (4, 3, 2, 3)]
    assert [g.shape for g in got] == shapes


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_transpose_functional_written_unbatched(nd):
    """torch's F.conv_transposeNd puts unsqueeze/squeeze around an unbatched call and pnnx
    writes those; a .param naming F.conv_transposeNd on the [C, *spatial] input itself
    compiles to the same thing."""
    from paramgraph import run_one_op

    gen = torch.Generator().manual_seed(nd)
    x = torch.randn(4, *(3, 4, 2)[:nd], generator=gen)
    w = torch.randn(4, 3, *(2, 3, 2)[:nd], generator=gen)
    b = torch.randn(6, generator=gen)
    kw = dict(stride=2, padding=1, output_padding=1, groups=2, dilation=1)
    want = getattr(F, f"conv_transpose{nd}d")(x, w, b, **kw).numpy()
    params = " ".join(f"{k}={v}" if k == "groups" else f"{k}=({','.join([str(v)] * nd)})" for k, v in kw.items())
    (got,) = run_one_op(
        f"F.conv_transpose{nd}d", params, [x.numpy(), w.numpy(), b.numpy()], [want], labels=["input", "weight", "bias"]
    )
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_conv_transpose_input_of_another_rank_is_refused():
    from paramgraph import run_one_op

    from pmx.runtime.errors import PmxCompileError

    x, w = np.zeros((4, 5), np.float32), np.zeros((4, 3, 2, 2), np.float32)
    expected = r"F.conv_transpose2d 'the_op'.*input of rank 4 \(or 3 unbatched\).*\(4, 5\)"
    with pytest.raises(PmxCompileError, match=expected):
        run_one_op(
            "F.conv_transpose2d", "stride=(1,1)", [x, w], [np.zeros((3, 6, 3), np.float32)], labels=["input", "weight"]
        )


class SplitKernels(nn.Module):
    """A decoder-like block whose tensors are big enough that, on two threads, the group
    norm, transposed conv, resize, softmax, pixel shuffle and layer norm split their work
    in a real InferenceSession (arena views, shared scratch)."""

    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(8, 64)
        self.up = nn.ConvTranspose2d(64, 32, 2, stride=2)
        self.ln = nn.LayerNorm(64)

    def forward(self, x):
        y = self.up(F.silu(self.gn(x)))
        z = F.interpolate(y, scale_factor=2.0, mode="nearest")
        return torch.softmax(z, dim=1), F.pixel_shuffle(y, 2), self.ln(x.flatten(2).transpose(1, 2))


def test_split_kernels_in_a_session(check_model):
    from pmx.runtime import parallel

    _seed()
    x = torch.randn(1, 64, 32, 32)
    assert x.numel() >= parallel.SPLIT_MIN_ELEMENTS, "the block's smallest split tensor must reach the threshold"
    check_model("split_kernels", SplitKernels().eval(), (x,))


@pytest.mark.parametrize("batch_first", [False, True])
def test_lstm_unused_states(check_model, batch_first):
    """pnnx writes a single-output nn.LSTM when only y is used; h_n/c_n become internal."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 5, batch_first=batch_first, bias=False)

        def forward(self, x):
            return self.lstm(x)[0].relu()

    _seed()
    check_model(f"lstm_y_only_{batch_first}", M(), (torch.randn(4, 6, 3),))


class ZeroStates(nn.Module):
    """h0/c0 = torch.zeros(...) inside forward: pnnx folds them into one constant operand
    that feeds both state inputs (the compiler drops all-zero states)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.gru = nn.GRU(8, 6, batch_first=True)

    def forward(self, x):
        h0 = torch.zeros(1, x.size(0), 8)
        c0 = torch.zeros(1, x.size(0), 8)
        y, (h, c) = self.lstm(x, (h0, c0))
        z, hz = self.gru(y, torch.zeros(1, x.size(0), 6))
        return y, h, c, z[:, -1], hz


def test_zero_initial_states(check_model):
    _seed()
    check_model("rnn_zero_states", ZeroStates(), (torch.randn(2, 5, 4),))


class UnbatchedGRU(nn.Module):
    """A (T, features) sequence without a batch dim and a (layers * dirs, H) state."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(4, 6, num_layers=2, bidirectional=True)

    def forward(self, x, h0):
        return self.gru(x, h0)


def test_gru_unbatched(check_model):
    _seed()
    check_model("gru_unbatched", UnbatchedGRU(), (torch.randn(5, 4), torch.randn(4, 6)))


# --- other input shapes than the exported one ------------------------------------------

DYNAMIC = {
    # name: (module factory, example inputs, dynamic dims of in0, shapes to run)
    "tiny_unet": (
        TinyUNet,
        [(1, 3, 16, 20)],
        {0: (1, -1), 2: (8, 256), 3: (8, 256)},
        [[(2, 3, 16, 20)], [(1, 3, 32, 24)]],
    ),
    "lstm_tagger": (LSTMTagger, [(3, 7, 6)], {0: (1, -1), 1: (1, 100)}, [[(1, 7, 6)], [(2, 12, 6)]]),
    "pixel_shuffle_sr": (
        PixelShuffleSR,
        [(1, 3, 6, 7)],
        {0: (1, -1), 2: (4, 64), 3: (4, 64)},
        [[(3, 3, 6, 7)], [(2, 3, 9, 5)]],
    ),
    "pad_modes": (PadModes, [(2, 3, 6, 7)], {0: (1, -1), 2: (4, 64), 3: (4, 64)}, [[(1, 3, 8, 9)]]),
    "conv_transpose_zoo": (ConvTransposeZoo, [(2, 6, 5, 4)], {0: (1, -1), 2: (2, 64), 3: (2, 64)}, [[(1, 6, 7, 9)]]),
    "conv_transpose_unbatched": (UnbatchedConvTranspose, UNBATCHED_CT, {1: (1, 64)}, [[(4, 12)] + UNBATCHED_CT[1:]]),
    "yolo_head": (YoloHead, [(2, 16, 4, 5), (2, 8, 8, 10)], None, [[(3, 16, 4, 5), (3, 8, 8, 10)]]),
}


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_other_input_shapes(exporter, tmp_path, name):
    """Shape rules of resize/pad/pixel_shuffle/conv_transpose/lstm let one compiled model
    take other batch sizes, image sizes and sequence lengths (by default the batch; an
    unbatched transposed conv, its length)."""
    from helpers import rel_error, torch_outputs

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    factory, example, dims, runs = DYNAMIC[name]
    _seed()
    module = factory().eval()
    prefix = exporter(name, module, tuple(torch.randn(*s) for s in example))
    kwargs = {"dynamic": {"in0": dims}} if dims else {}
    out = str(tmp_path / "m.pmx")
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", out, verify=True, **kwargs)
    sess = InferenceSession(out)
    for shapes in runs:
        xs = [torch.randn(*s) for s in shapes]
        got = sess.run(None, {arg.name: x.numpy() for arg, x in zip(sess.get_inputs(), xs)})
        want = torch_outputs(module, xs)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            assert rel_error(g, w) <= 1e-4
