"""Every hook deepspeed-offload puts on a DeepSpeed (or framework) object, installed and removed in one place.

Stream mode wraps optimizer methods, the async checkpointer wraps engine methods, compile mode wraps
``engine.compile`` and ``install()`` wraps ``deepspeed.initialize``. Each of them goes through a
``PatchRegistry``: ``patch`` records what the attribute was (an instance attribute, or nothing, in
which case the class's method shows through again) and ``remove_all`` puts it back, newest first, so
that patches stacked on the same attribute unwind in the right order. Module hooks (stream mode's
forward pre-hooks) are kept as their handles (``hook``) and removed with the rest.
"""

from typing import Any, Callable, List, Tuple

_MISSING = object()


class PatchRegistry:

    def __init__(self, owner: str = "deepspeed-offload"):
        self.owner = owner
        self._applied: List[Tuple[Any, str, Any]] = []  # (object, attribute, what its __dict__ held)
        self._handles: List[Any] = []  # torch hook handles

    def patch(self, obj: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Replace ``obj.name`` by ``make(original)`` and return the original (the bound method or value
        in effect before this patch)."""
        original = getattr(obj, name)
        own = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        setattr(obj, name, make(original))
        self._applied.append((obj, name, own))
        return original

    def hook(self, handle) -> None:
        """Keep a torch hook's handle (``module.register_forward_pre_hook(...)``) for ``remove_all``."""
        self._handles.append(handle)

    def remove_all(self):
        """Undo every patch and remove every hook, newest first. Safe to call twice."""
        while self._handles:
            self._handles.pop().remove()
        while self._applied:
            obj, name, own = self._applied.pop()
            if own is _MISSING:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, own)

    def __len__(self):
        return len(self._applied) + len(self._handles)

    def __contains__(self, item) -> bool:
        obj, name = item
        return any(o is obj and n == name for o, n, _ in self._applied)
