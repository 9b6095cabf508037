"""Fixtures every test directory shares: the /dev/shm files DeepSpeed's CPU all-reduce leaves behind
(one per rank, never unlinked) are removed after each test that made them."""

from pathlib import Path

import pytest

SHM = Path("/dev/shm")
SHM_GLOB = "deepspeed_allreduce_buffer_*"


def _shm_files():
    return set(SHM.glob(SHM_GLOB)) if SHM.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def shm_before_session():
    before = _shm_files()
    yield before
    for path in _shm_files() - before:
        path.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def no_shm_left_behind(shm_before_session):
    """After each test (and module-scoped launches, at the first test after them)."""
    yield
    for path in _shm_files() - shm_before_session:
        path.unlink(missing_ok=True)
