"""GPU: the Qwen3-0.6B shape with random bf16 weights, mrv2 against Hugging Face.

bf16 logits of two different implementations never agree to a fixed atol, so the
criterion is relative to an fp32 run of the same weights: mrv2's bf16 error must be no
larger than 1.5x Hugging Face's own bf16 error (both measured against HF in fp32), in
RMS over every logit row of a mixed batch, plus a greedy-agreement floor.

The config comes from ``$MRV2_SHARED_DATA/qwen3-tokenizer/config.json`` (the GPU machine
has no ../shared), else ``../shared/data`` or ``./shared/data``; the test skips without it.
"""

import os
from pathlib import Path

import pytest
import torch
from paged_harness import PagedHarness, run_schedule

pytestmark = pytest.mark.gpu

_ROOT = Path(__file__).resolve().parents[1]


def qwen3_0_6b_config_dir() -> Path:
    candidates = [Path(os.environ["MRV2_SHARED_DATA"])] if "MRV2_SHARED_DATA" in os.environ else []
    candidates += [_ROOT.parent / "shared" / "data", _ROOT / "shared" / "data"]
    for base in candidates:
        if (base / "qwen3-tokenizer" / "config.json").is_file():
            return base / "qwen3-tokenizer"
    pytest.skip("Qwen3-0.6B config.json not found (set MRV2_SHARED_DATA)")


def rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


def test_qwen3_0_6b_bf16_matches_hf(tmp_path):
    import transformers

    from mrv2.models.loader import load_model

    cfg = transformers.AutoConfig.from_pretrained(qwen3_0_6b_config_dir())
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf = hf.to("cuda").eval()
    model, mcfg = load_model(str(tmp_path), dtype="bfloat16", device="cuda")
    assert model.use_qk_norm and model.lm_head.weight is model.model.embed_tokens.weight

    # Mixed batch: long and short prompts, chunked prefill (budget 96), decodes, and
    # CUDA-graph style padding (slot -1 tokens, seq_len 0 rows).
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151_000, (n,), generator=g).tolist() for n in (200, 7, 64, 1, 33)]
    harness = PagedHarness(model, mcfg, num_blocks=256, block_size=16)
    reqs = run_schedule(harness, prompts, max_new_tokens=6, token_budget=96,
                        arrivals=[0, 0, 1, 2, 2], pad_tokens=5, pad_reqs=2)

    ours, hf16, hf32 = [], [], []
    with torch.no_grad():
        for r in reqs:
            ids = torch.tensor([r.tokens[:-1]], device="cuda")
            ours.append(r.all_logits.float())
            hf16.append(hf(ids).logits[0].float())
        hf.float()  # same bf16 weights, exactly, now computed in fp32
        for r in reqs:
            hf32.append(hf(torch.tensor([r.tokens[:-1]], device="cuda")).logits[0].float())
    ours, hf16, hf32 = torch.cat(ours), torch.cat(hf16), torch.cat(hf32)   # [rows, vocab]

    err_ours, err_hf = rms(ours - hf32), rms(hf16 - hf32)
    agree_ours = (ours.argmax(-1) == hf32.argmax(-1)).float().mean().item()
    agree_hf = (hf16.argmax(-1) == hf32.argmax(-1)).float().mean().item()
    print(f"\nlogit RMS error vs fp32: mrv2 bf16 {err_ours:.4g}, HF bf16 {err_hf:.4g} "
          f"(logit RMS {rms(hf32):.4g}); max |err| mrv2 {(ours - hf32).abs().max():.4g}, "
          f"HF {(hf16 - hf32).abs().max():.4g}; argmax agreement with fp32: "
          f"mrv2 {agree_ours:.3f}, HF {agree_hf:.3f} over {ours.shape[0]} rows")
    assert err_ours <= 1.5 * err_hf, (err_ours, err_hf)
    assert agree_ours >= agree_hf - 0.05, (agree_ours, agree_hf)
