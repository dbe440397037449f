"""Train mrv2's embedded default model: a tiny Qwen3 on Tiny Shakespeare.

Steps: train a byte-level BPE tokenizer (``tokenizers``) on the training split (the
first 90% of the characters), tokenize the text once, train a small Hugging Face
``Qwen3ForCausalLM`` on random windows (AdamW, warm-up + cosine LR, bf16 autocast on
CUDA, residual dropout), keep the weights with the best validation loss and save a
Hugging Face folder: bf16 safetensors, tokenizer, generation config, a model card
(``README.md``) and ``training_log.json``.

    python scripts/train_tiny_qwen3.py                          # ~1-2 min on an H200
    python scripts/train_tiny_qwen3.py --smoke --out /tmp/tiny  # seconds, on the CPU

With ``--teacher PATH`` (a draft: ``--preset draft``) the model is distilled from that frozen
model instead (``scripts/distill_draft.py``): KL to the teacher's distribution, optionally
mixed with the data's next-token loss and trained partly on the teacher's own continuations;
the weights kept are those of the best top-1 agreement with the teacher on the validation
split, and (not with ``--smoke``) mrv2 measures the draft's acceptance for the card:

    python scripts/train_tiny_qwen3.py --preset draft --teacher mrv2/assets/tiny-qwen3-shakespeare \\
        --teacher-generated 0.5 --out mrv2/assets/tiny-qwen3-shakespeare-draft   # GPU
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
PROMPTS = ("ROMEO:", "First Citizen:")
FULL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
#: A smaller model for speculative decoding against FULL: same tokenizer, a quarter the width.
DRAFT = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
SMOKE = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str((REPO / "../shared/data/tinyshakespeare.txt").resolve()))
    p.add_argument("--out", default=str(REPO / "mrv2/assets/tiny-qwen3-shakespeare"))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--dropout", type=float, default=0.1, help="residual dropout (training only)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny model, 8 steps (CPU, seconds)")
    p.add_argument("--preset", choices=("full", "draft"), default="full",
                   help="model size: the embedded model, or the smaller draft model that "
                        "speculative decoding pairs with it")
    p.add_argument("--tokenizer", default=None,
                   help="reuse this tokenizer folder instead of training one (a draft model "
                        "must share its target's vocabulary)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--init", default=None, metavar="PATH",
                   help="start from this checkpoint's weights (same architecture as the "
                        "preset) instead of random ones: fine-tuning")
    d = p.add_argument_group("distillation (scripts/distill_draft.py)")
    d.add_argument("--teacher", default=None,
                   help="distil from this frozen model's distribution (it must share the "
                        "tokenizer; --tokenizer defaults to it)")
    d.add_argument("--distill-alpha", type=float, default=1.0,
                   help="loss = alpha * KL(teacher || student) + (1 - alpha) * data CE")
    d.add_argument("--teacher-generated", type=float, default=0.0, metavar="FRACTION",
                   help="this fraction of each batch: sequences the teacher continued from "
                        "random training-split prompts (half greedy, half sampled at T=1)")
    d.add_argument("--teacher-pool", type=int, default=4096,
                   help="teacher-generated sequences, made once before training")
    d.add_argument("--card-only", action="store_true",
                   help="no training: measure the --teacher run in --out with mrv2 and "
                        "rewrite its README.md")
    args = p.parse_args(argv)
    if not 0.0 <= args.distill_alpha <= 1.0:
        p.error(f"--distill-alpha must be in [0, 1]; got {args.distill_alpha}")
    if not 0.0 <= args.teacher_generated <= 1.0:
        p.error(f"--teacher-generated must be in [0, 1]; got {args.teacher_generated}")
    if not args.teacher and (args.teacher_generated or args.distill_alpha != 1.0):
        p.error("--distill-alpha and --teacher-generated need --teacher")
    if args.teacher and args.tokenizer is None:
        args.tokenizer = args.teacher
    if args.smoke:
        args.steps, args.batch_size, args.seq_len = 8, 4, 32
        args.vocab_size, args.warmup, args.eval_every, args.log_every = 320, 2, 4, 2
        args.teacher_pool = min(args.teacher_pool, 8)
    return args


def train_tokenizer(text: str, vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenizer regex, no prefix space) as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS, model_max_length=1024,
                                   clean_up_tokenization_spaces=False)


def add_dropout(model, p: float):
    """Residual dropout through forward hooks (Qwen3 has none): inert in eval, never saved."""
    def hook(module, inputs, out):
        if not module.training or p == 0:
            return out
        if isinstance(out, tuple):  # self_attn returns (output, weights)
            return (F.dropout(out[0], p, True), *out[1:])
        return F.dropout(out, p, True)

    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int):
    w = data[starts[:, None] + torch.arange(seq_len + 1, device=data.device)]
    return w[:, :-1], w[:, 1:]


def fixed_batches(data, max_windows: int, args, gen=None):
    """Non-overlapping windows from the start (gen=None) or random ones, in batches."""
    hi = len(data) - args.seq_len - 1
    starts = (torch.arange(0, hi, args.seq_len) if gen is None else
              torch.randint(0, hi, (max_windows,), generator=gen))[:max_windows]
    return [windows(data, s.to(data.device), args.seq_len) for s in starts.split(args.batch_size)]


@torch.no_grad()
def evaluate(model, batches, autocast) -> float:
    model.eval()
    losses = []
    for x, y in batches:
        with autocast():
            logits = model(input_ids=x).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
    model.train()
    return torch.stack(losses).mean().item()


def generate(model, tok, prompt: str, n: int, **kw) -> str:
    enc = tok(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**enc, max_new_tokens=n, pad_token_id=tok.pad_token_id, **kw)
    return tok.decode(out[0], skip_special_tokens=True)


def main(argv=None) -> dict:
    """Train and save; returns the statistics written to the model card."""
    args = parse_args(argv)
    cmd = "python scripts/train_tiny_qwen3.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device if args.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors: one thread is faster and immune to busy cores
    try:
        if args.card_only:
            return _distill().write_card_only(Path(args.out), model_card)
        stats = train(args, device, cmd)
        if args.teacher and not args.smoke:  # the acceptance section of the card
            _distill().write_card_only(Path(args.out), model_card)
        return stats
    finally:
        torch.set_num_threads(threads)


def train(args, device, command) -> dict:
    import transformers
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    t_start, cuda = time.time(), device.type == "cuda"
    torch.manual_seed(args.seed)
    if cuda:  # TF32 for fp32 matmuls (on the CPU this would pick slow bf16 kernels)
        torch.set_float32_matmul_precision("high")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # --- data and tokenizer --------------------------------------------------------------
    text = Path(args.data).read_text(encoding="utf-8")
    text = text[:200_000] if args.smoke else text
    split = int(0.9 * len(text))
    train_text, val_text = text[:split], text[split:]
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tok = train_tokenizer(train_text, args.vocab_size)
    eos_id = tok.convert_tokens_to_ids(EOS)
    teacher = _distill().load_teacher(args.teacher, tok, device) if args.teacher else None
    sample = val_text[:1000] + "  Odd: café ünïcödé → 世界 🎭\n\t x"
    assert tok.decode(tok.encode(sample)) == sample, "tokenizer round-trip failed"
    raw = tok.backend_tokenizer  # whole-text encode, without the max-length warning
    train_ids = torch.tensor(raw.encode(train_text).ids, device=device)
    val_ids = torch.tensor(raw.encode(val_text).ids, device=device)
    t_tok = time.time() - t_start
    print(f"tokenizer: vocab {len(tok)}, train {len(train_ids):,} tokens, val {len(val_ids):,}"
          f" tokens, {len(train_text) / len(train_ids):.2f} chars/token ({t_tok:.1f}s)", flush=True)

    # --- model -----------------------------------------------------------------------------
    # transformers 5.x stores rope_theta as rope_parameters={"rope_type": "default", ...}
    config = Qwen3Config(vocab_size=len(tok), max_position_embeddings=1024, rope_theta=1e6,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=eos_id,
                         eos_token_id=eos_id, pad_token_id=eos_id,
                         **(SMOKE if args.smoke else DRAFT if args.preset == "draft" else FULL))
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    if args.init:
        init_from(model, args.init)
    add_dropout(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())  # the tied embedding counts once
    print(f"model: Qwen3ForCausalLM, {n_params:,} parameters, device {device}", flush=True)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=cuda)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)

    n_windows = 8 if args.smoke else 512  # the full run's val split has ~170: all of them
    val_batches = fixed_batches(val_ids, n_windows, args)
    gen = torch.Generator().manual_seed(args.seed)
    train_eval_batches = fixed_batches(train_ids, n_windows, args, gen)
    if teacher is not None:  # the teacher's own continuations: a training pool, a val set
        dd = _distill()
        pool, gen_val = dd.prepare(teacher, train_ids, val_ids, args, eos_id, autocast)

    # --- training ----------------------------------------------------------------------------
    log, best = [], {"val": (math.inf, math.inf), "step": 0, "state": None}
    tokens_per_step = args.batch_size * args.seq_len
    loss_acc, n_acc = torch.zeros((), device=device), 0
    t_train = t_log = time.time()
    model.train()
    for step in range(1, args.steps + 1):
        lr = lr_at(step - 1, args)
        for g in opt.param_groups:
            g["lr"] = lr
        if teacher is None:
            starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,),
                                   device=device)
            x, y = windows(train_ids, starts, args.seq_len)
        else:
            x, y = dd.mixed_batch(train_ids, pool, args.batch_size, args.seq_len,
                                  args.teacher_generated)
        with autocast():
            logits = model(input_ids=x).logits
        if teacher is None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        else:
            with torch.no_grad(), autocast():
                t_logits = teacher(input_ids=x).logits                      # [B, L, V]
            loss = dd.distill_loss(logits, t_logits, y, args.distill_alpha)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_acc += loss.detach()
        n_acc += 1
        entry = {"step": step}
        if step % args.log_every == 0 or step == args.steps:
            train_loss = loss_acc.item() / n_acc  # the only sync between evaluations
            tps = n_acc * tokens_per_step / (time.time() - t_log)
            loss_acc.zero_()
            n_acc, t_log = 0, time.time()
            entry.update(train_loss=round(train_loss, 4), lr=round(lr, 6))
            print(f"step {step:5d}/{args.steps}  loss {train_loss:.4f}  lr {lr:.2e}  "
                  f"{tps:,.0f} tok/s  {time.time() - t_train:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            t_eval = time.time()
            if teacher is None:
                val = evaluate(model, val_batches, autocast)
                score = (val, 0.0)
                more = ""
            else:  # the kept weights: the best top-1 agreement with the teacher
                m = dd.evaluate_all(model, teacher, val_batches, gen_val, args, autocast)
                val, score = m["val_loss"], (-m["val_agreement"], m["val_kl"])
                entry.update({k: round(v, 4) for k, v in m.items() if k != "val_loss"})
                more = (f"  kl {m['val_kl']:.4f}  agreement {m['val_agreement']:.4f}  on the "
                        f"teacher's text {m['val_gen_agreement']:.4f}")
            entry["val_loss"] = round(val, 4)
            flag = ""
            if score < best["val"]:
                best.update(val=score, step=step, state=copy.deepcopy(model.state_dict()))
                flag = " (best)"
            print(f"step {step:5d}  val loss {val:.4f}  ppl {math.exp(val):.1f}{more}{flag}",
                  flush=True)
            t_log += time.time() - t_eval  # keep evaluation out of tokens/s
        if len(entry) > 1:
            log.append(entry)
    if cuda:
        torch.cuda.synchronize()
    t_train = time.time() - t_train

    # --- the saved model: best weights in bf16 ------------------------------------------------
    model.load_state_dict(best["state"])
    model.to(torch.bfloat16).eval()
    if not cuda:  # CPU bf16 matmuls are slow: compute in fp32 on the bf16-rounded weights
        model.float()
    final_train = evaluate(model, train_eval_batches, autocast)
    final_val = evaluate(model, val_batches, autocast)
    print(f"saved model (bf16, step {best['step']}): train loss {final_train:.4f}, "
          f"val loss {final_val:.4f} (ppl {math.exp(final_val):.1f})", flush=True)
    if teacher is not None:
        distilled = dd.final_stats(model, teacher, val_batches, gen_val, pool, args, autocast)

    n_new = 24 if args.smoke else 200
    greedy = {p: generate(model, tok, p, n_new, do_sample=False) for p in PROMPTS}
    torch.manual_seed(args.seed)
    sampled = generate(model, tok, PROMPTS[0], n_new, do_sample=True, temperature=0.8,
                       top_k=0, top_p=1.0)
    for p, s in greedy.items():
        print(f"\n--- greedy: {p!r} ---\n{s}")
    print(f"\n--- sampled, temperature 0.8: {PROMPTS[0]!r} ---\n{sampled}\n", flush=True)

    # --- save ----------------------------------------------------------------------------------
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id,
                     pad_token_id=eos_id).save_pretrained(out)
    tok.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("rope_theta", 1e6)  # also top-level, for readers of the 4.x layout
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # a name transformers 4.x knows too
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")

    hw = (torch.cuda.get_device_name(device) if cuda else
          f"CPU ({platform.processor() or platform.machine()})")
    stats = {
        "params": n_params, "tokens_seen": args.steps * tokens_per_step,
        "best_step": best["step"], "final_train_loss": round(final_train, 4),
        "final_val_loss": round(final_val, 4), "final_val_ppl": round(math.exp(final_val), 2),
        "train_tokens": len(train_ids), "val_tokens": len(val_ids),
        "val_windows": sum(len(x) for x, _ in val_batches),
        "train_windows": sum(len(x) for x, _ in train_eval_batches),
        "tokenizer_seconds": round(t_tok, 1), "train_seconds": round(t_train, 1),
        "total_seconds": round(time.time() - t_start, 1), "hardware": hw,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(), "command": command,
    }
    record = {"args": vars(args), "config": cfg, "stats": stats, "log": log}
    if teacher is not None:  # and what --card-only needs to rebuild the card
        stats.update(distilled)
        record.update(samples=greedy, n_new=n_new)
    (out / "training_log.json").write_text(json.dumps(record, indent=1))
    (out / "README.md").write_text(model_card(args, stats, greedy, config, n_new))
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors files are written 0600
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    weights = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}: model.safetensors {weights / 1e6:.2f} MB, folder {size / 1e6:.2f} MB, "
          f"{n_params:,} params, total {stats['total_seconds']:.0f}s", flush=True)
    return stats


def init_from(model, path: str) -> None:
    """Load ``path``'s weights into ``model`` (``--init``); a clear error when they differ.

    Raises:
        ValueError: no checkpoint there, or one of another shape.
    """
    from transformers import Qwen3ForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"--init {path!r}: no config.json there")
    src = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    theirs, ours = src.state_dict(), model.state_dict()
    bad = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
    if bad:
        raise ValueError(f"--init {path!r} does not fit the --preset's architecture "
                         f"(first mismatch: {bad[0]})")
    model.load_state_dict({k: theirs[k].to(ours[k].device) for k in ours})


def _purpose(args) -> str:
    if getattr(args, "teacher", None):
        return _distill().purpose(args)
    if args.preset == "draft":
        return ("A smaller tiny Qwen3 (`Qwen3ForCausalLM`) trained from scratch by mrv2's own script,\n"
                "`scripts/train_tiny_qwen3.py --preset draft`, on the same data and with the same\n"
                "tokenizer as the embedded default model (`tiny-qwen3-shakespeare`). mrv2 ships it as\n"
                "that model's **draft model for speculative decoding** (`speculative_config=\n"
                "{\"method\": \"draft_model\", ...}`), so acceptance rates in the tests, the\n"
                "benchmarks and chapter 09 are real. It is a toy, not a useful language model.")
    return ("A tiny Qwen3 (`Qwen3ForCausalLM`) trained from scratch by mrv2's own script,\n"
            "`scripts/train_tiny_qwen3.py`. mrv2 ships it as its embedded default model for demos,\n"
            "the notebooks, tests and CI, so they generate Shakespeare-like text with no download.\n"
            "It is a toy, not a useful language model.")


def _distill():
    """scripts/distill_draft.py (imported on first use: the plain mode never needs it)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import distill_draft

    return distill_draft


