"""The model card of an EAGLE head: acceptance measured by mrv2, training figures from its log.

Used by ``scripts/train_eagle_head.py`` after training and by its ``--card-only``.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Speaker names of the play plus the embedded model's own greedy loop (chapter 09's prompts).
CARD_PROMPTS = ["JULIET:", "ROMEO:", "KING RICHARD II:", "First Citizen:", "MENENIUS:",
                "GLOUCESTER:", "DUKE VINCENTIO:", "LOOP"]


def measure_acceptance(head: Path, target: Path, k: int = 3, max_tokens: int = 32) -> dict:
    """Mean accepted length etc. of n-gram, the shipped draft and ``head`` (mrv2, greedy).

    Args:
        head: the EAGLE head's folder; target: its target's (the draft is ``<target>-draft``).
        k: num_speculative_tokens; max_tokens: per prompt.

    Returns:
        ``{method: SpecDecodeStats.as_dict() + {"steps", "same_tokens"}}`` and
        ``"baseline_steps"``.
    """
    from mrv2 import LLM, SamplingParams
    from mrv2.bench.workloads import EMBEDDED_LOOP

    prompts = [{"prompt_token_ids": EMBEDDED_LOOP * 2} if p == "LOOP" else p
               for p in CARD_PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    configs = {"none": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": k,
                         "prompt_lookup_max": 4, "prompt_lookup_min": 2},
               "draft_model": {"method": "draft_model", "num_speculative_tokens": k,
                               "model": str(target) + "-draft"},
               "eagle": {"method": "eagle", "num_speculative_tokens": k, "model": str(head)}}
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU"
    res, ref = {"k": k, "max_tokens": max_tokens, "prompts": CARD_PROMPTS, "device": device}, None
    for name, cfg in configs.items():
        llm = LLM(str(target), dtype="float32", max_model_len=256, max_num_seqs=8,
                  speculative_config=cfg)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        ids = [o.outputs[0].token_ids for o in outs]
        if ref is None:
            ref, res["baseline_steps"] = ids, llm.engine.num_steps
            continue
        st = llm.runner.spec.stats
        res[name] = {**st.as_dict(), "steps": llm.engine.num_steps, "same_tokens": ids == ref}
        print(f"{name:12s} mean accepted length {st.mean_accepted_length:.2f}, acceptance "
              f"{st.acceptance_rate:.2f}, {llm.engine.num_steps} steps (without: "
              f"{res['baseline_steps']}), same tokens: {ids == ref}", flush=True)
    return res


def write_card(out: Path, target: Path) -> None:
    """Measure acceptance and write ``out/README.md`` from ``out/training_log.json``."""
    log = json.loads((out / "training_log.json").read_text())
    acc = measure_acceptance(out, target)
    log["acceptance"] = acc
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    s, a, c = log["stats"], log["args"], log["config"]
    rows = "\n".join(
        f"| {name} | {acc[name]['mean_accepted_length']:.2f} | {acc[name]['acceptance_rate']:.2f}"
        f" | {' '.join(f'{x:.2f}' for x in _per_pos(acc[name]))} | {acc[name]['steps']} |"
        for name in ("ngram", "draft_model", "eagle"))
    (out / "README.md").write_text(f"""---
license: apache-2.0
library_name: mrv2
tags: [eagle, speculative-decoding, qwen3, tiny, mrv2, shakespeare]
---

# {out.name}

An **EAGLE-1 draft head** for mrv2's embedded model `tiny-qwen3-shakespeare`, trained by
`scripts/train_eagle_head.py` from the frozen target's hidden states. Use it with
`LLM(speculative_config={{"method": "eagle", "model": "<this folder>",
"num_speculative_tokens": 3}})` (the default head of `python -m mrv2 bench --speculative eagle`).
A toy, like its target.

