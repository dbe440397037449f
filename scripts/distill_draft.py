"""Distillation of a draft model from a frozen teacher, for ``train_tiny_qwen3.py --teacher``.

Under greedy verification a draft token is accepted exactly when the draft's argmax equals
the target's argmax, so the draft is trained on the target's (the teacher's) distribution
instead of the data's next token only:

    loss = alpha * KL(teacher || student) + (1 - alpha) * CE(student, data)

on temperature-1 logits, on windows of the training split and (``--teacher-generated``)
on sequences that the teacher itself continued from random training-split prompts (half
greedily, half sampled at temperature 1): at inference the draft reads the target's own
continuations, its greedy loops included. The figure that predicts acceptance is the top-1
agreement of student and teacher on the validation split, logged beside the usual
cross-entropy against the data; the weights kept are those of the best agreement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

#: The card's acceptance prompts: scripts/eagle_head_card.py's (speaker names + the loop).
CARD_PROMPTS = ["JULIET:", "ROMEO:", "KING RICHARD II:", "First Citizen:", "MENENIUS:",
                "GLOUCESTER:", "DUKE VINCENTIO:", "LOOP"]


def load_teacher(path: str, tok, device):
    """The frozen teacher (fp32 weights, eval mode) after checking it shares ``tok``.

    Args:
        path: the teacher's Hugging Face folder (``--teacher``).
        tok: the student's tokenizer.
        device: where the teacher runs.

    Returns:
        The teacher, a ``*ForCausalLM`` with ``requires_grad`` off.

    Raises:
        ValueError: naming ``--teacher`` when the folder is not a model or its tokenizer or
            vocabulary differs from the student's (logits must align id for id).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--teacher {path!r}: not a Hugging Face model folder "
                         "(no config.json)")
    cfg = AutoConfig.from_pretrained(folder)
    try:
        t_vocab = AutoTokenizer.from_pretrained(folder).get_vocab()
    except (OSError, ValueError) as e:
        raise ValueError(f"--teacher {path!r}: no loadable tokenizer ({e})") from e
    if t_vocab != tok.get_vocab() or cfg.vocab_size != len(tok):
        raise ValueError(
            f"--teacher {path!r}: its tokenizer differs from the student's (teacher: "
            f"{len(t_vocab):,} tokens, config vocab_size {cfg.vocab_size:,}; student: "
            f"{len(tok):,} tokens); distillation needs the same vocabulary: pass "
            f"--tokenizer {path}")
    teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def distill_loss(logits, t_logits, y, alpha: float):
    """``alpha * KL(teacher || student) + (1 - alpha) * CE(data)``, and the KL alone.

    Args:
        logits: the student's ``[B, L, V]``; t_logits: the teacher's ``[B, L, V]``.
        y: the data's next tokens ``[B, L]``.
        alpha: the weight of the KL term in [0, 1].

    Returns:
        ``(loss, kl)``, scalars (the KL is a mean over tokens, in nats).
    """
    logp = F.log_softmax(logits.float(), dim=-1)                            # [B, L, V]
    t_logp = F.log_softmax(t_logits.float(), dim=-1)                        # [B, L, V]
    kl = (t_logp.exp() * (t_logp - logp)).sum(-1).mean()
    if alpha >= 1.0:
        return kl, kl
    ce = F.nll_loss(logp.flatten(0, 1), y.flatten())
    return alpha * kl + (1.0 - alpha) * ce, kl


@torch.no_grad()
def evaluate(model, teacher, batches, autocast, skip: int = 0) -> dict:
    """CE against the data, KL(teacher || student) and top-1 agreement with the teacher.

    Args:
        model: the student; teacher: the frozen teacher.
        batches: ``[(x, y)]`` of ``[B, L]`` tokens and next tokens.
        autocast: the training's autocast context factory.
        skip: ignore the first ``skip`` positions of each window (a generated sequence's
            prompt: only the teacher's continuation is scored).

    Returns:
        ``{"ce", "kl", "agreement"}`` floats (agreement in [0, 1]).
    """
    model.eval()
    ces, kls, agree = [], [], []
    for x, y in batches:
        with autocast():
            logits = model(input_ids=x).logits[:, skip:].float()            # [B, L-skip, V]
            t_logits = teacher(input_ids=x).logits[:, skip:].float()
        y = y[:, skip:]
        ces.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        kls.append(distill_loss(logits, t_logits, y, 1.0)[1])
        agree.append((logits.argmax(-1) == t_logits.argmax(-1)).float().mean())
    model.train()
    return {k: torch.stack(v).mean().item() for k, v in
            (("ce", ces), ("kl", kls), ("agreement", agree))}


