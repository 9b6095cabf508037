"""RL colocation: training and rollouts take turns on the same GPUs.

    deepspeed --num_gpus 1 examples/colocate.py --deepspeed_config examples/ds_config_colocate.json

Each round trains a few steps of a small Llama (the policy), copies its weights into the rollout
model (what TRL's GRPO or OpenRLHF hand to vLLM in colocate mode), frees the trainer's device memory
with DeepSpeed's own ``engine.offload_states()``, generates with the rollout model in the memory that
freed, and brings the trainer back with ``engine.reload_states()``. With the block on, the optimizer
state is in host memory already: ``offload_states()`` moves only the 16-bit parameters and gradients.

``--plain`` builds plain ZeRO-3 (``deepspeed.initialize``, DeepSpeed's FusedAdam, which its own
``offload_states`` requires: a GPU); ``--no_offload_states`` keeps the trainer's memory through the
rollout. Each round prints the device memory allocated (the rollout model included) before and
during the rollout and what was free then; the last line, the losses.
Runs on the CPU too (2 gloo ranks), where the free memory is the host's.
"""

import argparse
import json

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import deepspeed_offload

GiB = 2**30


def build_policy(args):
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=4 * args.seq)
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config)


def sync_weights(engine, rollout):
    """The trainer's current weights into the rollout model (every rank gathers the partitions)."""
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        with torch.no_grad():
            for name, p in rollout.named_parameters():
                p.copy_(params[name].data)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train_steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--plain", action="store_true", help="plain ZeRO-3 with FusedAdam (GPU only)")
    parser.add_argument("--no_offload_states", action="store_true", help="keep the trainer's memory during rollouts")
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    acc = get_accelerator()
    config, policy = build_policy(args)
    if args.plain:
        from deepspeed.ops.adam import FusedAdam
        optimizer = FusedAdam(policy.parameters(), lr=1e-3, weight_decay=0.01, adam_w_mode=True)
        init = deepspeed.initialize
    else:
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.01)
        init = deepspeed_offload.initialize
    config_file, args.deepspeed_config = args.deepspeed_config, None
    with open(config_file) as f:
        ds_config = json.load(f)
    if args.plain:
        ds_config.pop("optimizer_state_offload", None)
    engine, _, _, _ = init(args=args, model=policy, optimizer=optimizer, config=ds_config)
    device, rank = acc.current_device_name(), engine.global_rank
    rollout = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()

    gen = torch.Generator().manual_seed(1 + rank)
    losses = []
    for round_ in range(args.rounds):
        for _ in range(args.train_steps):
            tokens = torch.randint(0, args.vocab, (4, args.seq), generator=gen).to(device)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())

        sync_weights(engine, rollout)
        held = acc.memory_allocated()
        if not args.no_offload_states:
            engine.offload_states()  # every kind: optimizer state, masters, 16-bit params and grads
        left, free = acc.memory_allocated(), acc.available_memory()
        prompts = torch.randint(0, args.vocab, (4, 8), generator=gen).to(device)
        with torch.no_grad():
            out = rollout.generate(prompts, max_new_tokens=args.new_tokens, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)
        if not args.no_offload_states:
            engine.reload_states()
        if rank == 0:
            print(f"round {round_}: allocated {held / GiB:.3f} GiB before the rollout, {left / GiB:.3f} GiB during it, "
                  f"{acc.memory_allocated() / GiB:.3f} GiB after reload; free during the rollout "
                  f"{free / GiB:.2f} GiB; generated {out.shape[1] - prompts.shape[1]} tokens x {out.shape[0]}",
                  flush=True)

    if rank == 0:
        print(f"losses: {losses}", flush=True)
    deepspeed_offload.finish(engine)


if __name__ == "__main__":
    main()
