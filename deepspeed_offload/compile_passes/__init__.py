"""Compile mode: optimizer-state offload inside DeepCompile's schedule.

``ops`` (this package's ``torch.library`` ops: offload launch, reload, empty-cache, copy-stream
sync), ``planner`` (where backward reloads fit the memory budget, capacity-first), ``schedule``
(our pass and how ``engine.compile()`` comes to run it) and ``mode`` (the runtime the ops call:
stream mode's host store and streamed step, plus early reloads and late write-backs).

DeepCompile needs CUDA, so CI runs only the CPU parts (the ops through inductor, the planner, the
pass on real AOT graphs, the runtime bit for bit on two CPU ranks); tests/e2e/test_compile_parity.py
runs the whole of it under DeepCompile on a GPU.
"""


import weakref

# The engine whose pass is in DeepSpeed's pass table: DeepCompile keeps one table and one schedule
# per process (``deepspeed.compile.backend``), so a second engine's pass would replace the first's
# and the first engine's next compile phase would act on the second one's host store.
_engine_with_pass = None


def engine_with_pass():
    """The live engine of this process that compile mode is attached to, or None."""
    from ..handle import get_handle
    engine = _engine_with_pass() if _engine_with_pass is not None else None
    return engine if engine is not None and get_handle(engine) is not None else None


def check_engine(engine):
    """Compile mode's refusals, before anything changes (attach's ``check``)."""
    from ..errors import BLOCK, ConfigError
    if engine.is_compiled:
        raise ConfigError(f"{BLOCK}.mode", "the engine is already compiled: attach compile mode before "
                          "engine.compile(), or use deepspeed_offload.initialize")
    other = engine_with_pass()
    if other is not None and other is not engine:
        raise ConfigError(f"{BLOCK}.mode", "compile mode is attached to another engine of this process already: "
                          "DeepCompile keeps one pass table and one schedule per process, so a second engine's "
                          "pass would replace the first's. Use mode 'stream' for this engine, or detach the "
                          "other first (deepspeed_offload.get_handle(engine).detach())")


def attach_compile(engine, offload_config, placement=None, probe=None):
    """Compile mode on ``engine`` (before ``engine.compile()``): the runtime, and our pass in the
    schedule ``engine.compile()`` will run. Returns the handle (the stream mode the driver composes,
    its ``compile`` the driver); on a failure nothing is left."""
    global _engine_with_pass
    from ..runtime.attach import fault_point
    from .mode import CompileMode
    from .schedule import install
    mode = CompileMode(engine, offload_config, placement, probe)
    try:
        install(engine, mode)
        fault_point("compile setup")
    except BaseException:
        mode.stream.undo_attach()
        raise
    _engine_with_pass = weakref.ref(engine)
    return mode.stream