## Format
The EAGLE-1 checkpoint layout that vLLM's `EagleLlamaForCausalLM` loads (the
yuhuili/EAGLE-LLaMA3-Instruct-8B format), Qwen3 variant: `config.json` of the head's base
architecture (`model_type` `qwen3`: per-head q/k RMSNorm; `architectures`
`["EagleQwen3ForCausalLM"]`, `num_hidden_layers` 1) and `model.safetensors` (bf16) with
`fc.weight` `[H, 2H]` and `layers.0.{{self_attn,mlp}}.*`,
`layers.0.post_attention_layernorm.weight`. No `input_layernorm` (EAGLE-1 skips it in its
first layer), no embedding and no lm_head: the target's are shared. mrv2 reads it with
`mrv2/spec_decode/eagle_head.py`, which also takes `model.`-prefixed names, an `fc.bias` and
Llama heads (`model_type` `llama`); EAGLE-3 heads are refused.

## Architecture
At position p: `f_p = layer(fc(concat(embed(x_(p+1)), h_p)))` (+ residual, no final norm),
`logits(x_(p+2)) = target.lm_head(f_p)`, where `h_p` is the target's last hidden state after
its final norm. One Qwen3 decoder layer: hidden {c['hidden_size']}, {c['num_attention_heads']}
query / {c['num_key_value_heads']} KV heads of {c['head_dim']}, MLP {c['intermediate_size']}:
**{s['params']:,} parameters** (the target: ~3.7 M with its 2,048 x 256 embedding).

## Data and training
Tiny Shakespeare, the target's own split (the first 90% of the characters for training, the
last 10% for validation) and tokenizer; {s['train_windows']} training windows and
{s['val_windows']} validation windows of {a['seq_len']} tokens (non-overlapping, from the
start of each split). The target's features are computed once per window
({s['feature_seconds']:.0f} s). Loss: cross-entropy of `x_(p+2)` through the shared lm_head
(labels: {_labels(a)})
plus {a['feature_weight']:g} x smooth L1 of `f_p` against `h_(p+1)` (EAGLE's feature loss),
uniform noise U(-{a['feature_noise']:g}, {a['feature_noise']:g}) on the input features,
unroll {a['unroll']}.

| | |
| --- | --- |
| steps | {a['steps']:,}, batch {a['batch_size']} x {a['seq_len']} tokens ({s['tokens_seen']:,} tokens seen) |
| optimizer | AdamW (0.9, 0.95), no weight decay, peak LR {a['lr']:g}, {a['warmup']} warm-up steps, cosine to 10%, grad clip 1.0 |
| kept | the best validation step, {s['best_step']} |
| validation CE of x_(p+2) | **{s['best_val_ce']:.4f}** nats/token, top-1 {s['best_val_top1']:.3f} |
| wall time | {s['train_seconds']:.0f} s training, {s['total_seconds']:.0f} s in all |
| hardware | {s['hardware']} |
| software | torch {s['torch']} |
| date | {s['date']} |

`training_log.json` holds the loss curve, the arguments and the acceptance figures. Command,
from the repository root:

```bash
{s['command']}
```

## Acceptance, measured by mrv2
The embedded target on {acc.get('device', 'the CPU')} (fp32), greedy, K = {acc['k']}, {acc['max_tokens']} tokens for
each of {len(acc['prompts'])} prompts ({', '.join(p for p in acc['prompts'] if p != 'LOOP')} and
the target's own greedy loop); every proposer returned the tokens of the run without
speculation ({acc['baseline_steps']} engine steps). Mean accepted length = 1 + accepted
drafts per speculating request-step (vLLM's definition).

| proposer | mean accepted length | acceptance rate | per position | engine steps |
| --- | --- | --- | --- | --- |
{rows}

Re-measure (and rewrite this card) with `python scripts/train_eagle_head.py --card-only`.
""")
    print(f"wrote {out / 'README.md'}", flush=True)


def _labels(args: dict) -> str:
    if args.get("labels", "tokens") == "target":
        return "the frozen target's own distribution, EAGLE-1's soft labels"
    return "the data's next tokens"


def _per_pos(st: dict) -> list[float]:
    return [x / max(st["num_spec_steps"], 1) for x in st["accepted_per_position"]]
