"""Fuzzing the frontend: mutated .param texts and damaged .bin zips go through
compile_model, and what compiles is loaded and run on random inputs. The only exceptions
allowed out are PmxError subclasses, and never PmxInternalError (a compiled file that
fails at run is a bug of pmx's: the compile should have refused it); every case must
finish fast and must not allocate without bound. Run with -s to see how many cases ran
and the distinct kinds of error message.

Mutations of .param: drop / duplicate / garble tokens and lines, change counts, insert
huge numbers (10**30, 2**63, a billion declared operators), truncate. Mutations of .bin:
truncate, rewrite size / offset / count / method fields with hostile values, flip bytes
in headers and anywhere."""

import collections
import os
import pathlib
import re
import resource
import struct
import tempfile
import time
import traceback

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from ziputil import build_zip

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession
from pmx.runtime.errors import PmxError, PmxInternalError

ROOT = pathlib.Path(__file__).resolve().parent.parent

EXAMPLE = ROOT / "tools" / "example" / "cnn.pnnx"

SMALL_OPS = [
    "pnnx.Input in 0 1 0 #0=(1,4)f32",
    (
        "nn.Linear fc 1 1 0 1 bias=True in_features=4 out_features=3 @weight=(3,4)f32 @bias=(3)f32 "
        "$input=0 #0=(1,4)f32 #1=(1,3)f32"
    ),
    "F.relu r 1 1 1 2 $input=1 #1=(1,3)f32 #2=(1,3)f32",
    "pnnx.Expression e 2 1 1 2 3 expr=add(mul(@0,2.500000e+00),@1) #1=(1,3)f32 #2=(1,3)f32 #3=(1,3)f32",
    "torch.cat cat 2 1 3 2 4 dim=1 #3=(1,3)f32 #2=(1,3)f32 #4=(1,6)f32",
    "Tensor.reshape rs 1 1 4 5 shape=(2,3) #4=(1,6)f32 #5=(2,3)f32",
    "pnnx.Output out 1 0 5",
]
SMALL_PARAM = "\n".join(["7767517", f"{len(SMALL_OPS)} 6", *SMALL_OPS]) + "\n"
RNG = np.random.default_rng(1)
SMALL_WEIGHTS = [
    ("fc.weight", RNG.standard_normal((3, 4)).astype(np.float32).tobytes()),
    ("fc.bias", RNG.standard_normal(3).astype(np.float32).tobytes()),
]
SMALL_BIN = build_zip(SMALL_WEIGHTS).data
SMALL_BIN_PLAIN = build_zip(SMALL_WEIGHTS, zip64=False).data

HUGE = [10**30, 2**63, 2**63 - 1, 2**64, 2**31, 2**32 + 1, 10**9, -1, -(2**63), 0]
DTYPE_CODES = ["f32", "f64", "f16", "bf16", "i8", "u8", "i16", "i32", "i64", "bool", "c64", "c128", "c32", "null"]
ALPHABET = "0123456789()[],=@$#%?.-+ejxf_ \t" + "\u0662\u00a0\x00"
# A case may take this many times what compiling and running the zoo seed takes, measured
# in the same run (a busy or a slower host scales both), and never less than the floor:
# the bound catches runaway work, not a slow machine.
SLOWDOWN_LIMIT = 25
TIME_LIMIT_FLOOR_S = 2.0
TIME_LIMIT_S = [TIME_LIMIT_FLOOR_S]  # set by the time_limit fixture
# A mutated model may ask for any size; running it must stay small.
RUN_ARENA_LIMIT = 64 << 20
# PMX_FUZZ_SCALE=20 runs 20x the cases (a longer hunt than the suite's default budget).
SCALE = int(os.environ.get("PMX_FUZZ_SCALE", "1"))

STATS = {
    "cases": collections.Counter(),
    "kinds": collections.Counter(),
    "crashes": [],
    "internal": collections.Counter(),
}