def prompt_len(seq_len: int) -> int:
    """Prompt tokens of a teacher-generated sequence (the rest is the teacher's)."""
    return max(1, min(32, seq_len // 4))


@torch.no_grad()
def teacher_sequences(teacher, ids, n: int, seq_len: int, eos_id: int, autocast, seed: int,
                      greedy_only: bool = False, chunk: int = 512) -> torch.Tensor:
    """``n`` windows ``[n, seq_len + 1]``: a random prompt of ``ids``, continued by the teacher.

    Args:
        teacher: the frozen teacher; ids: a split's token ids (1-D, on the teacher's device).
        n: sequences; seq_len: the training window (each sequence has ``seq_len + 1`` tokens).
        eos_id: the tokenizer's EOS (masked: every sequence runs to its full length).
        autocast: the training's autocast context factory.
        seed: the prompts' and the sampling's seed.
        greedy_only: all greedy; otherwise even rows greedy, odd rows sampled at T = 1.
        chunk: sequences per ``generate`` call.

    Returns:
        The token windows, on ``ids``'s device.
    """
    from transformers import GenerationConfig

    p = prompt_len(seq_len)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - p, (n,), generator=gen).to(ids.device)
    prompts = ids[starts[:, None] + torch.arange(p, device=ids.device)]     # [n, p]
    new = seq_len + 1 - p
    out = torch.empty(n, seq_len + 1, dtype=ids.dtype, device=ids.device)
    torch.manual_seed(seed)
    for sample in ((False,) if greedy_only else (False, True)):
        rows = torch.arange(int(sample), n, 1 if greedy_only else 2, device=ids.device)
        filters = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
        cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=sample,
                               eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id,
                               **filters)
        for r in rows.split(chunk):
            with autocast():
                seqs = teacher.generate(input_ids=prompts[r],
                                        attention_mask=torch.ones_like(prompts[r]),
                                        generation_config=cfg)
            out[r] = seqs
    return out


def prepare(teacher, train_ids, val_ids, args, eos_id: int, autocast):
    """The teacher's own sequences: the training pool (or None) and the validation batches.

    Returns:
        ``(pool [teacher_pool, seq_len + 1] or None, [(x, y)])``; the time goes into
        ``args.pool_seconds`` (for the card).
    """
    t0 = time.time()
    pool = None
    if args.teacher_generated > 0:
        pool = teacher_sequences(teacher, train_ids, args.teacher_pool, args.seq_len, eos_id,
                                 autocast, args.seed)
    gen_val = teacher_sequences(teacher, val_ids, 4 if args.smoke else 64, args.seq_len,
                                eos_id, autocast, args.seed + 1, greedy_only=True)
    args.pool_seconds = round(time.time() - t0, 1)
    print(f"teacher {args.teacher}: {0 if pool is None else len(pool)} training and "
          f"{len(gen_val)} validation sequences of its own in {args.pool_seconds:.1f}s",
          flush=True)
    return pool, [(w[:, :-1], w[:, 1:]) for w in gen_val.split(args.batch_size)]


def evaluate_all(model, teacher, val_batches, gen_val, args, autocast) -> dict:
    """:func:`evaluate` on the validation windows and on the teacher's greedy continuations.

    Returns:
        ``{"val_loss", "val_kl", "val_agreement", "val_gen_agreement"}``.
    """
    m = evaluate(model, teacher, val_batches, autocast)
    g = evaluate(model, teacher, gen_val, autocast, skip=prompt_len(args.seq_len) - 1)
    return {"val_loss": m["ce"], "val_kl": m["kl"], "val_agreement": m["agreement"],
            "val_gen_agreement": g["agreement"]}


