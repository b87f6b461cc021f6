"""Point each node input of .pmx files at every other kind of tensor, load and run each
result, and list what a damaged file can still reach beyond the verifier.

    python tools/probe_operands.py FILE.pmx [FILE.pmx ...]

Each change must run, or be refused with PmxFormatError or PmxResourceError. Anything
else (an internal error at bind or run, another exception) is printed with the node, op,
input slot and the shape it was given; exit status 1 if any. Files that ran with an
operand of another shape are counted too: a rule may accept a broadcastable operand.
"""

import argparse
import collections
import pathlib
import random
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from helpers import operand_swaps, with_input

from pmx.runtime import InferenceSession, PmxFormatError, PmxInputError, PmxResourceError


def feed(sess):
    """Ones of each input's planned shape and dtype."""
    model = sess.model
    return {
        a.name: np.ones(model.tensors[i].shape, model.tensors[i].dtype) for a, i in zip(sess.get_inputs(), model.inputs)
    }


def attempt(data, path):
    """'ran', 'refused', 'input error' (an index out of range at run: values are checked
    when they are used, and a constant's are not told apart from an input's), or the
    escaped error's text."""
    path.write_bytes(data)
    try:
        sess = InferenceSession(str(path), max_arena_bytes=256 << 20)
        sess.run(None, feed(sess))
        return "ran"
    except (PmxFormatError, PmxResourceError):
        return "refused"
    except PmxInputError:
        return "input error"
    except Exception as e:  # what the probe is looking for
        return f"{type(e).__name__}: {str(e)[:160]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=pathlib.Path)
    parser.add_argument(
        "--max-per-file", type=int, default=300, help="changes tried per file, drawn with a fixed seed (0: all of them)"
    )
    args = parser.parse_args()
    escaped = collections.defaultdict(list)
    counts = collections.Counter()
    with tempfile.TemporaryDirectory() as d:
        scratch = pathlib.Path(d) / "probe.pmx"
        for f in args.files:
            data = f.read_bytes()
            try:
                swaps = operand_swaps(data)
            except Exception as e:  # a file the walker cannot read (one a fuzz test damaged): not a probe
                print(f"{f.name}: skipped: {type(e).__name__}: {e}")
                continue
            if args.max_per_file and len(swaps) > args.max_per_file:
                swaps = random.Random(0).sample(swaps, args.max_per_file)
            for j, node, slot, tensor, position in swaps:
                outcome = attempt(with_input(data, position, tensor), scratch)
                known = outcome in ("ran", "refused", "input error")
                counts[outcome if known else "escaped"] += 1
                if not known:
                    line = f"{f.name} node {j} {node.name!r} <- tensor {tensor}: {outcome}"
                    if not escaped[(node.op, slot)]:
                        print(f"{node.op} input {slot}: {line}", flush=True)
                    escaped[(node.op, slot)].append(line)
    print(f"{sum(counts.values())} changed files: {dict(counts)}")
    for (op, slot), lines in sorted(escaped.items()):
        print(f"\n{op} input {slot}: {len(lines)} escaped")
        for line in lines[:3]:
            print("   ", line)
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
