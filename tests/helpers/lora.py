"""PEFT LoRA adapters with random weights, and their merged models: the reference for Minerva's --lora."""

from __future__ import annotations

import copy

import peft
import torch


def make_adapter(base_model, folder, seed: int, targets: list[str], rank: int = 4, std: float = 0.2, **extra):
    """A PEFT LoRA adapter with random A and B on a copy of `base_model`, saved to `folder`;
    returns PEFT's merged model (the reference)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
    model = peft.get_peft_model(copy.deepcopy(base_model), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()