def final_stats(model, teacher, val_batches, gen_val, pool, args, autocast) -> dict:
    """The saved weights' distillation figures, for training_log.json and the card."""
    m = evaluate_all(model, teacher, val_batches, gen_val, args, autocast)
    print(f"saved model: val agreement with the teacher {m['val_agreement']:.4f}, kl "
          f"{m['val_kl']:.4f}; on the teacher's text {m['val_gen_agreement']:.4f}", flush=True)
    return {"teacher": args.teacher, "final_val_agreement": round(m["val_agreement"], 4),
            "final_val_kl": round(m["val_kl"], 4),
            "final_gen_agreement": round(m["val_gen_agreement"], 4),
            "gen_val_sequences": sum(len(x) for x, _ in gen_val),
            "pool_sequences": 0 if pool is None else len(pool),
            "pool_seconds": args.pool_seconds}


def mixed_batch(train_ids, pool, batch_size: int, seq_len: int, fraction: float):
    """A training batch ``(x, y)``: ``round(fraction * B)`` rows from ``pool``, the rest data."""
    n_gen = 0 if pool is None else round(fraction * batch_size)
    starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch_size - n_gen,),
                           device=train_ids.device)
    w = train_ids[starts[:, None] + torch.arange(seq_len + 1, device=train_ids.device)]
    if n_gen:
        pick = torch.randint(0, len(pool), (n_gen,), device=pool.device)
        w = torch.cat((w, pool[pick]))
    return w[:, :-1], w[:, 1:]


def purpose(args) -> str:
    """The card's opening paragraph for a distilled draft."""
    return ("A smaller tiny Qwen3 (`Qwen3ForCausalLM`) **distilled** by mrv2's own script,\n"
            "`scripts/train_tiny_qwen3.py --preset draft --teacher`, from the embedded default\n"
            f"model `{Path(args.teacher).name}` (frozen), on the same data and with the same\n"
            "tokenizer. mrv2 ships it as that model's **draft model for speculative decoding**\n"
            "(`speculative_config={\"method\": \"draft_model\", ...}`): trained on the\n"
            "target's own distribution, so that its argmax agrees with the target's and more\n"
            "drafts are accepted. It is a toy, not a useful language model."
            + (f"\nThe run starts from the weights of `{Path(args.init).name}` (`--init`): a\n"
               "fine-tuning of that draft, not a model trained from scratch."
               if getattr(args, "init", None) else ""))


def card_section(args, s: dict) -> str:
    """The model card's distillation section (markdown)."""
    a = args.distill_alpha
    loss = ("KL(teacher || student)" if a >= 1 else
            f"{a:g} x KL(teacher || student) + {1 - a:g} x cross-entropy against the data")
    gen = (f"{args.teacher_generated:.0%} of each batch's rows are sequences that the teacher "
           f"itself continued ({s['pool_sequences']:,} sequences, made once in "
           f"{s['pool_seconds']:.0f} s: a random {prompt_len(args.seq_len)}-token prompt of the "
           f"training split, then {args.seq_len + 1 - prompt_len(args.seq_len)} tokens of the "
           "teacher's, half greedy and half sampled at temperature 1), the rest windows of the "
           "training split." if args.teacher_generated > 0 else
           "Every row is a window of the training split.")
    return f"""
## Distillation
Distilled from the frozen teacher `{Path(args.teacher).name}` (the target it drafts for), which
shares its tokenizer. Under greedy verification a draft token is accepted exactly when the
draft's argmax equals the target's, so the loss is **{loss}** on temperature-1 logits.
{gen}

| on the validation split | |
| --- | --- |
| top-1 agreement with the teacher (the kept weights: the best agreement, step {s['best_step']:,}) | **{s['final_val_agreement']:.4f}** |
| KL(teacher \\|\\| student) | {s['final_val_kl']:.4f} nats/token |
| top-1 agreement on the teacher's greedy continuations of {s['gen_val_sequences']} validation prompts | {s['final_gen_agreement']:.4f} |

Agreement is measured with teacher forcing: position by position, the fraction where the
student's most likely next token is the teacher's. It is the acceptance rate of a first draft
token under greedy verification on such text.
"""


