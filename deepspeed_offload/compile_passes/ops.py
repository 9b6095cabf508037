"""The four ops compile mode puts into DeepCompile's graphs, in this package's own namespace.

``torch.ops.ds_offload``::

    offload_launch(Tensor anchor, int idx) -> ()   head of the first forward graph, one per sub-group
    reload(Tensor anchor, int idx) -> ()           in backward, where the planner found room
    empty_cache(Tensor anchor) -> ()               head of the first forward graph; acts once per phase
    copy_stream_sync(Tensor anchor) -> ()          end of the last backward graph

Why ops and not Python closures in the graph: inductor can only compile, cache and order what has
a schema and a Meta kernel. Live tensors never cross the op boundary: ``idx`` indexes the attached
mode's table of offloaded sub-groups (the ZeRO-3 sub-group number), and ``anchor`` is a tensor
of the graph, there so the dispatcher has something to route on (and, for reloads, to order them).
The work itself is done by the attached mode (``bind``). The index is the sub-group's own number,
not a position in a per-process list, because inductor and AOT autograd cache compiled graphs
across processes: a graph loaded from that cache must still name the same sub-group.

Nothing consumes the ops' outputs (they have none), so two dead-code eliminations would drop them:
FX's, which spares what is in ``_side_effectful_functions``, and inductor's, which spares ops with
a registered effect. Where the ops are traced (dynamo, AOT), the ORDERED effect threads a token
through them, which keeps them in program order. The pass inserts them into graphs after AOT, where
no token exists: there, each reload takes the output of the node it must follow as its anchor, a
data dependency that no reordering can cross.

``ds_offload`` is ours alone (DeepSpeed's C++ extension owns ``dc``), so the library is a DEF;
``register_ops`` is idempotent within a process.
"""

from typing import Optional

import torch

NAMESPACE = "ds_offload"

# name, schema, the mode's method it calls (with the task's sub-group where the op has an idx)
_SPECS = [
    ("offload_launch", "offload_launch(Tensor anchor, int idx) -> ()", "op_offload_launch"),
    ("reload", "reload(Tensor anchor, int idx) -> ()", "op_reload"),
    ("empty_cache", "empty_cache(Tensor anchor) -> ()", "op_empty_cache"),
    ("copy_stream_sync", "copy_stream_sync(Tensor anchor) -> ()", "op_copy_stream_sync"),
]

_runtime = None  # the attached compile mode; the ops call into it
_lib: Optional[torch.library.Library] = None


def bind(runtime):
    global _runtime
    _runtime = runtime


def unbind(runtime):
    global _runtime
    if _runtime is runtime:
        _runtime = None


def _call(method: str, idx: Optional[int]):
    if _runtime is None:
        raise RuntimeError(f"torch.ops.{NAMESPACE} ran with no deepspeed-offload compile mode attached: "
                           "the graph was compiled for an engine that is gone")
    fn = getattr(_runtime, method)
    return fn() if idx is None else fn(idx)


def _kernel(method: str, with_idx: bool):
    if with_idx:
        return lambda anchor, idx: _call(method, idx)
    return lambda anchor: _call(method, None)


def _meta(with_idx: bool):
    return (lambda anchor, idx: None) if with_idx else (lambda anchor: None)


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
