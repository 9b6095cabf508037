"""Every hook deepspeed-offload puts on a DeepSpeed (or framework) object, installed and removed in one place.

Stream mode wraps optimizer methods, the async checkpointer wraps engine methods, compile mode wraps
``engine.compile`` and ``install()`` wraps ``deepspeed.initialize``. Each of them goes through a
``PatchRegistry``: ``patch`` records what the attribute was (an instance attribute, or nothing, in
which case the class's method shows through again) and ``remove_all`` puts it back, newest first, so
that patches stacked on the same attribute unwind in the right order.
"""

from typing import Any, Callable, List, Tuple

_MISSING = object()


class PatchRegistry:

    def __init__(self, owner: str = "deepspeed-offload"):
        self.owner = owner
        self._applied: List[Tuple[Any, str, Any]] = []  # (object, attribute, what its __dict__ held)

    def patch(self, obj: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Replace ``obj.name`` by ``make(original)`` and return the original (the bound method or value
        in effect before this patch)."""
        original = getattr(obj, name)
        own = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        setattr(obj, name, make(original))
        self._applied.append((obj, name, own))
        return original

    def remove_all(self):
        """Undo every patch, newest first. Safe to call twice."""
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
        return len(self._applied)

    def __contains__(self, item) -> bool:
        obj, name = item
        return any(o is obj and n == name for o, n, _ in self._applied)
