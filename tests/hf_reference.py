"""Greedy reference continuations from Hugging Face ``transformers`` (fp32, CPU, no cache)."""

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens by recomputing the whole sequence each step (no EOS, no KV cache)."""
    model = hf_model(str(path))
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        new = []
        for _ in range(max_new_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        outs.append(new)
    return outs