def model_card(args, s, greedy, c, n_new, acceptance=None) -> str:
    samples = "\n\n".join(f"Prompt `{p}`:\n\n```text\n{t}\n```" for p, t in greedy.items())
    train_ppl = math.exp(s["final_train_loss"])
    reused = "The target's tokenizer, reused (`--tokenizer`):\n" if args.tokenizer else ""
    kept = f"the best validation loss (step {s['best_step']:,})"
    distilled = ""
    if getattr(args, "teacher", None):
        kept = f"the best validation agreement with the teacher (step {s['best_step']:,})"
        distilled = _distill().card_section(args, s)
        if acceptance:
            distilled += _distill().acceptance_section(acceptance)
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [qwen3, tiny, mrv2, shakespeare]
---

# {Path(args.out).name}

{_purpose(args)}

## Data
Tiny Shakespeare (`input.txt` of karpathy/char-rnn, ~1.1 MB of public-domain Shakespeare).
Split by characters: the first 90% for training ({s['train_tokens']:,} tokens), the last 10%
for validation ({s['val_tokens']:,} tokens).

## Tokenizer
{reused}Byte-level BPE trained with `tokenizers` on the training split: {c.vocab_size:,} tokens
(`<|endoftext|>` = id 0, the 256 bytes, merges). `<|endoftext|>` is EOS, BOS and pad; no
token is added when encoding. ByteLevel pre-tokenizer (no prefix space) and decoder, so
`decode(encode(x)) == x`.

