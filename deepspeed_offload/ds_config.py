"""Reading a ds_config the way ``deepspeed.initialize`` accepts it: a dict, a JSON (or hjson) file,
or base64-encoded JSON, from ``config=``, ``config_params=`` or ``args.deepspeed_config``. A file
that cannot be read or does not parse is a ConfigError that says why and where."""

import base64
import binascii
import json
import os
from typing import Any, Dict

import hjson

from .errors import ConfigError



def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise ConfigError(k, "appears twice in one object of the ds_config (DeepSpeed refuses that too)")
    return dict(pairs)


def _parse(text: str, where: str) -> Dict[str, Any]:
    if not text.strip():
        raise ConfigError(where, "is empty: a ds_config is a JSON object, e.g. {\"train_micro_batch_size_per_gpu\": 1, "
                          "\"zero_optimization\": {\"stage\": 3}}")
    try:
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as strict_err:
            bad_json = ConfigError(where, f"not valid JSON at line {strict_err.lineno}, column {strict_err.colno}: "
                                   f"{strict_err.msg}")
            try:  # DeepSpeed reads configs with hjson (comments, unquoted keys): strict JSON first, for the position
                data = hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
            except hjson.HjsonDecodeError:
                raise bad_json from None
            if not isinstance(data, dict):  # hjson reads any bare text as a string: report it as the JSON it is not
                raise bad_json from None
    except RecursionError:
        raise ConfigError(where, "is nested deeper than Python's parser can follow: not a ds_config") from None
    if not isinstance(data, dict):
        raise ConfigError(where, f"a ds_config must be a JSON object, this is a {type(data).__name__}")
    return data


def _read_file(path) -> Dict[str, Any]:
    where = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(where, "is a directory: give the path of the ds_config JSON file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(where, f"cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(where, f"is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}): "
                          "a ds_config is a JSON file") from None
    return _parse(text, where)


def load_ds_config(config) -> Dict[str, Any]:
    """Read a ds_config the way ``deepspeed.initialize`` accepts it: a dict, a path to a JSON (or
    hjson) file, or a base64-encoded JSON string. A file that cannot be read or does not parse is a
    ConfigError that says why (and where it broke)."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        return _read_file(config)
    if isinstance(config, str):
        try:
            text = base64.urlsafe_b64decode(config).decode("utf-8")
            return _parse(text, "config (base64)")
        except (binascii.Error, ValueError):  # UnicodeDecodeError and ConfigError are ValueErrors
            raise ConfigError("config", f"{config!r} is neither an existing file, a dict, nor base64-encoded "
                              "JSON") from None
    raise ConfigError("config", f"expected a dict, a path to a JSON file or base64 JSON, got {type(config).__name__}")


def resolve_config_source(args=None, config=None, config_params=None):
    """Pick the ds_config among ``deepspeed.initialize``'s three routes, with its precedence."""
    if config is None and config_params is not None:
        config = config_params
    for attr in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, attr, None)
        if value is not None:
            if config is not None:
                raise ConfigError(f"args.{attr}", "a ds_config was given both in args and as config=; pass one")
            config = value
    if config is None:
        raise ConfigError("config", "no ds_config given: pass config= or --deepspeed_config")
    return config


def get_path(d: Dict[str, Any], path: str, default=None):
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d
