"""``ConfigError``: every configuration this package refuses, raised before anything is changed.

On the ground floor (imports nothing of the package), so that every module can raise it, with the
block's name that every message uses."""

from pydantic import ValidationError

BLOCK = "optimizer_state_offload"


class ConfigError(ValueError):
    """A configuration that cannot work. ``path`` is the offending ds_config key, dotted."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")

    def __reduce__(self):
        # Rebuilt from (path, reason), so it crosses process boundaries (multiprocessing, pickle).
        return type(self), (self.path, self.reason)


def pydantic_error(err: ValidationError, prefix: str) -> ConfigError:
    """The first error of a pydantic validation as a ConfigError naming the dotted key."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    path = ".".join(p for p in (prefix, loc) if p)
    msg = e["msg"]
    if "input" in e and not isinstance(e["input"], (dict, list)):
        msg += f" (got {e['input']!r})"
    return ConfigError(path, msg)
