"""Session set-up for the launcher tests: a private JIT build dir, DeepSpeed's CPU shm op built once
before any launch (so two ranks never race to build it, and no launch is killed mid-build), and the
/dev/shm files DeepSpeed's CPU all-reduce leaves behind removed after each test."""

import os
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import EXTENSIONS_DIR, stale_locks  # noqa: E402

# Set before any test runs, so that the launcher, its ranks and the README's commands inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
SHM = Path("/dev/shm")
SHM_GLOB = "deepspeed_allreduce_buffer_*"


@pytest.fixture(scope="session", autouse=True)
def jit_ops_built():
    if Path(os.environ["TORCH_EXTENSIONS_DIR"]) == EXTENSIONS_DIR:
        for lock in stale_locks():  # only a killed build of an earlier session leaves one here
            warnings.warn(f"removing a stale JIT build lock: {lock}")
            os.unlink(lock)
    from deepspeed.accelerator import get_accelerator
    import deepspeed.ops
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load()


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
