"""What the early loads' bookkeeping costs at each gradient hook, with many sub-groups (CPU, one rank).

At every gradient hook of a boundary backward stream mode asks what the early loads and speculation
hold (``ResidencyTable.held_early``, ``Speculation.held_bytes``, ``EarlyLoads.held_into_step``) and
updates what became final and loaded (``Speculation.run``). This trains a model of ``--sub-groups``
one-parameter sub-groups (a 16 x 16 linear layer each) through ``deepspeed_offload.initialize`` on the
CPU accelerator, with early loads capped at ``--cap`` sub-groups (as a GPU's allowance caps them, so
that final members wait), and at every hook times those four calls (``--reps`` each, the mean) in
the state that hook finds. Prints the median and the 90th percentile per hook, in microseconds, and
writes them as JSON:

    python benchmarks/hook_cost.py --sub-groups 1000 --out hook-cost.json

Run it on two checkouts to compare them (the calls it times exist in both).
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sub-groups", type=int, default=1000)
    ap.add_argument("--cap", type=int, default=8, help="early loads hold at most this many sub-groups")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29731")):
        os.environ.setdefault(key, value)
    import deepspeed
    import deepspeed_offload
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    width = 16
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(args.sub_groups)])
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "sub_group_size": width * width, "reduce_bucket_size": width * width,
                                    "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9,
              "optimizer_state_offload": {"enabled": True, "mode": "stream", "memory_budget_gb": 0,
                                          "speculate_memory_gb": 1,
                                          "overlap_memory_gb": args.cap * 12 * width * width / 2**30}}
    engine, _, _, _ = deepspeed_offload.initialize(model=model, model_parameters=model.parameters(), config=config)
    mode = deepspeed_offload.get_handle(engine)
    early, table, spec = mode.early, mode.table, mode.speculation
    per_hook = []
    gradients_final = early.gradients_final

    def timed(allowance):
        if spec is not None and spec._boundary and not mode.in_step:
            t0 = time.perf_counter()
            for _ in range(args.reps):
                table.held_early()
                spec.held_bytes  # noqa: B018 - the property is what is timed
                early.held_into_step()
                spec.run()
            per_hook.append((time.perf_counter() - t0) / args.reps * 1e6)
        gradients_final(allowance)

    early.gradients_final = timed
    x = torch.randn(4, width, dtype=torch.bfloat16)
    for _ in range(args.steps):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(deepspeed_offload.__file__))).stdout.strip()
    per_hook.sort()
    out = {"commit": commit, "sub_groups": len(mode.order) + len(mode.resident), "hooks": len(per_hook),
           "cap_sub_groups": args.cap, "median_us": statistics.median(per_hook),
           "p90_us": per_hook[int(0.9 * (len(per_hook) - 1))], "reps": args.reps,
           "speculated": spec.counters.speculated if spec is not None else None}
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
