"""Compile mode: optimizer-state offload inside DeepCompile's schedule.

``ops`` (this package's ``torch.library`` ops: offload launch, reload, empty-cache, copy-stream
sync), ``planner`` (where backward reloads fit the memory budget, capacity-first), ``schedule``
(our pass and how ``engine.compile()`` comes to run it) and ``mode`` (the runtime the ops call:
stream mode's host store and streamed step, plus early reloads and late write-backs).

Compile mode stays behind ``DS_OFFLOAD_EXPERIMENTAL_COMPILE=1`` until it has passed its GPU
end-to-end parity run and benchmark (DeepCompile needs CUDA, so CI runs only its CPU parts):
without it, validation rejects compile mode with a clear error before an engine exists.
"""

import os
from typing import Tuple

EXPERIMENTAL_ENV = "DS_OFFLOAD_EXPERIMENTAL_COMPILE"


def available() -> Tuple[bool, str]:
    if os.environ.get(EXPERIMENTAL_ENV) == "1":
        return True, ""
    return False, ("compile mode is built but not yet validated on a GPU in this release: use mode 'stream' "
                   f"(or turn compile.deepcompile off), or set {EXPERIMENTAL_ENV}=1 to try it")


def attach_compile(engine, offload_config):
    """Compile mode on ``engine`` (before ``engine.compile()``): the runtime, and our pass in the
    schedule ``engine.compile()`` will run. Returns the handle."""
    from .mode import CompileMode
    from .schedule import install
    mode = CompileMode(engine, offload_config)
    install(engine, mode)
    return mode
