"""An Accelerate training loop with optimizer-state offload: two added lines (marked "deepspeed-offload").

    deepspeed --num_gpus 2 examples/accelerate_loop.py --ds_config examples/ds_config_hf.json

(``accelerate launch --use_deepspeed ...`` works the same way.) ``accelerator.prepare`` calls
``deepspeed.initialize``, which applies the ``optimizer_state_offload`` block once ``install()`` has
run. ``accelerator.save_state`` writes the DeepSpeed checkpoint in the background with
``async_checkpoint``; the next ``save_state`` (and its ``total_limit`` clean-up) waits for it.
"""

import argparse
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, DummyOptim, ProjectConfiguration
from transformers import LlamaConfig, LlamaForCausalLM

import deepspeed_offload  # deepspeed-offload

deepspeed_offload.install()  # deepspeed-offload: every deepspeed.initialize applies the block


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds_config", default="examples/ds_config_hf.json")
    parser.add_argument("--output_dir", default="out/accelerate_loop")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        # 2 CPU ranks under the deepspeed launcher: tell Accelerate they are CPU processes and that
        # DeepSpeed drives them (`accelerate launch --use_deepspeed` exports the latter itself).
        os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
        PartialState(cpu=True)
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.ds_config),
                              project_config=ProjectConfiguration(project_dir=args.output_dir,
                                                                  automatic_checkpoint_naming=True, total_limit=2))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32))
    # The ds_config names the optimizer ("auto" lr): Accelerate's DummyOptim stands in for it.
    optimizer = DummyOptim(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = torch.randint(0, 128, (256, 32), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    for step, (batch, ) in enumerate(loader):
        if step == args.steps:
            break
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % 4 == 0:
            accelerator.save_state()  # returns while the optimizer state is still being written
    deepspeed_offload.wait_for_checkpoint(model)  # every rank: the last checkpoint is complete

    stats = deepspeed_offload.get_handle(model).step_stats()
    accelerator.print(f"loss {loss.item():.4f}; last step moved {stats['bytes_h2d']} bytes to the device and "
                      f"{stats['bytes_d2h']} back; checkpoints: {sorted(os.listdir(args.output_dir + '/checkpoints'))}")


if __name__ == "__main__":
    main()
