"""Building test ds_configs: a copy of a base config with some keys set or removed."""

import copy


def with_paths(base, **paths):
    """Copy of ``base`` with dotted-path keys set (``zero_optimization__stage=2``); None deletes."""
    cfg = copy.deepcopy(base)
    for dotted, value in paths.items():
        keys = dotted.split("__")
        d = cfg
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        if value is None:
            d.pop(keys[-1], None)
        else:
            d[keys[-1]] = value
    return cfg
