"""Compile mode: optimizer-state offload inside DeepCompile's schedule.

``ops`` (this package's ``torch.library`` ops: offload launch, reload, empty-cache, copy-stream
sync), ``planner`` (where backward reloads fit the memory budget, capacity-first), ``schedule``
(our pass and how ``engine.compile()`` comes to run it) and ``mode`` (the runtime the ops call:
stream mode's host store and streamed step, plus early reloads and late write-backs).

DeepCompile needs CUDA, so CI runs only the CPU parts (the ops through inductor, the planner, the
pass on real AOT graphs, the runtime bit for bit on two CPU ranks); tests/e2e/test_compile_parity.py
runs the whole of it under DeepCompile on a GPU.
"""


def attach_compile(engine, offload_config):
    """Compile mode on ``engine`` (before ``engine.compile()``): the runtime, and our pass in the
    schedule ``engine.compile()`` will run. Returns the handle."""
    from .mode import CompileMode
    from .schedule import install
    mode = CompileMode(engine, offload_config)
    install(engine, mode)
    return mode
