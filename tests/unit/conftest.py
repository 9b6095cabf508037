"""Shared fixtures of the unit tests: a faked host (``/proc/meminfo``, the cgroup files, sysfs)
that every reader of host memory sees."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepspeed_offload.sizing import host_memory  # noqa: E402

GiB = 2**30


def write_host(root: Path, total: int, available: int, cgroup_limit=None, cgroup_usage=0, cgroup_version=2):
    """A fake ``/``: /proc/meminfo with ``total`` and ``available`` bytes, and a memory cgroup."""
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/meminfo").write_text(f"MemTotal:       {total // 1024} kB\nMemFree:        1 kB\n"
                                       f"MemAvailable:   {available // 1024} kB\n")
    if cgroup_version == 2:
        (root / "proc/self/cgroup").write_text("0::/job.slice/job-1\n")
        cg = root / "sys/fs/cgroup/job.slice/job-1"
        cg.mkdir(parents=True, exist_ok=True)
        (cg / "memory.max").write_text("max\n" if cgroup_limit is None else f"{cgroup_limit}\n")
        (cg / "memory.current").write_text(f"{cgroup_usage}\n")
    else:
        (root / "proc/self/cgroup").write_text("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n")
        cg = root / "sys/fs/cgroup/memory/docker/abc"
        cg.mkdir(parents=True, exist_ok=True)
        (cg / "memory.limit_in_bytes").write_text(f"{cgroup_limit if cgroup_limit is not None else 2**63 - 4096}\n")
        (cg / "memory.usage_in_bytes").write_text(f"{cgroup_usage}\n")
    return root


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """``fake_host(total=..., available=..., cgroup_limit=..., cgroup_usage=...)``: from then on every
    ``HostMemory.read()`` (check, estimate, initialize, the host store) reads that host."""
    read = host_memory.HostMemory.read.__func__

    def make(total=16 * GiB, available=12 * GiB, **cgroup):
        root = write_host(tmp_path / "host", total, available, **cgroup)
        monkeypatch.setattr(host_memory.HostMemory, "read", classmethod(lambda cls, r=None: read(cls, str(root))))
        return root

    return make
