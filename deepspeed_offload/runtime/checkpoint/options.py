"""What a checkpointer is configured with: the user's timeouts, and the faults a test injects.

``Settings`` are read from the environment when a checkpointer is created (documented in
docs/usage.md), so a script may set them before it builds its engine. ``Faults`` exist for tests
only: the library injects none unless a test hands one to the checkpointer (``faults=`` or
``checkpointer.faults = ...``); launched test scripts build theirs from their own spec.
"""

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from ...env_settings import read_env


@dataclass(frozen=True)
class Settings:
    """How long rank 0 waits for the other ranks' files, and how it tells a dead rank from a slow one."""

    commit_timeout_s: float = 600.0  # DS_OFFLOAD_COMMIT_TIMEOUT: a rank alive but never finishing
    heartbeat_interval_s: float = 0.5  # DS_OFFLOAD_HEARTBEAT_INTERVAL: how often a writer touches its heartbeat
    heartbeat_timeout_s: float = 10.0  # DS_OFFLOAD_HEARTBEAT_TIMEOUT: a heartbeat this stale is a dead rank

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """From the ``DS_OFFLOAD_*`` variables (env_settings.py: a bad value is a ConfigError naming it)."""
        env = read_env(environ)
        return cls(commit_timeout_s=env.commit_timeout, heartbeat_interval_s=env.heartbeat_interval,
                   heartbeat_timeout_s=env.heartbeat_timeout)


@dataclass(frozen=True)
class Faults:
    """Test hooks into a checkpointer's saves. The default changes nothing."""

    # False: the step does not wait for serialization, to show the race the guard prevents.
    guard: bool = True
    # Called with each file's final path before it is serialized, and again before its rename (a
    # test makes a write slow enough to race with or to kill, or fails it).
    before_file: Optional[Callable[[str], None]] = None
    # Rank 0, called with the SaveJob once this rank's files are published, before the commit waits
    # for the other ranks (a test holds or fails the commit).
    before_commit: Optional[Callable[[object], None]] = None
    # True/False: copy the host store's tensors aside, or write them from the store, whatever the
    # host memory (None: as it allows; staging.py).
    copy_aside: Optional[bool] = None
    # Called with the tag on each rank once its files are staged, before the ranks agree that the save
    # goes to the writers (a test fails one rank's staging).
    staged: Optional[Callable[[str], None]] = None


NO_FAULTS = Faults()
