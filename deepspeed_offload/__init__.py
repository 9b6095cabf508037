"""deepspeed-offload: optimizer-state offload for DeepSpeed ZeRO-3.

The fp32 master weights and optimizer moments live in pinned host memory and pass through the GPU
only while the step needs them. Public API: ``initialize`` (drop-in for ``deepspeed.initialize``),
``attach`` (for an existing engine), ``install``/``uninstall`` (every ``deepspeed.initialize`` of the
process applies the block: how the HF Trainer, Accelerate and Lightning get it), ``get_handle``,
``wait_for_checkpoint``/``checkpoint_pending`` (and the checkpoint errors), ``finish`` (the end of a
distributed run), ``ConfigError`` and ``OffloadConfig``.
"""

from . import compat
from .api import attach, get_handle, initialize
from .config import ConfigError, OffloadConfig
from .install import install, is_installed, uninstall
from .teardown import finish
from .runtime.checkpoint import CheckpointLoadError, CheckpointWriteError, checkpoint_pending, wait_for_checkpoint

__version__ = "0.1.0"
__all__ = [
    "initialize", "attach", "install", "uninstall", "is_installed", "get_handle", "finish", "wait_for_checkpoint",
    "checkpoint_pending", "CheckpointWriteError", "CheckpointLoadError", "ConfigError", "OffloadConfig", "__version__"
]
