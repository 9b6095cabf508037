"""Fixtures every test directory shares: the /dev/shm files DeepSpeed's CPU all-reduce leaves behind
(one per rank, never unlinked) are removed after each test, unless a live process still maps them
(the ranks of a launch of another test session on this machine): each launch makes its own."""

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
