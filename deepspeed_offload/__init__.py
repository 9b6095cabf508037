"""deepspeed-offload: optimizer-state offload for DeepSpeed ZeRO-3.

The fp32 master weights and optimizer moments live in pinned host memory and pass through the GPU
only while the step needs them. Public API: ``initialize`` (drop-in for ``deepspeed.initialize``),
``attach`` (for an existing engine), ``get_handle``, ``wait_for_checkpoint``, ``ConfigError`` and ``OffloadConfig``.
"""

from .api import attach, get_handle, initialize
from .config import ConfigError, OffloadConfig
from .runtime.checkpoint import wait_for_checkpoint

__version__ = "0.1.0"
__all__ = ["initialize", "attach", "get_handle", "wait_for_checkpoint", "ConfigError", "OffloadConfig", "__version__"]
