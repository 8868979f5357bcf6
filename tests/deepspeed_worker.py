"""Makes real DeepSpeed checkpoints for the tests: ``python deepspeed_worker.py OUT WORLD PORT CASE...``.

Spawns WORLD processes on 127.0.0.1 (gloo, ``DS_ACCELERATOR=cpu``); each CASE (``MODEL-STAGE``, MODEL ``llama`` or
``moe``, STAGE ``1``/``2``/``3`` or ``bf16opt``: bf16 + ZeRO-1 + fp32 gradient accumulation, which selects
DeepSpeed's BF16_Optimizer; a trailing ``x`` saves with ``exclude_frozen_parameters``) is trained for two steps with bf16 on and saved with ``save_checkpoint`` into
``OUT/CASE`` (with the model's ``config.json`` beside ``latest``). The tiny Llama is tied, has a frozen norm and
sizes that force uneven padding; every parameter starts from seeded noise (no norm of ones, no zero bias).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp


def build_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=67, hidden_size=45, head_dim=16, intermediate_size=50, num_hidden_layers=2,
                          num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                          tie_word_embeddings=True)  # odd numels: uneven ZeRO-1/2 tails and ZeRO-3 partitions
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2MoeConfig(vocab_size=67, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                             shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, tie_word_embeddings=False)
        model = Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i)) * 0.2 + 0.01 * i)
    if kind == "llama":
        model.model.norm.weight.requires_grad_(False)
    return model


def ds_config(stage: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 1 if stage == "bf16opt" else int(stage)},
              "bf16": {"enabled": True}, "steps_per_print": 1000, "wall_clock_breakdown": False}
    if stage == "bf16opt":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def worker(rank: int, world: int, out: str, port: str, cases: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm's attribute "torch" is torch itself)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # plain gloo: no C++ op built into a cache
    deepspeed.init_distributed(dist_backend="gloo")
    for case in cases:
        kind, stage = case.rstrip("x").split("-")
        model = build_model(kind)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=ds_config(stage))
        for step in range(2):
            ids = torch.randint(0, 67, (1, 8), generator=torch.Generator().manual_seed(step * 10 + rank))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        folder = os.path.join(out, case)
        engine.save_checkpoint(folder, exclude_frozen_parameters=case.endswith("x"))
        if rank == 0:
            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(folder)
            with open(os.path.join(folder, "optimizer.txt"), "w") as f:
                f.write(type(engine.optimizer).__name__)
        torch.distributed.barrier()
        engine.destroy()
        del engine, optimizer, model


if __name__ == "__main__":
    out, world, port, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    mp.spawn(worker, args=(world, out, port, cases), nprocs=world, join=True)
    sys.stdout.flush()
    os._exit(0)  # deepspeed's finalizers can abort at teardown after every file is written
