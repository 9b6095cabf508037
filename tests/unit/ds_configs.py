"""Building test ds_configs: the smallest config that enables the block (``GOOD``), and copies of a
base config with some keys set or removed (``with_``)."""

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


GOOD = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
    "optimizer_state_offload": {"enabled": True},
}


def with_(base=GOOD, **paths):
    """Copy of ``base`` (GOOD) with dotted-path keys set (``zero_optimization__stage=2``); None deletes."""
    return with_paths(base, **paths)