class Zoo(nn.Module):
    """Many op families in one export, so parameter mutations reach many canon rules."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.ln = nn.LayerNorm(8)
        self.gn = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        y = self.gn(F.elu(self.bn(self.conv(x))))
        u = F.interpolate(F.avg_pool2d(y, 2), scale_factor=2.0, mode="nearest")
        z = self.ln((y + u).permute(0, 2, 3, 1))
        a, b = torch.split(z, [3, 5], dim=-1)
        c = torch.cat([b, a], dim=3).transpose(1, 2)
        t = self.fc(torch.softmax(c, dim=-1).mean(dim=(1, 2))).unsqueeze(1).reshape(2, 3, 2)
        return t, c[:, 1:5:2, 0, :].sum(-1), torch.matmul(t, t.transpose(1, 2))


@pytest.fixture(scope="module")
def zoo(exporter):
    torch.manual_seed(0)
    prefix = exporter("fuzz_zoo", Zoo(), (torch.randn(2, 4, 8, 8),))
    return pathlib.Path(prefix + ".pnnx.param").read_text(), pathlib.Path(prefix + ".pnnx.bin").read_bytes()


@pytest.fixture(scope="module", autouse=True)
def report():
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    print(
        f"\n[fuzz] cases run: {dict(STATS['cases'])}, total {sum(STATS['cases'].values())}; "
        f"peak RSS grew {grown_mb:.0f} MB"
    )
    print(f"[fuzz] {len(STATS['kinds'])} distinct error message kinds:")
    for kind, n in sorted(STATS["kinds"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {kind}")
    for crash in STATS["crashes"]:
        print(f"[fuzz] CRASH {crash}")
    print(
        f"[fuzz] {sum(STATS['internal'].values())} cases hit an internal error in a later stage "
        f"(turned into PmxCompileError by compile_model), at {len(STATS['internal'])} code sites:"
    )
    for site, n in sorted(STATS["internal"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {site}")


@pytest.fixture(scope="module", autouse=True)
def time_limit(zoo, tmp_path_factory):
    """Sets TIME_LIMIT_S from the zoo seed's own compile and run, the fastest of three."""
    d = tmp_path_factory.mktemp("fuzz_baseline")
    (d / "m.pnnx.param").write_text(zoo[0])
    (d / "m.pnnx.bin").write_bytes(zoo[1])
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        compile_model(str(d / "m.pnnx.param"), str(d / "m.pnnx.bin"), str(d / "m.pmx"))
        run_compiled(d / "m.pmx")
        times.append(time.perf_counter() - t0)
    TIME_LIMIT_S[0] = max(TIME_LIMIT_FLOOR_S, SLOWDOWN_LIMIT * min(times))


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="pmx_fuzz_") as d:
        yield pathlib.Path(d)


def error_kind(msg, workdir):
    msg = msg.replace(str(workdir) + "/", "")
    return re.sub(r"\d+", "N", msg)[:60]


def run_case(workdir, label, param: bytes, binary: bytes):
    (workdir / "m.pnnx.param").write_bytes(param)
    (workdir / "m.pnnx.bin").write_bytes(binary)
    out = workdir / "m.pmx"
    STATS["cases"][label] += 1
    t0 = time.perf_counter()
    try:
        compile_model(str(workdir / "m.pnnx.param"), str(workdir / "m.pnnx.bin"), str(out))
        STATS["kinds"]["(compiled)"] += 1
        run_compiled(out)
        STATS["kinds"]["(compiled and ran)"] += 1
    except PmxInternalError as e:
        raise AssertionError(f"{e}\nparam:\n{param[:2000]!r}") from e
    except PmxError as e:
        STATS["kinds"][f"{type(e).__name__}: {error_kind(str(e), workdir)}"] += 1
        site = re.search(r"\(internal error at (\S+);", str(e))
        if site:
            STATS["internal"][f"{site.group(1)} {type(e.__cause__).__name__}"] += 1
    except Exception as e:  # this is what the test is looking for
        frames = traceback.extract_tb(e.__traceback__)
        where = next(
            (
                f"{f.filename.split(f'{ROOT}/')[-1]}:{f.lineno} {f.name}"
                for f in reversed(frames)
                if f.filename.startswith(f"{ROOT}/")
            ),
            "?",
        )
        STATS["crashes"].append(f"{label}: {type(e).__name__}: {str(e)[:120]} at {where}")
        raise AssertionError(
            f"{type(e).__name__} escaped compile_model at {where}: {e}\nparam:\n{param[:2000]!r}"
        ) from e
    elapsed = time.perf_counter() - t0
    assert elapsed < TIME_LIMIT_S[0], f"case took {elapsed:.2f} s, over {SLOWDOWN_LIMIT}x the zoo seed's"


def run_compiled(path):
    """Run a compiled case once on random inputs of its planned shapes (small
    non-negative integers where the input is one: ids and indices)."""
    sess = InferenceSession(str(path), max_arena_bytes=RUN_ARENA_LIMIT)
    model = sess.model
    rng = np.random.default_rng(0)
    feed = {}
    for arg, index in zip(sess.get_inputs(), model.inputs):
        t = model.tensors[index]
        values = rng.integers(0, 3, t.shape) if t.dtype.kind in "biu" else rng.standard_normal(t.shape) * 3
        feed[arg.name] = values.astype(t.dtype)
    with np.errstate(all="ignore"):
        sess.run(None, feed)


