"""default_thread_count(): OMP_NUM_THREADS, else the usable cores capped by the cgroup CPU
quota rounded up. The cgroup files are fake trees under tmp_path; the affinity and the
environment are monkeypatched inside each test only."""

import functools
import os

import pytest

from pmx.runtime import options

REAL_LIMIT = options.cgroup_cpu_limit


@pytest.fixture
def fake(tmp_path):
    """fake(proc_text, {relative path under the cgroup root: text}) -> the paths, as keyword
    arguments of cgroup_cpu_limit."""

    def build(proc_text, files=None):
        paths = {"proc_cgroup": str(tmp_path / "proc_cgroup"), "root": str(tmp_path / "cgroup")}
        (tmp_path / "proc_cgroup").write_text(proc_text)
        (tmp_path / "cgroup").mkdir(exist_ok=True)
        for rel, text in (files or {}).items():
            target = tmp_path / "cgroup" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return paths

    return build


@pytest.fixture
def threads(monkeypatch):
    """threads(paths, cores=16) -> default_thread_count() with `cores` usable cores and the
    cgroup files at `paths`."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def count(paths, cores=16):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        monkeypatch.setattr(options, "cgroup_cpu_limit", functools.partial(REAL_LIMIT, **paths))
        return options.default_thread_count()

    return count


def v2(fake, cpu_max, path="/"):
    return fake(f"0::{path}\n", {"cpu.max": cpu_max})


def v1(fake, quota, period="100000", proc_path="/docker/abc", under="cpu,cpuacct/docker/abc"):
    return fake(
        f"12:pids:{proc_path}\n4:cpu,cpuacct:{proc_path}\n1:name=systemd:{proc_path}\n",
        {f"{under}/cpu.cfs_quota_us": quota, f"{under}/cpu.cfs_period_us": period},
    )


@pytest.mark.parametrize(
    "version, quota, cpus, want",
    [
        ("v2", "150000 100000\n", 1.5, 2),  # 1.5 CPUs at the namespace root: rounded up
        ("v2", "100000 100000\n", 1.0, 1),
        ("v2", "max 100000\n", None, 16),  # no limit: the 16 usable cores
        ("v2", "50000 100000\n", 0.5, 1),
        ("v1", "50000\n", 0.5, 1),
        ("v1", "-1\n", None, 16),
    ],
)
def test_quota_to_thread_count(fake, threads, version, quota, cpus, want):
    paths = (v2 if version == "v2" else v1)(fake, quota)
    assert REAL_LIMIT(**paths) == cpus
    assert threads(paths, cores=16) == want


def test_v2_nested_limits_smallest_counts(fake, threads):
    paths = fake(
        "0::/kubepods/pod1/ctr\n",
        {
            "cpu.max": "max 100000\n",
            "kubepods/cpu.max": "400000 100000\n",
            "kubepods/pod1/cpu.max": "100000 100000\n",
            "kubepods/pod1/ctr/cpu.max": "max 100000\n",
        },
    )
    assert REAL_LIMIT(**paths) == 1.0
    assert threads(paths, cores=16) == 1


def test_v1_path_missing_under_mount_uses_mount_root(fake, threads):
    # a container without a cgroup namespace shows the host's path; its own cgroup is the mount
    paths = v1(fake, "300000\n", proc_path="/docker/abc", under="cpu")
    assert not os.path.exists(os.path.join(paths["root"], "cpu", "docker"))
    assert REAL_LIMIT(**paths) == 3.0
    assert threads(paths, cores=16) == 3


def test_v1_nested_limits_smallest_counts(fake):
    paths = fake(
        "4:cpu,cpuacct:/a/b\n",
        {
            "cpu,cpuacct/a/cpu.cfs_quota_us": "150000",
            "cpu,cpuacct/a/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/a/b/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/a/b/cpu.cfs_period_us": "100000",
        },
    )
    assert REAL_LIMIT(**paths) == 1.5


def test_hybrid_smaller_of_v1_and_v2(fake):
    # systemd's hybrid layout: cpu on v1, a v2 hierarchy beside it; either may hold the limit
    paths = fake(
        "1:cpu:/\n0::/\n",
        {"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000", "cpu.max": "100000 100000"},
    )
    assert REAL_LIMIT(**paths) == 1.0


@pytest.mark.parametrize(
    "cpu_max", ["garbage", "", "150000 0", "0 100000", "-5 100000", "150000", "1.5 1", "150000 100000 7", "\x00\xff"]
)
def test_malformed_v2_is_no_limit(fake, threads, cpu_max):
    paths = v2(fake, cpu_max)
    assert REAL_LIMIT(**paths) is None
    assert threads(paths, cores=16) == 16


@pytest.mark.parametrize(
    "quota, period", [("abc", "100000"), ("", ""), ("50000", "0"), ("50000", "-100000"), ("50000", "x")]
)
def test_malformed_v1_is_no_limit(fake, threads, quota, period):
    paths = v1(fake, quota, period)
    assert REAL_LIMIT(**paths) is None
    assert threads(paths, cores=16) == 16


@pytest.mark.parametrize("proc_text", ["", "garbage\n", "0::\n", "::::\n", "4:cpu\n"])
def test_malformed_proc_cgroup_is_no_limit(fake, threads, proc_text):
    paths = fake(proc_text, {"cpu.max": "max 100000"})
    assert REAL_LIMIT(**paths) is None
    assert threads(paths, cores=16) == 16


def test_missing_files_are_no_limit(tmp_path, threads):
    paths = {"proc_cgroup": str(tmp_path / "absent"), "root": str(tmp_path / "absent_root")}
    assert REAL_LIMIT(**paths) is None
    assert threads(paths, cores=16) == 16


def test_omp_num_threads_wins_over_quota(fake, threads, monkeypatch):
    paths = v2(fake, "100000 100000")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads(paths, cores=16) == 3


@pytest.mark.parametrize("value", ["0", "-2", "junk", "", " "])
def test_omp_num_threads_not_positive_is_ignored(fake, threads, monkeypatch, value):
    paths = v2(fake, "100000 100000")
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert threads(paths, cores=16) == 1


def test_affinity_smaller_than_quota_wins(fake, threads):
    paths = v2(fake, "800000 100000")
    assert threads(paths, cores=2) == 2


def test_cpu_count_where_no_affinity(fake, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    paths = v2(fake, "250000 100000")
    monkeypatch.setattr(options, "cgroup_cpu_limit", functools.partial(REAL_LIMIT, **paths))
    assert options.default_thread_count() == 3


def test_an_inference_session_in_a_one_cpu_container_defaults_to_one_thread(fake, threads, tmp_path):
    """What a user in a container limited to 1 CPU on a 16-core host gets: one thread,
    and no worker thread started."""
    import threading

    import numpy as np
    from ziputil import write_bin

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    assert threads(v2(fake, "100000 100000\n"), cores=16) == 1
    param, pmx = tmp_path / "m.pnnx.param", tmp_path / "m.pmx"
    param.write_text(
        "7767517\n3 2\npnnx.Input in0 0 1 x #x=(4,8)f32\n"
        "F.relu relu 1 1 x y #x=(4,8)f32 #y=(4,8)f32\npnnx.Output out0 1 0 y\n"
    )
    write_bin(tmp_path / "m.pnnx.bin", {})
    compile_model(str(param), str(tmp_path / "m.pnnx.bin"), str(pmx))
    workers_before = sum(t.name == "pmx-worker" for t in threading.enumerate())
    sess = InferenceSession(str(pmx))
    assert sess.get_session_options().intra_op_num_threads == 1
    sess.run(None, {"in0": np.ones((4, 8), np.float32)})
    assert sum(t.name == "pmx-worker" for t in threading.enumerate()) == workers_before
