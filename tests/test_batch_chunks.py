"""A large batch runs in chunks of rows only where the graph keeps rows apart.

InferenceSession runs a batch in chunks of rows (at most SessionOptions config entry
pmx.batch_chunk_rows; 2 here, so small batches make several chunks, the last one
shorter), on its threads at once when it has several, one after another otherwise. Every model below is compared with torch at that batch:
for graphs that keep rows apart the profile must show the chunk's shapes (the chunks ran),
and for graphs that mix rows along dim 0 (a softmax or a mean over the batch, a flip, a
cumulative sum, a gather along dim 0, a sequence-first LSTM) the whole batch must run at
once and still match torch, since chunks would give other numbers.
"""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import export_pnnx, rel_error, torch_outputs
from hypothesis import given, settings
from hypothesis import strategies as st

from pmx.compiler import compile_model
from pmx.runtime import InferenceSession, PmxInputError, SessionOptions

CHUNK = 2
TOL = 1e-5


class ConvNet(nn.Module):
    """Conv, batch norm, a squeeze-excite gate reshaped by the batch size, a concat and a
    split on channels, pooling, flatten and a linear head with a softmax over classes."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.se = nn.Linear(8, 8)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        s = torch.sigmoid(self.se(y.mean((2, 3))))
        y = torch.cat([y, self.c2(y) * s.view(y.shape[0], 8, 1, 1)], 1)
        a, b = torch.split(y, 8, dim=1)
        y = F.max_pool2d(a + b.flip(3), 2)
        y = torch.cat([F.adaptive_avg_pool2d(y, 1), F.adaptive_max_pool2d(y, 1)], 1)
        logits = self.fc(torch.flatten(y, 1))
        return torch.softmax(logits, 1), logits.cumsum(1)


class Tokens(nn.Module):
    """Layer norm, attention over each sequence (batch first), a sum over tokens."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, -1)
        shape = (x.shape[0], x.shape[1], 2, 8)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        return (x + y).sum(1)


class Mixer(nn.Module):
    """One way of mixing the rows of a batch, after a row-wise linear layer."""

    def __init__(self, mix):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.mix = mix

    def forward(self, x):
        return self.mix(self.fc(x))


MIXES = {
    "softmax_over_batch": lambda y: torch.softmax(y, 0),
    "minus_batch_mean": lambda y: y - y.mean(0, keepdim=True),
    "flip_batch": lambda y: y.flip(0) * 2,
    "cumsum_over_batch": lambda y: y.cumsum(0),
    "roll_batch": lambda y: torch.roll(y, 1, 0) + y,
    "gather_along_batch": lambda y: torch.gather(y, 0, (y.abs() * 3).long() % y.shape[0]),
    "pad_rows_cancelling": lambda y: F.pad(y, (0, 0, 1, -1)) + y,  # the batch's size stays
    "embedding_in_the_batch": lambda y: F.embedding((y[:, 0].abs() * 2).long() % 3, y),  # the table is the batch
    "attention_over_the_batch": lambda y: F.scaled_dot_product_attention(y.unsqueeze(1), y, y),  # keys: the batch
}


class SequenceFirst(nn.Module):
    """An LSTM on [L, N, E]: dim 0 is time, not the batch."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 5)

    def forward(self, x):
        return self.rnn(x)[0]


def chunked_session(path, rows=CHUNK, threads=2):
    options = SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("pmx.batch_chunk_rows", str(rows))
    return InferenceSession(str(path), sess_options=options)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    cache = {}

    def compile_(name, module, example, **options):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            prefix = export_pnnx(directory, module, [example])
            compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(directory / "m.pmx"), **options)
            cache[name] = directory / "m.pmx"
        return cache[name]

    return compile_


def check_against_torch(sess, module, x):
    feed = {sess.get_inputs()[0].name: x.numpy()}
    for got, want in zip(sess.run(None, feed), torch_outputs(module, [x]), strict=True):
        assert got.shape == want.shape
        assert rel_error(got, want) <= TOL, f"{rel_error(got, want):.3g} against torch"
    return feed


def profiled_rows(sess, feed):
    """The largest dim 0 of any node's output in the session's profile of this feed: the
    rows one run of the nodes took."""
    rows = sess.profile(feed, repeat=1)
    return max(shape[0] for r in rows for shape in r["out_shapes"] if shape)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [3, 5, 8])
def test_a_cnn_runs_in_chunks_and_matches_torch(compiled, batch, threads):
    torch.manual_seed(0)
    module = ConvNet().eval()
    path = compiled("convnet", module, torch.rand(1, 3, 16, 16))
    sess = chunked_session(path, threads=threads)
    feed = check_against_torch(sess, module, torch.rand(batch, 3, 16, 16))
    # with threads, a batch is shared out in chunks of at most ceil(batch / threads) rows
    assert profiled_rows(sess, feed) == min(CHUNK, -(-batch // threads))
    assert sess.thread_choice(feed) == (threads, True) or threads == 1


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 9), most=st.integers(0, 4), threads=st.integers(1, 3), seed=st.integers(0, 99))
def test_any_chunking_gives_each_image_what_a_run_of_it_alone_gives(compiled, batch, most, threads, seed):
    """Whatever the chunk size (0: none), thread count and batch, every image's outputs
    are those of a run of that image alone, within float rounding, and torch's."""
    torch.manual_seed(0)
    module = ConvNet().eval()
    path = compiled("convnet", module, torch.rand(1, 3, 16, 16))
    sess, alone = cached_session(path, most, threads), cached_session(path, 0, 1)
    x = torch.from_numpy(np.random.default_rng(seed).random((batch, 3, 16, 16), dtype=np.float32))
    got = sess.run(None, {"in0": x.numpy()})
    for k, want in enumerate(torch_outputs(module, [x])):
        singles = np.concatenate([alone.run(None, {"in0": x[i : i + 1].numpy()})[k] for i in range(batch)])
        assert rel_error(got[k], singles) <= TOL
        assert rel_error(got[k], want) <= TOL


