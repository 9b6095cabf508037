"""Fixtures every test directory shares: the /dev/shm files DeepSpeed's CPU all-reduce leaves behind
(one per rank, never unlinked) are removed after each test, unless a live process still maps them
(the ranks of a launch of another test session on this machine): each launch makes its own.
With ``DS_OFFLOAD_FAILURES_LOG`` set (scripts/gpu.sh sets it), each failure's report is appended to
that file as the test ends, so a run cut off midway still says why its failures failed."""

import os
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer_"


def _shm_files():
    return set(SHM.glob(SHM_PREFIX + "*")) if SHM.is_dir() else set()


def _mapped() -> set:
    """The files of ours that a live process maps (read from /proc/<pid>/maps)."""
    used = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        used.update(Path(line.split(None, 5)[5]) for line in text.splitlines()
                    if SHM_PREFIX in line and len(line.split(None, 5)) == 6)
    return used


def remove_unused(paths):
    if paths:
        for path in set(paths) - _mapped():
            path.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def no_shm_left_behind():
    """After each test (and module-scoped launches, at the first test after them)."""
    yield
    remove_unused(_shm_files())


def pytest_runtest_logreport(report):
    """The controlling process only (pytest-xdist's workers forward their reports to it)."""
    path = os.environ.get("DS_OFFLOAD_FAILURES_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
