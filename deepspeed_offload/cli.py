"""The ``deepspeed-offload`` console script.

``check`` validates a ds_config exactly as ``initialize`` would (same code path, nothing created)
and says in one line what would happen; exit 2 with the ConfigError on stderr otherwise.
"""

import argparse
import sys

from .config import (BLOCK, STATE_BYTES_PER_PARAM, ConfigError, check_host_memory, format_bytes, load_ds_config,
                     validate)


def cmd_check(ns) -> int:
    try:
        ds_config = load_ds_config(ns.config)
        plan = validate(ds_config)
        host_line = ""
        if plan is not None and ns.params:
            world = ns.world_size
            per_rank = -(-ns.params // world) * STATE_BYTES_PER_PARAM
            check_host_memory(per_rank * ns.ranks_per_node, what=f"{ns.ranks_per_node} rank(s) on this node")
            host_line = f", host memory {format_bytes(per_rank)} per rank"
    except ConfigError as e:
        print(f"deepspeed-offload: {ns.config}: {e}", file=sys.stderr)
        return 2
    if plan is None:
        print(f"{ns.config}: OK; {BLOCK} absent or disabled: plain DeepSpeed, nothing offloaded")
        return 0
    o = plan.offload
    origin = "from sub_group_mb" if plan.sub_group_size_set_by_us else "set by zero_optimization"
    budget = "derived from the device" if o.memory_budget_gb is None else f"{o.memory_budget_gb:g} GiB"
    print(f"{ns.config}: OK; mode {plan.mode}, sub_group_size {plan.sub_group_size} elements ({origin}), "
          f"pin_memory {o.pin_memory}, prefetch {o.prefetch}, resident budget {budget}{host_line}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepspeed-offload",
                                     description="Optimizer-state offload for DeepSpeed ZeRO-3.")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check",
                           help="validate a ds_config",
                           description="Validate a ds_config as deepspeed_offload.initialize would. Exit 0 with a "
                           "one-line summary, or exit 2 with the offending key path and the reason on stderr.")
    check.add_argument("config", help="path to the ds_config JSON")
    check.add_argument("--params", type=int, default=0, help="model parameters, to size the host store per rank")
    check.add_argument("--world-size", type=int, default=1, help="data-parallel ranks sharing the state")
    check.add_argument("--ranks-per-node", type=int, default=1, help="ranks whose host stores share this host")
    check.set_defaults(func=cmd_check)
    return parser


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