SESSIONS = {}


def cached_session(path, most, threads):
    key = (str(path), most, threads)
    if key not in SESSIONS:
        SESSIONS[key] = chunked_session(path, most, threads)
    return SESSIONS[key]


def test_a_transformer_block_runs_in_chunks_and_matches_torch(compiled):
    torch.manual_seed(0)
    module = Tokens().eval()
    path = compiled("tokens", module, torch.rand(1, 4, 16))
    sess = chunked_session(path)
    feed = check_against_torch(sess, module, torch.rand(7, 4, 16))
    assert profiled_rows(sess, feed) == CHUNK


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_graph_that_mixes_rows_runs_the_batch_whole(compiled, mix):
    torch.manual_seed(0)
    module = Mixer(MIXES[mix]).eval()
    path = compiled(mix, module, torch.rand(3, 6))
    sess = chunked_session(path)
    feed = check_against_torch(sess, module, torch.rand(7, 6))
    assert profiled_rows(sess, feed) == 7


class BatchFirst(nn.Module):
    """A batch-first GRU and LSTM on [N, L, E]: each sequence runs apart."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(6, 5, batch_first=True)
        self.lstm = nn.LSTM(5, 4, batch_first=True)

    def forward(self, x):
        return self.lstm(self.gru(x)[0])[0][:, -1]


def test_batch_first_recurrent_layers_run_in_chunks(compiled):
    torch.manual_seed(0)
    module = BatchFirst().eval()
    sess = chunked_session(compiled("batch_first_rnn", module, torch.rand(2, 5, 6)))
    feed = check_against_torch(sess, module, torch.rand(7, 5, 6))
    assert profiled_rows(sess, feed) == CHUNK


def test_a_sequence_first_lstm_runs_the_batch_whole(compiled):
    torch.manual_seed(0)
    module = SequenceFirst().eval()
    path = compiled("lstm", module, torch.rand(3, 2, 6))
    sess = chunked_session(path)
    check_against_torch(sess, module, torch.rand(7, 2, 6))


def test_chunks_write_into_bound_outputs(compiled):
    torch.manual_seed(0)
    module = ConvNet().eval()
    sess = chunked_session(compiled("convnet", module, torch.rand(1, 3, 16, 16)))
    x = torch.rand(5, 3, 16, 16)
    want = torch_outputs(module, [x])
    binding = sess.io_binding()
    binding.bind_cpu_input(sess.get_inputs()[0].name, x.numpy())
    outs = [np.full(w.shape, np.nan, np.float32) for w in want]
    for arg, out in zip(sess.get_outputs(), outs):
        binding.bind_output_array(arg.name, out)
    sess.run_with_iobinding(binding)
    for out, w in zip(outs, want):
        assert rel_error(out, w) <= TOL


def test_a_bound_output_of_another_shape_is_refused(compiled):
    torch.manual_seed(0)
    module = ConvNet().eval()
    sess = chunked_session(compiled("convnet", module, torch.rand(1, 3, 16, 16)))
    feed = {"in0": np.random.default_rng(0).random((5, 3, 16, 16), dtype=np.float32)}
    with pytest.raises(PmxInputError, match=r"bound output .*\[5, 5\]"):
        sess.run_into(None, feed, [np.empty((4, 5), np.float32), None])


@pytest.mark.parametrize(("most", "rows"), [(2, 9), (4, 4), (8, 9)])
def test_no_chunk_is_smaller_than_the_batch_range_allows(compiled, most, rows):
    """dim 0 compiled as 4..16: chunks of 2 would run a shape the file refuses, so the
    batch runs whole; chunks of 4 leave no last chunk of 1 (it joins the one before)."""
    torch.manual_seed(0)
    module = ConvNet().eval()
    path = compiled("convnet_4_to_16", module, torch.rand(4, 3, 16, 16), dynamic={"in0": {0: (4, 16)}})
    sess = chunked_session(path, rows=most, threads=1)
    feed = check_against_torch(sess, module, torch.rand(9, 3, 16, 16))
    assert profiled_rows(sess, feed) == rows


def test_a_sessions_chunk_threads_end_with_it(compiled):
    import gc
    import threading
    import time

    def chunk_threads():
        return {t for t in threading.enumerate() if t.name.startswith("pmx-chunks")}

    torch.manual_seed(0)
    before = chunk_threads()
    sess = chunked_session(compiled("convnet", ConvNet().eval(), torch.rand(1, 3, 16, 16)), threads=2)
    sess.run(None, {"in0": np.ones((4, 3, 16, 16), np.float32)})
    started = chunk_threads() - before
    assert 1 <= len(started) <= 2  # started as chunks need them, up to the session's threads
    del sess
    gc.collect()
    deadline = time.monotonic() + 60  # bounded, and generous for a busy host
    while any(t.is_alive() for t in started) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in started)


def test_no_chunks_on_request(compiled):
    torch.manual_seed(0)
    module = ConvNet().eval()
    sess = chunked_session(compiled("convnet", module, torch.rand(1, 3, 16, 16)), rows=0)
    feed = check_against_torch(sess, module, torch.rand(5, 3, 16, 16))
    assert profiled_rows(sess, feed) == 5


@pytest.mark.parametrize("value", ["-1", "two", "1.5", ""])
def test_the_chunk_entry_takes_whole_numbers(value):
    with pytest.raises(PmxInputError, match=r"pmx\.batch_chunk_rows"):
        SessionOptions().add_session_config_entry("pmx.batch_chunk_rows", value)


# Hand-written graphs (pnnx writes no such pools; the slice comes from a dynamic-shape
# export): windows over dim 0, and a slice as long as the batch. Each mixes rows, so the
# batch runs whole, and matches torch on the tensor seen as one image (pools) or torch.
BATCH_WIDE = {
    "max_pool_over_dim_0": (
        "F.max_pool2d p 1 1 x y kernel_size=(3,1) stride=(1,1) padding=(1,0) ceil_mode=False dilation=(1,1) "
        "return_indices=False #x=(4,8)f32 #y=(4,8)f32",
        lambda t: F.max_pool2d(t[None], (3, 1), 1, (1, 0))[0],
    ),
    "avg_pool_over_dim_0": (
        "F.avg_pool2d p 1 1 x y kernel_size=(3,1) stride=(1,1) padding=(1,0) ceil_mode=False "
        "count_include_pad=True divisor_override=None #x=(4,8)f32 #y=(4,8)f32",
        lambda t: F.avg_pool2d(t[None], (3, 1), 1, (1, 0))[0],
    ),
    "pool_indices_over_dim_0": (
        "F.max_pool2d p 1 2 x y i kernel_size=(1,2) stride=(1,2) padding=(0,0) dilation=(1,1) ceil_mode=False "
        "return_indices=True #x=(4,8)f32 #y=(4,4)f32 #i=(4,4)i64",
        lambda t: F.max_pool2d(t[None], (1, 2), (1, 2), return_indices=True)[1][0],
    ),
}


@pytest.mark.parametrize("name", sorted(BATCH_WIDE))
def test_a_window_over_dim_0_runs_the_batch_whole(tmp_path, name):
    from paramgraph import compile_lines

    line, fn = BATCH_WIDE[name]
    outs = line.split()[4 + int(line.split()[2]) : 4 + int(line.split()[2]) + int(line.split()[3])]
    sess = compile_lines(
        tmp_path, ["pnnx.Input in0 0 1 x #x=(4,8)f32", line, f"pnnx.Output out {len(outs)} 0 {' '.join(outs)}"]
    )
    chunked = chunked_session(tmp_path / "m.pmx", rows=1)
    for n in (3, 5, 7):
        x = torch.rand(n, 8)
        got = chunked.run(None, {"in0": x.numpy()})[-1]
        np.testing.assert_allclose(got, fn(x).numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got, sess.run(None, {"in0": x.numpy()})[-1])


def test_a_slice_as_long_as_the_batch_runs_the_batch_whole(tmp_path):
    """x[:, 3 : x.size(0)], as pnnx's dynamic-shape export writes it: the end follows the batch."""
    from paramgraph import compile_lines

    lines = [
        "pnnx.Input in0 0 1 x #x=(?,8)f32",
        "pnnx.Expression n 1 1 x e expr=size(@0,0) $input=x #x=(?,8)f32",
        "Tensor.slice s 2 1 x e y dim=1 start=3 step=1 $input=x $end=e #x=(?,8)f32 #y=(?,?)f32",
        "pnnx.Output out 1 0 y",
    ]
    compile_lines(tmp_path, lines)
    chunked = chunked_session(tmp_path / "m.pmx", rows=1)
    for n in (5, 7):
        x = torch.rand(n, 8)
        (got,) = chunked.run(None, {"in0": x.numpy()})
        np.testing.assert_array_equal(got, x[:, 3:n].numpy())
