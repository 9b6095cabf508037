"""The caching allocator's ``expandable_segments``, held on while stream mode moves state on a GPU.

Without it, the CUDA caching allocator reserves a new segment wherever no free piece of the segments
it holds is large enough, and the free pieces stay reserved. The measured plan (``placement.py``)
decides on reserved memory, so those pieces are room it gives up: a 7B whose state was split kept 29
to 40 sub-groups resident instead of 45 to 47, and ran 10% slower (docs/benchmarks.md). The early
loads, at every budget, keep within an allocated peak that the measured iteration reached; the
pieces are what reserved memory adds to it (3.4-3.6 GiB at 7B with everything on the host), so a
fixed budget has less headroom than the plan without it. With expandable segments the allocator
maps memory into its segments as they grow and there are no such pieces. The setting can change
while the process runs (what is already reserved stays as it is); so stream mode turns it on at
attach where its early loads are measured on a CUDA device (every budget; the measured plan's too),
and off again when the last mode that turned it on detaches, each time passing the allocator's other
settings along (torch puts those a new setting does not name back to their defaults).

The process's environment decides where it names the setting (``PYTORCH_ALLOC_CONF``,
``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_HIP_ALLOC_CONF``: ``expandable_segments:True`` or
``:False``): the job's operator chose. The block's ``expandable_segments: false`` leaves the allocator
alone (a process that also runs vLLM's memory pools, which refuse expandable segments).
"""

import logging
import os
from typing import Callable, List, Mapping, Optional, Tuple

import torch
from deepspeed.utils import log_dist

# The caching allocator's settings, under each name torch reads (which one wins depends on the torch version).
ALLOC_CONF_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def expandable_segments_env(environ: Mapping[str, str] = os.environ) -> Optional[bool]:
    """What the environment sets ``expandable_segments`` to, under any of the names in ``ALLOC_CONF_ENV``
    (True where any of them turns it on); None where none names it."""
    found = None
    for name in ALLOC_CONF_ENV:
        for key, value in _options(environ.get(name, "")):
            if key == "expandable_segments":
                found = found or value.strip().lower() == "true"
    return found


def _options(settings: str) -> List[Tuple[str, str]]:
    """``key:value`` options of an allocator setting, in order (a bracketed list's commas kept in its value)."""
    out, depth = [], 0
    for piece in settings.split(","):
        if depth and out:
            out[-1] = (out[-1][0], out[-1][1] + "," + piece)
        elif piece.strip():
            key, _, value = piece.partition(":")
            out.append((key.strip(), value))
        depth += piece.count("[") - piece.count("]")
    return out


def _current_settings(environ: Mapping[str, str] = os.environ) -> str:
    """The settings the allocator runs with: torch's own record where it keeps one (torch >= 2.9, which
    reads ``PYTORCH_ALLOC_CONF`` first), else what torch read from the environment."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return getter()
    names = ALLOC_CONF_ENV if hasattr(torch._C, "_accelerator_setAllocatorSettings") else ALLOC_CONF_ENV[1:]
    return next((environ[name] for name in names if environ.get(name)), "")


def with_expandable_segments(settings: str, on: bool) -> str:
    """``settings`` with ``expandable_segments`` set to ``on``. Torch parses each new setting whole and
    puts ``max_split_size_mb``, ``roundup_power2_divisions`` and ``garbage_collection_threshold`` back to
    their defaults where it does not name them: the process's other settings go along."""
    kept = [f"{key}:{value}" for key, value in _options(settings) if key != "expandable_segments"]
    return ",".join(kept + [f"expandable_segments:{on}"])


def _torch_setter(settings: str):
    """Parse ``settings`` as the allocator's settings now (what is already reserved stays as it is)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


class ExpandableSegments:
    """The process's one switch: the first ``hold`` turns the setting on, the last ``release`` off, each
    time with the allocator's other settings as they were. Turning it on or off is an optimization, never
    a reason for attach or detach to fail: where torch refuses, a warning says so and the allocator stays
    as it was."""

    def __init__(self, setter: Callable[[str], None] = _torch_setter, current: Callable[[], str] = _current_settings):
        self.setter, self.current = setter, current
        self.holders, self.base = 0, ""

    def hold(self) -> bool:
        """Turn it on (the first holder) or count one more; False where torch refused (nothing held)."""
        if self.holders == 0:
            try:
                self.base = self.current()
                self.setter(with_expandable_segments(self.base, True))
            except Exception as e:  # (an allocator that does not know the setting, say)
                _warn(f"could not turn the caching allocator's expandable_segments on ({e}); it stays as it was")
                return False
        self.holders += 1
        return True

    def release(self):
        if self.holders == 0:
            return
        self.holders -= 1
        if self.holders == 0:
            try:
                self.setter(with_expandable_segments(self.base, False))
            except Exception as e:
                _warn(f"could not turn the caching allocator's expandable_segments off again ({e})")

    def on(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Whether the allocator maps memory into expandable segments (the environment's, or held here)."""
        return bool(expandable_segments_env(environ)) or self.holders > 0


SWITCH = ExpandableSegments()


def wanted(block_value: bool, device_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a mode whose measured plan runs on ``device_name`` turns the setting on: the block allows
    it, the device is CUDA's (not ROCm's), the environment does not name it, and the caching allocator is
    the one in use (not ``backend:cudaMallocAsync``)."""
    return block_value and device_name == "cuda" and not _rocm() and expandable_segments_env(environ) is None \
        and not any(dict(_options(environ.get(name, ""))).get("backend", "").strip() == "cudaMallocAsync"
                    for name in ALLOC_CONF_ENV)


def _rocm() -> bool:  # (its allocator's expandable segments are not measured here)
    return torch.version.hip is not None


def hold_for(mode, switch: ExpandableSegments = SWITCH):
    """Where ``wanted``: the setting on until ``mode`` detaches (or its attach is undone); one hold per
    mode, however often its plan is made."""
    if getattr(mode, "holds_expandable_segments", False) or \
            not wanted(mode.cfg.expandable_segments, mode.acc.device_name()):
        return
    if not switch.hold():
        return
    mode.holds_expandable_segments = True

    def release():
        mode.holds_expandable_segments = False
        switch.release()

    mode.on_detach(release)
    log_dist("[deepspeed-offload] stream mode: the caching allocator maps memory into expandable segments "
             "until detach, so that free pieces of its segments do not take the room of resident state and "
             "early loads "
             "(the block's expandable_segments: false, or PYTORCH_CUDA_ALLOC_CONF naming the setting, "
             "leaves the allocator as it is)", ranks=[0])


def _warn(message: str):
    log_dist(f"[deepspeed-offload] {message}", ranks=[0], level=logging.WARNING)
