"""A short ZeRO-3 training run with optimizer-state offload: the README's main job.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/ds_config_offload.json

Runs on any accelerator DeepSpeed knows, the CPU included (2 gloo ranks). The only change from a
plain DeepSpeed script is ``deepspeed_offload.initialize`` in place of ``deepspeed.initialize``.

With ``--save_dir`` it saves a checkpoint at the end; with ``"async_checkpoint": true`` in the block
that save returns at once and the files are written in the background; ``deepspeed_offload.finish``
waits for them, and retires the collectives gloo may still be finishing, before the script ends.
Never leave with ``os._exit`` while a checkpoint may be in flight: it kills the writer, and nothing
can report it.
"""

import argparse

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import deepspeed_offload
from deepspeed_offload.compat import show_info_logs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    show_info_logs()  # DeepSpeed logs at WARNING by default (from 0.17.6 on); info shows the offload lines
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU())],
                                torch.nn.Linear(args.hidden, 1))
    engine, _, _, _ = deepspeed_offload.initialize(args=args, model=model, model_parameters=model.parameters())

    device = get_accelerator().current_device_name()
    dtype = next(p for p in engine.module.parameters()).dtype
    gen = torch.Generator().manual_seed(1 + engine.global_rank)
    for step in range(args.steps):
        x = torch.randn(8, args.hidden, generator=gen).to(device, dtype)
        y = x.float().sum(dim=1, keepdim=True).tanh().to(dtype)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    handle = deepspeed_offload.get_handle(engine)
    if engine.global_rank == 0 and handle is not None:
        print(f"offload: {handle.step_stats()}", flush=True)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    # Every rank: the asynchronous checkpoint is on disk and 'latest' names it (raises if it failed),
    # the collectives still finishing are retired, the process groups destroyed.
    deepspeed_offload.finish(engine)
    if engine.global_rank == 0 and args.save_dir:
        print(f"checkpoint saved in {args.save_dir}", flush=True)


if __name__ == "__main__":
    main()
