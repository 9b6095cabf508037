"""The four ops compile mode puts into DeepCompile's graphs, in this package's own namespace.

``torch.ops.ds_offload``::

    offload_launch(Tensor anchor, int engine, int idx) -> ()   head of the first forward graph, one per sub-group
    reload(Tensor anchor, int engine, int idx) -> ()           in backward, where the planner found room
    empty_cache(Tensor anchor, int engine) -> ()               head of the first forward graph; once per phase
    copy_stream_sync(Tensor anchor, int engine) -> ()          end of the last backward graph

Why ops and not Python closures in the graph: inductor can only compile, cache and order what has
a schema and a Meta kernel. Live tensors never cross the op boundary: ``engine`` is the key ``bind``
gave the compile mode attached to the graph's engine (several engines in one process each get their
own), ``idx`` the ZeRO-3 sub-group number, and ``anchor`` a tensor of the graph, there so the
dispatcher has something to route on (and, for reloads, to order them). Both numbers are the same
in every process that attaches its engines in the same order, because inductor and AOT autograd
cache compiled graphs across processes: a graph loaded from that cache must still name the same
engine and sub-group.

Nothing consumes the ops' outputs (they have none), so two dead-code eliminations would drop them:
FX's, which spares what is in ``_side_effectful_functions``, and inductor's, which spares ops with
a registered effect. Where the ops are traced (dynamo, AOT), the ORDERED effect threads a token
through them, which keeps them in program order. The pass inserts them into graphs after AOT, where
no token exists: there, each reload takes the output of the node it must follow as its anchor, a
data dependency that no reordering can cross.

``ds_offload`` is ours alone (DeepSpeed's C++ extension owns ``dc``), so the library is a DEF;
``register_ops`` is idempotent within a process.
"""

from typing import Dict, Optional

import torch

NAMESPACE = "ds_offload"

# name, schema, the mode's method it calls (with the task's sub-group where the op has an idx)
_SPECS = [
    ("offload_launch", "offload_launch(Tensor anchor, int engine, int idx) -> ()", "op_offload_launch"),
    ("reload", "reload(Tensor anchor, int engine, int idx) -> ()", "op_reload"),
    ("empty_cache", "empty_cache(Tensor anchor, int engine) -> ()", "op_empty_cache"),
    ("copy_stream_sync", "copy_stream_sync(Tensor anchor, int engine) -> ()", "op_copy_stream_sync"),
]

_runtimes: Dict[int, object] = {}  # bind() key -> the attached compile mode the ops call into
_next_key = 0
_lib: Optional[torch.library.Library] = None


def bind(runtime) -> int:
    """Register ``runtime`` (registering the ops first if needed); returns the key its graphs name."""
    global _next_key
    register_ops()
    key, _next_key = _next_key, _next_key + 1
    _runtimes[key] = runtime
    return key


def unbind(key: int):
    _runtimes.pop(key, None)


def _call(method: str, engine: int, idx: Optional[int]):
    runtime = _runtimes.get(engine)
    if runtime is None:
        raise RuntimeError(f"torch.ops.{NAMESPACE} ran for engine {engine}, which has no deepspeed-offload compile "
                           "mode attached: the graph was compiled for an engine that is gone")
    fn = getattr(runtime, method)
    return fn() if idx is None else fn(idx)


def _kernel(method: str, with_idx: bool):
    if with_idx:
        return lambda anchor, engine, idx: _call(method, engine, idx)
    return lambda anchor, engine: _call(method, engine, None)


def _meta(with_idx: bool):
    return (lambda anchor, engine, idx: None) if with_idx else (lambda anchor, engine: None)


def op(name: str):
    """The OpOverload of one of our ops (registering them first if needed)."""
    register_ops()
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def register_ops():
    global _lib
    if _lib is not None:
        return
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema, method in _SPECS:
        with_idx = "int idx" in schema
        lib.define(schema)
        lib.impl(name, _kernel(method, with_idx), "CompositeExplicitAutograd")
        lib.impl(name, _meta(with_idx), "Meta")
    for name, _, _ in _SPECS:
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default
        torch.fx.node._side_effectful_functions.add(overload)
        _register_effectful_op(overload, _EffectType.ORDERED)
    _lib = lib  # the ops live as long as this object does
