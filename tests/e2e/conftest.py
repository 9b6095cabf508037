"""Session set-up for the launcher tests: a private JIT build dir, and DeepSpeed's CPU shm op built
once before any launch (so two ranks never race to build it, and no launch is killed mid-build).
The /dev/shm files it leaves behind are removed by tests/conftest.py."""

import os
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import EXTENSIONS_DIR, stale_locks  # noqa: E402

# Set before any test runs, so that the launcher, its ranks and the README's commands inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))


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