## Architecture
Qwen3 with {c.num_hidden_layers} layers, hidden size {c.hidden_size}, SwiGLU MLP
{c.intermediate_size}, {c.num_attention_heads} query heads and {c.num_key_value_heads} KV heads
of dim {c.head_dim} (GQA, per-head q/k RMSNorm), RoPE theta 1e6, {c.max_position_embeddings}
positions, tied embeddings: **{s['params']:,} parameters**, stored in bf16.

## Training
| | |
| --- | --- |
| steps | {args.steps:,}, batch {args.batch_size} x {args.seq_len} tokens |
| tokens seen | {s['tokens_seen']:,} |
| optimizer | AdamW (0.9, 0.95), weight decay 0.1, peak LR {args.lr:g}, {args.warmup} warm-up steps, cosine to 10%, grad clip 1.0 |
| regularization | residual dropout {args.dropout:g}; the weights kept are those of {kept} |
| final train loss | {s['final_train_loss']:.4f} nats/token (perplexity {train_ppl:.2f}) |
| final validation loss | {s['final_val_loss']:.4f} nats/token (perplexity {s['final_val_ppl']:.2f}) |
| wall time | {s['train_seconds']:.0f} s training, {s['tokenizer_seconds']:.0f} s tokenizer and data, {s['total_seconds']:.0f} s in all |
| hardware | {s['hardware']} (bf16 autocast on CUDA) |
| software | torch {s['torch']}, transformers {s['transformers']} |
| date | {s['date']} |

Losses are those of the saved bf16 weights, over {s['val_windows']} non-overlapping
{args.seq_len}-token windows from the start of the validation split and
{s['train_windows']} fixed random windows of the training split.
`training_log.json` holds the loss curve, the config and the timings. Command, from the
repository root:

```bash
{s['command']}
```
{distilled}
## Greedy samples ({n_new} new tokens)

{samples}
"""


if __name__ == "__main__":
    main()
