"""Run the README's test command several times, quiet and beside busy processes, and
report every failure: the check that the suite passes every time, not just once.

    python tools/check_suite.py --quiet-runs 5 --busy-runs 5
    python tools/check_suite.py --fresh --quiet-runs 5 --busy-runs 5   # as CI: a fresh clone and venv
    python tools/check_suite.py --busy-runs 8 -- tests/test_threads_host.py

A busy run starts one busy-looping process per usable core for the length of the run.
--fresh clones the checkout's HEAD into a temporary folder, makes a venv there and installs
it as the README says (`pip install -e '.[test,ray,dask]'`), as .ci/run does; otherwise the
runs use this checkout and this interpreter. Arguments after `--` go to pytest instead of
its default (the whole suite). Exit status 1 if any run failed.
"""

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUSY_LOOP = "while True: pass"


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fresh_checkout(workdir):
    """A clone of HEAD with a venv installed as the README says; returns (clone, python)."""
    clone = workdir / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-e", ".[test,ray,dask]"], cwd=clone, check=True)
    return clone, python


def run_suite(cwd, python, pytest_args, busy):
    """One run of `python -m pytest`: (passed, summary line, failed test ids, seconds)."""
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(usable_cores() if busy else 0)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            [str(python), "-m", "pytest", "-rfE", *pytest_args],
            cwd=cwd,
            env=dict(os.environ, CI="true"),
            capture_output=True,
            text=True,
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    seconds = time.perf_counter() - t0
    lines = done.stdout.splitlines()
    failed = [line for line in lines if re.match(r"(FAILED|ERROR) ", line)]
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)), "")
    return done.returncode == 0, summary.strip("= "), failed, seconds, done.stdout[-3000:] + done.stderr[-2000:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet-runs", type=int, default=5)
    parser.add_argument("--busy-runs", type=int, default=5)
    parser.add_argument("--fresh", action="store_true", help="a fresh clone and venv, installed as the README says")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pmx_check_") as d:
        cwd, python = fresh_checkout(pathlib.Path(d)) if args.fresh else (ROOT, sys.executable)
        plan = ["quiet"] * args.quiet_runs + ["busy"] * args.busy_runs
        failures = 0
        print(f"{len(plan)} runs of `python -m pytest {' '.join(args.pytest_args)}` in {cwd}, {usable_cores()} cores")
        print(f"{'run':>3}  {'host':5}  {'s':>6}  result")
        for k, host in enumerate(plan, 1):
            ok, summary, failed, seconds, tail = run_suite(cwd, python, args.pytest_args, host == "busy")
            print(f"{k:>3}  {host:5}  {seconds:6.0f}  {summary or '(no summary line)'}", flush=True)
            for line in failed:
                print(f"           {line}")
            if not ok:
                failures += 1
                if not failed:
                    print(tail)
        print(f"{len(plan) - failures} of {len(plan)} runs passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