def measure_acceptance(draft: Path, target: Path, ks=(3, 5), max_tokens: int = 32) -> dict:
    """Mean accepted length of ``draft`` for ``target`` with mrv2 (greedy, fp32).

    Args:
        draft: the draft's folder; target: its target's (the teacher).
        ks: the num_speculative_tokens to measure; max_tokens: per prompt.

    Returns:
        ``{"k<K>": SpecDecodeStats.as_dict() + {"steps", "same_tokens"}}`` and the setup.
    """
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:  # `python scripts/...` without an installed mrv2
        sys.path.append(repo)
    from mrv2 import LLM, SamplingParams
    from mrv2.bench.workloads import EMBEDDED_LOOP

    prompts = [{"prompt_token_ids": EMBEDDED_LOOP * 2} if p == "LOOP" else p
               for p in CARD_PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU"
    res = {"max_tokens": max_tokens, "prompts": CARD_PROMPTS, "device": device}
    ref = None
    for k in (None, *ks):
        cfg = k and {"method": "draft_model", "num_speculative_tokens": k, "model": str(draft)}
        llm = LLM(str(target), dtype="float32", max_model_len=256, max_num_seqs=8,
                  speculative_config=cfg)
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if k is None:
            ref, res["baseline_steps"] = ids, llm.engine.num_steps
            continue
        st = llm.runner.spec.stats
        res[f"k{k}"] = {**st.as_dict(), "steps": llm.engine.num_steps, "same_tokens": ids == ref}
        print(f"K={k}: mean accepted length {st.mean_accepted_length:.2f}, acceptance "
              f"{st.acceptance_rate:.2f}, {llm.engine.num_steps} steps (without: "
              f"{res['baseline_steps']}), same tokens: {ids == ref}", flush=True)
    return res


def acceptance_section(acc: dict) -> str:
    """The card's "Acceptance, measured by mrv2" section from :func:`measure_acceptance`."""
    rows = []
    for key in sorted(k for k in acc if k.startswith("k") and k[1:].isdigit()):
        st = acc[key]
        per = " ".join(f"{x / max(st['num_spec_steps'], 1):.2f}"
                       for x in st["accepted_per_position"])
        rows.append(f"| {key[1:]} | {st['mean_accepted_length']:.2f} | "
                    f"{st['acceptance_rate']:.2f} | {per} | {st['steps']} | "
                    f"{'yes' if st['same_tokens'] else '**no**'} |")
    speakers = ", ".join(p for p in acc["prompts"] if p != "LOOP")
    return f"""
## Acceptance, measured by mrv2
The teacher as the target on {acc['device']} (fp32), this draft as its `draft_model`
proposer, greedy, {acc['max_tokens']} tokens for each of {len(acc['prompts'])} prompts
({speakers} and the target's own greedy loop), as on the EAGLE head's card; without
speculation the run takes {acc['baseline_steps']} engine steps. Mean accepted length = 1 +
accepted drafts per speculating request-step (vLLM's definition).

| K | mean accepted length | acceptance rate | per position | engine steps | same tokens |
| --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}

Re-measure (and rewrite this card) with `python scripts/train_tiny_qwen3.py --card-only
--out <this folder>`.
"""


def read_log(out: Path) -> dict:
    """``out/training_log.json``, checked to come from a ``--teacher`` run."""
    path = Path(out) / "training_log.json"
    if not path.is_file():
        raise ValueError(f"--out {str(out)!r}: no training_log.json to rebuild the card from")
    log = json.loads(path.read_text())
    if not log["args"].get("teacher") or "samples" not in log:
        raise ValueError(f"--out {str(out)!r}: --card-only needs a --teacher run's log")
    return log


def write_card_only(out: Path, model_card) -> dict:
    """Measure the draft in ``out`` with mrv2, store it in its log, rewrite its README.md.

    Args:
        out: a ``--teacher`` run's folder; model_card: train_tiny_qwen3.py's card writer.

    Returns:
        The run's stats (from training_log.json).
    """
    log = read_log(out)
    log["acceptance"] = measure_acceptance(out, Path(log["args"]["teacher"]))
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    args = argparse.Namespace(**{**log["args"], "out": str(out)})
    card = model_card(args, log["stats"], log["samples"], argparse.Namespace(**log["config"]),
                      log["n_new"], acceptance=log["acceptance"])
    (out / "README.md").write_text(card)
    print(f"wrote {out / 'README.md'}", flush=True)
    return log["stats"]
