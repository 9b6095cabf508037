"""Lightning's DeepSpeedStrategy with optimizer-state offload: two added lines (marked "deepspeed-offload").

    python examples/lightning_train.py            # one GPU; Lightning launches more with --devices

Lightning's DeepSpeedStrategy runs on CUDA GPUs only. The strategy calls ``deepspeed.initialize``,
which applies the ``optimizer_state_offload`` block of its config once ``install()`` has run.
``ModelCheckpoint`` keeps the newest checkpoint (``save_top_k=1``): with ``async_checkpoint`` the
previous one is removed only once the new one is complete.
"""

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy
from transformers import LlamaConfig, LlamaForCausalLM

import deepspeed_offload  # deepspeed-offload

deepspeed_offload.install()  # deepspeed-offload: every deepspeed.initialize applies the block


def ds_config(offload: bool):
    return {
        "zero_optimization": {"stage": 3, "sub_group_size": 20_000},
        "optimizer_state_offload": {"enabled": offload, "mode": "stream", "memory_budget_gb": 0,
                                    "async_checkpoint": True},
    }


class TinyLlama(pl.LightningModule):

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                  max_position_embeddings=32))

    def training_step(self, batch, batch_idx):
        (ids, ) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class KeepFinalParams(pl.Callback):
    """The final fp32 parameters, gathered while the engine is still on the GPU: Lightning's teardown
    moves the model to the CPU after ``fit``, where NCCL cannot gather it (for ``--out``, the tests)."""

    def __init__(self):
        self.params = None

    def on_train_end(self, trainer, pl_module):
        from deepspeed.utils import safe_get_full_fp32_param
        engine = trainer.strategy.deepspeed_engine
        self.params = {n: safe_get_full_fp32_param(p).cpu() for n, p in engine.module.named_parameters()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--ckpt-dir", default="out/lightning_train")
    parser.add_argument("--no-offload", action="store_true", help="the same run with the block disabled")
    parser.add_argument("--out", help="save the final fp32 parameters and the bytes moved here (tests)")
    args = parser.parse_args()

    ids = torch.randint(0, 128, (256, 32), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    final = KeepFinalParams()
    trainer = pl.Trainer(accelerator="cuda", devices=args.devices, max_steps=args.steps, precision="bf16-mixed",
                         strategy=DeepSpeedStrategy(config=ds_config(not args.no_offload)), logger=False,
                         enable_progress_bar=False,
                         callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=2, save_top_k=1), final])
    trainer.fit(TinyLlama(), loader)

    engine = trainer.strategy.deepspeed_engine
    deepspeed_offload.wait_for_checkpoint(engine)
    handle = deepspeed_offload.get_handle(engine)
    moved = handle.step_stats()["bytes_h2d"] if handle is not None else 0
    if trainer.is_global_zero:
        print(f"last step moved {moved} bytes to the device")
    if args.out and trainer.is_global_zero:
        torch.save({"params": final.params, "bytes_moved": moved}, args.out)


if __name__ == "__main__":
    main()
