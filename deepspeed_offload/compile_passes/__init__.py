"""Compile mode: optimizer-state offload inside DeepCompile's schedule.

Owns this package's ``torch.library`` ops (offload launch, reload, empty-cache, copy-stream sync),
the capacity-first planner that places reloads in backward within the memory budget, and the
wiring of our pass into ``engine.compile()``'s schedule. What is still on the host when backward
ends goes through the same host store and streamed step as stream mode (deepspeed_offload.runtime).

Not built yet: ``AVAILABLE`` is False, and validation rejects compile mode before an engine exists.
"""

AVAILABLE = False


def attach_compile(engine, offload_config):
    raise NotImplementedError("deepspeed-offload compile mode is not available in this release")