def test_seeds_compile(workdir, zoo):
    """The unmutated seeds compile, so the fuzzers start from valid input."""
    before = STATS["kinds"]["(compiled)"]
    run_case(workdir, "seed", SMALL_PARAM.encode(), SMALL_BIN)
    run_case(workdir, "seed", SMALL_PARAM.encode(), SMALL_BIN_PLAIN)
    run_case(workdir, "seed", example_param().encode(), (EXAMPLE.parent / "cnn.pnnx.bin").read_bytes())
    run_case(workdir, "seed", zoo[0].encode(), zoo[1])
    assert STATS["kinds"]["(compiled)"] - before == 4, STATS["kinds"]


# --- .param mutations --------------------------------------------------------------------------


@st.composite
def mutated_param(draw, text):
    lines = text.split("\n")
    for _ in range(draw(st.integers(1, 3))):
        # Mostly small edits inside operator lines, so many cases get past the frontend
        # and exercise canonicalization, shape inference and the later passes too.
        kind = draw(
            st.sampled_from(
                ["value"] * 6
                + ["huge"] * 3
                + ["number"] * 6
                + ["garble_token"] * 3
                + ["dtype"] * 3
                + ["drop_token", "dup_token", "count", "line", "truncate", "billion"]
            )
        )
        if kind == "billion":
            if len(lines) < 2:
                continue
            lines[1] = f"{draw(st.sampled_from([10**9, 10**30, 2**63]))} {len(lines)}"
            continue
        if kind == "truncate":
            joined = "\n".join(lines)
            lines = joined[: draw(st.integers(0, len(joined)))].split("\n")
            continue
        if kind == "line" and len(lines) > 2:
            i = draw(st.integers(1, len(lines) - 1))
            how = draw(st.sampled_from(["drop", "dup", "swap"]))
            if how == "drop":
                del lines[i]
            elif how == "dup":
                lines.insert(i, lines[i])
            else:
                j = draw(st.integers(1, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
            continue
        i = (
            draw(st.integers(0, len(lines) - 1))
            if kind == "count"
            else draw(st.integers(min(2, len(lines) - 1), len(lines) - 1) | st.integers(0, len(lines) - 1))
        )
        tokens = lines[i].split(" ")
        tokens = [t for t in tokens if t] or [""]
        j = draw(st.integers(0, len(tokens) - 1))
        if kind == "drop_token":
            del tokens[j]
        elif kind == "dup_token":
            tokens.insert(j, tokens[j])
        elif kind == "garble_token":
            t = tokens[j]
            pos = draw(st.integers(0, len(t)))
            cut = draw(st.integers(0, 3))
            tokens[j] = t[:pos] + draw(st.text(ALPHABET, max_size=4)) + t[pos + cut :]
        elif kind == "count":
            # the counts on line 2, or an operator's input/output counts
            if i == 1 and len(tokens) >= 2:
                tokens[j % 2] = str(draw(st.sampled_from(HUGE + [0, 1, 2, 3, 5, 7, 8])))
            elif len(tokens) >= 4:
                tokens[draw(st.sampled_from([2, 3]))] = str(draw(st.sampled_from([0, 1, 2, 3, 4] + HUGE)))
        elif kind in ("huge", "number"):
            # a number inside a token: a dim, a kernel size, a stride, a dim index, a count
            numbers = [(k, m) for k, tok in enumerate(tokens) for m in re.finditer(r"-?\d+", tok)]
            if numbers:
                k, m = numbers[draw(st.integers(0, len(numbers) - 1))]
                new = draw(st.sampled_from(HUGE)) if kind == "huge" else draw(st.integers(-3, 9))
                tokens[k] = tokens[k][: m.start()] + str(new) + tokens[k][m.end() :]
        elif kind == "dtype":
            # an operand's recorded dtype, its shape kept: a record that contradicts what
            # the op computes must fail the compile, not the run
            typed = [k for k, tok in enumerate(tokens) if re.fullmatch(r"#[^=]+=\(.*\)\w+", tok)]
            if typed:
                k = draw(st.sampled_from(typed))
                code = draw(st.sampled_from(DTYPE_CODES))
                tokens[k] = re.sub(r"\)\w+$", ")" + code, tokens[k])
        elif kind == "value":
            kv = [k for k, tok in enumerate(tokens) if "=" in tok and tok[0] not in "@$#"]
            kv = kv if kv and draw(st.integers(0, 3)) else [k for k, tok in enumerate(tokens) if "=" in tok]
            if kv:
                k = draw(st.sampled_from(kv))
                key = tokens[k].split("=", 1)[0]
                value = draw(
                    st.sampled_from(
                        [
                            "None",
                            "True",
                            "()",
                            "(1,2)",
                            "(1,2,3,4,5)",
                            "-1",
                            "0",
                            "1.5",
                            "nan",
                            "inf",
                            "abc",
                            "(a,b)",
                            "%x",
                            "(?,3)f32",
                            "(3,4)f64",
                            "(0)f32",
                            "()f32",
                            "(2,2)bf16",
                            "(1,4)i64",
                            "1.0+2.0j",
                            str(10**30),
                            f"({2**62},{2**62})",
                            "(-5,3)",
                            "add(@0,@9)",
                            "@0",
                            "",
                        ]
                    )
                )
                tokens[k] = f"{key}={value}"
        lines[i] = " ".join(tokens)
    return "\n".join(lines)


def example_param():
    return (EXAMPLE.parent / "cnn.pnnx.param").read_text()


@settings(max_examples=300 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_param_small(workdir, data):
    text = data.draw(mutated_param(SMALL_PARAM))
    run_case(workdir, "param-small", text.encode("utf-8", "surrogatepass"), SMALL_BIN)


@settings(max_examples=150 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_param_cnn(workdir, data):
    text = data.draw(mutated_param(example_param()))
    run_case(
        workdir,
        "param-cnn",
        text.encode("utf-8", "surrogatepass"),
        (EXAMPLE.parent / "cnn.pnnx.bin").read_bytes(),
    )


@settings(max_examples=150 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_param_zoo(workdir, zoo, data):
    text = data.draw(mutated_param(zoo[0]))
    run_case(workdir, "param-zoo", text.encode("utf-8", "surrogatepass"), zoo[1])


# --- .bin mutations ----------------------------------------------------------------------------


def structure_offsets(data: bytes):
    """Offsets of every zip signature: the headers a mutation should hit."""
    sigs = [b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"]
    return sorted(m.start() for s in sigs for m in re.finditer(re.escape(s), data))


@st.composite
def mutated_bin(draw, data: bytes):
    b = bytearray(data)
    offsets = structure_offsets(data) or [0]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["truncate", "field", "method", "flip_header", "flip_any", "append"]))
        if kind == "truncate":
            del b[draw(st.integers(0, max(0, len(b) - 1))) :]
        elif kind == "append":
            b += draw(st.binary(max_size=64))
        elif not b:
            continue
        elif kind == "field":
            base = draw(st.sampled_from(offsets))
            at = min(len(b) - 1, base + draw(st.integers(0, 56)))
            width = draw(st.sampled_from([2, 4, 8]))
            value = draw(st.sampled_from([0, 1, 0xFFFF, 0xFFFFFFFF, 2**40, 2**63, 2**64 - 1, 46, 10**6]))
            raw = (value % (1 << (8 * width))).to_bytes(width, "little")
            b[at : at + width] = raw[: len(b) - at]
        elif kind == "method":
            base = draw(st.sampled_from(offsets))
            is_cd = bytes(b[base : base + 4]) == b"PK\x01\x02"
            at = base + (10 if is_cd else 8)
            if at + 2 <= len(b):
                struct.pack_into("<H", b, at, draw(st.sampled_from([8, 12, 14, 99, 0xFFFF])))
        elif kind == "flip_header":
            at = min(len(b) - 1, draw(st.sampled_from(offsets)) + draw(st.integers(0, 60)))
            b[at] ^= 1 << draw(st.integers(0, 7))
        else:
            at = draw(st.integers(0, len(b) - 1))
            b[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(b)


@settings(max_examples=150 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_bin_small(workdir, data):
    seed = data.draw(st.sampled_from([SMALL_BIN, SMALL_BIN_PLAIN]))
    run_case(workdir, "bin-small", SMALL_PARAM.encode(), data.draw(mutated_bin(seed)))


@settings(max_examples=40 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_bin_cnn(workdir, data):
    seed = (EXAMPLE.parent / "cnn.pnnx.bin").read_bytes()
    run_case(workdir, "bin-cnn", example_param().encode(), data.draw(mutated_bin(seed)))
