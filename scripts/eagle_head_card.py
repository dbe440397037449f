"""The model card of an EAGLE head: acceptance measured by mrv2, training figures from its log.

Used by ``scripts/train_eagle_head.py`` after training and by its ``--card-only``.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Speaker names of the play plus the embedded model's own greedy loop (chapter 09's prompts).
CARD_PROMPTS = ["JULIET:", "ROMEO:", "KING RICHARD II:", "First Citizen:", "MENENIUS:",
                "GLOUCESTER:", "DUKE VINCENTIO:", "LOOP"]


def measure_acceptance(head: Path, target: Path, k: int = 3, max_tokens: int = 32,
                       before: Path | None = None) -> dict:
    """Mean accepted length etc. of n-gram, the shipped draft and ``head`` (mrv2, greedy).

    Args:
        head: the EAGLE head's folder; target: its target's (the draft is ``<target>-draft``).
        k: num_speculative_tokens; max_tokens: per prompt.
        before: another head to measure beside it (``eagle_init``: the ``--init`` head).

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
    if before is not None:
        configs["eagle_init"] = {"method": "eagle", "num_speculative_tokens": k,
                                 "model": str(before)}
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


def write_card(out: Path, target: Path, ks=(3, 5), measure: bool = True) -> None:
    """Measure acceptance (each K of ``ks``) and write ``out/README.md`` from its log.

    The ``--init`` head of a fine-tuning run is measured beside the new one while it is
    another folder (not once the new head has replaced it: then its earlier figures stay),
    and its provenance (its own command, hardware, ``--init``) goes into the log.

    Args:
        out: the head's folder (``training_log.json`` there); target: the target's folder.
        ks: the num_speculative_tokens to measure.
        measure: ``False``: only render the card from the acceptance already in the log.
    """
    log = json.loads((out / "training_log.json").read_text())
    s, a, c = log["stats"], log["args"], log["config"]
    init = Path(a["init"]) if a.get("init") else None
    before = init if init and (init / "model.safetensors").is_file() and (
        init.resolve() != out.resolve()) else None
    if before is not None and (before / "training_log.json").is_file():
        theirs = json.loads((before / "training_log.json").read_text())
        s["init_from"] = {**{k: theirs["stats"].get(k) for k in ("command", "hardware",
                                                                 "date", "init_from")},
                          "steps_run": theirs["stats"].get("steps_run", theirs["args"]["steps"])}
    old = log.get("acceptance", {})
    if measure:
        acc = {f"k{k}": measure_acceptance(out, target, k=k, before=before) for k in ks}
        for key, res in acc.items():  # the --init head's figures of the run that replaced it
            if before is None and "eagle_init" in old.get(key, {}):
                res["eagle_init"] = {**old[key]["eagle_init"], "from_earlier_run": True}
    else:
        acc = {f"k{k}": old[f"k{k}"] for k in ks}
    log["acceptance"] = acc
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    first = acc[f"k{ks[0]}"]
    names = [n for n in ("ngram", "draft_model", "eagle_init", "eagle") if n in first]
    label = {"eagle": "**eagle (this head)**",
             "eagle_init": f"eagle, the `--init` head ({Path(a.get('init') or '').name})"}
    rows = "\n".join(
        f"| {key[1:]} | {label.get(n, n)} | {r[n]['mean_accepted_length']:.2f} | "
        f"{r[n]['acceptance_rate']:.2f} | {' '.join(f'{x:.2f}' for x in _per_pos(r[n]))} | "
        f"{r[n]['steps']} |" for key, r in acc.items() for n in names if n in r)
    bad = [f"{n} at K = {key[1:]}" for key, r in acc.items() for n in names
           if n in r and not r[n]["same_tokens"]]
    same = ("every proposer returned the tokens of the run without speculation" if not bad
            else f"**not the tokens of the run without speculation: {', '.join(bad)}**")
    acc = {**first, "k": ", ".join(str(k) for k in ks)}
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
unroll {a['unroll']}{_unroll(a)}.{_generated(a, s)}{_init(a, s, out)}

| | |
| --- | --- |
| steps | {_steps(a, s)}, batch {a['batch_size']} x {a['seq_len']} tokens ({s['tokens_seen']:,} tokens seen) |
| optimizer | AdamW (0.9, 0.95), no weight decay, peak LR {a['lr']:g}, {a['warmup']} warm-up steps, cosine to 10%, grad clip 1.0 |
| kept | the best validation step ({_select(a)}), {s['best_step']} of {s.get('steps_run', a['steps'])} run |
| validation CE of x_(p+2) | **{s['best_val_ce']:.4f}** nats/token, top-1 {s['best_val_top1']:.3f} |{_chain(s)}
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
the target's own greedy loop); {same} ({acc['baseline_steps']} engine steps without).
Mean accepted length = 1 + accepted drafts per speculating request-step (vLLM's definition).

| K | proposer | mean accepted length | acceptance rate | per position | engine steps |
| --- | --- | --- | --- | --- | --- |
{rows}

Re-measure (and rewrite this card) with `python scripts/train_eagle_head.py --card-only`.
""")
    print(f"wrote {out / 'README.md'}", flush=True)


def _unroll(a: dict) -> str:
    if a["unroll"] < 2:
        return ""
    return (f" (passes 2..{a['unroll']} read the head's own features of the pass before: "
            "the chained draft steps of inference, EAGLE's training-time test)")


def _generated(a: dict, s: dict) -> str:
    if not a.get("teacher_generated"):
        return ""
    return (f"\n{a['teacher_generated']:.0%} of each batch's rows are sequences the target "
            f"itself continued ({s['pool_sequences']:,} sequences made once, "
            f"{s['pool_seconds']:.0f} s with the validation ones: a random prompt of the "
            "training split, then the target's tokens, half greedy and half sampled at "
            "temperature 1; `scripts/distill_draft.py`'s generation, as for the draft model).")


def _init(a: dict, s: dict, out: Path) -> str:
    if not a.get("init"):
        return ""
    name = Path(a["init"]).name
    text = (f"\nThe run fine-tunes the head in `{name}` (`--init`"
            + (": this folder's previous head, in git history" if name == out.name else "")
            + "), not a head trained from scratch.")
    src = s.get("init_from")
    while src:
        text += (f" That head came from `{src['command']}` ({src.get('steps_run') or '?'} "
                 f"steps, {src['hardware']}, {src['date']}).")
        src = src.get("init_from")
    return text


def _steps(a: dict, s: dict) -> str:
    run = s.get("steps_run", a["steps"])
    if run >= a["steps"]:
        return f"{a['steps']:,}"
    return (f"{run:,} of the {a['steps']:,} scheduled (the cosine's length; --time-budget "
            f"{a['time_budget']:g} s stopped it)")


def _select(a: dict) -> str:
    if a.get("select", "ce") == "chain":
        return "highest summed chain top-1 on the target's greedy continuations"
    return "lowest validation CE"


def _chain(s: dict) -> str:
    if not s.get("best_gen_chain_top1"):
        return ""
    return (f"\n| chain top-1, draft steps 1..{len(s['best_gen_chain_top1'])}, on the target's "
            f"greedy continuations of {s['gen_val_sequences']} validation prompts | "
            f"{' '.join(f'{x:.3f}' for x in s['best_gen_chain_top1'])} |")


def _labels(args: dict) -> str:
    if args.get("labels", "tokens") == "target":
        return "the frozen target's own distribution, EAGLE-1's soft labels"
    return "the data's next tokens"


def _per_pos(st: dict) -> list[float]:
    return [x / max(st["num_spec_steps"], 1) for x in st["accepted_per_position"]]
