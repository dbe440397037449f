"""Train an EAGLE-1 draft head for mrv2's embedded tiny Qwen3 on Tiny Shakespeare.

The target (``mrv2/assets/tiny-qwen3-shakespeare``) stays frozen. For a window of tokens
``x_0 .. x_L`` its last-layer hidden states ``h_p`` (after the final norm, what its lm_head
reads) are computed once per window; the head at position ``p`` reads
``fc(concat(embed(x_{p+1}), h_p))`` through one Qwen3 decoder layer (no input norm, as in
EAGLE-1) and its output ``f_p`` is trained to

* predict ``x_{p+2}`` through the target's **shared** lm_head (cross-entropy against the
  data's tokens, or with ``--labels target`` against the target's own distribution, as
  EAGLE-1 does), and
* regress the target's next feature ``h_{p+1}`` (smooth L1, EAGLE's feature loss),

with small uniform noise on the input features (EAGLE-1's trick against the drift of its
own features in chained steps) and, with ``--unroll 2`` or ``3``, more passes that feed the
head its own features of the pass before (the chained draft steps; a cheap version of
EAGLE-3's training-time test). With ``--teacher-generated F`` a fraction ``F`` of each
batch's rows are sequences the target itself continued (``distill_draft.teacher_sequences``:
random training-split prompts, half greedy, half T = 1): at inference the head drafts the
target's own text. ``--init`` fine-tunes an existing head. The embedding and lm_head are the
target's and are not saved: the checkpoint holds ``fc.weight`` and ``layers.0.*`` only, the
EAGLE-1 layout vLLM's ``EagleLlamaForCausalLM`` loads (``mrv2/spec_decode/eagle_head.py``).

    python scripts/train_eagle_head.py                                  # GPU, ~1 min
    python scripts/train_eagle_head.py --labels target --unroll 3 --teacher-generated 0.75 \
        --teacher-pool 4096 --steps 3000 --out /tmp/eagle               # GPU, the full recipe
    python scripts/train_eagle_head.py --device cpu --threads 2 --init mrv2/assets/\
tiny-qwen3-shakespeare-eagle --labels target --unroll 3 --teacher-generated 0.75 \
        --teacher-pool 256 --seq-len 128 --batch-size 8 --lr 3e-4 --warmup 30 \
        --max-train-windows 256 --max-val-windows 32 --time-budget 1200 --out /tmp/eagle  # CPU
    python scripts/train_eagle_head.py --smoke --out /tmp/eagle         # seconds, CPU
    python scripts/train_eagle_head.py --card-only      # re-measure acceptance, rewrite README

The kept weights are those of the best validation step: the lowest validation CE, or (with
target-generated rows, ``--select chain``) the highest summed top-1 of chained passes 1..3
on the target's greedy continuations of validation-split prompts. After training (not with
``--smoke``) the script measures acceptance with mrv2 itself (greedy, K = 3 and 5, the same
prompts for no speculation, n-gram, the shipped draft model, the ``--init`` head and the new
one) and writes the model card ``README.md`` with the training figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the twin, distill_draft
from distill_draft import prompt_len, teacher_sequences
from eagle_head_twin import EagleHead

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "mrv2/assets/tiny-qwen3-shakespeare"
SHARED = Path(os.environ.get("MRV2_SHARED_DATA", REPO.parent / "shared" / "data"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(SHARED / "tinyshakespeare.txt"))
    p.add_argument("--target", default=str(TARGET), help="the frozen target's HF folder")
    p.add_argument("--out", default=str(REPO / "mrv2/assets/tiny-qwen3-shakespeare-eagle"))
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="the head's MLP width (default: the target's)")
    p.add_argument("--feature-weight", type=float, default=1.0,
                   help="weight of the feature regression (smooth L1) beside the CE loss")
    p.add_argument("--feature-noise", type=float, default=0.1,
                   help="uniform noise U(-a, a) added to the input features in training")
    p.add_argument("--labels", choices=("tokens", "target"), default="tokens",
                   help="the CE's labels: the data's next tokens, or the frozen target's own "
                        "distribution at p + 1 (EAGLE-1's soft labels, softmax of lm_head(h))")
    p.add_argument("--unroll", type=int, choices=(1, 2, 3), default=1,
                   help="2, 3: more passes, each on the head's own features of the pass before "
                        "(EAGLE's training-time test: the chained steps of inference)")
    p.add_argument("--teacher-generated", type=float, default=0.0,
                   help="fraction of each batch's rows taken from sequences the target itself "
                        "continued (distill_draft.teacher_sequences: half greedy, half T=1)")
    p.add_argument("--teacher-pool", type=int, default=1024,
                   help="how many target-generated training sequences to make (once)")
    p.add_argument("--init", default=None,
                   help="an EAGLE head folder to start from (fine-tuning), e.g. the shipped one")
    p.add_argument("--select", choices=("auto", "ce", "chain"), default="auto",
                   help="which validation step to keep: lowest val CE, or highest chain "
                        "top-1 on the target's greedy continuations (auto: chain when "
                        "--teacher-generated > 0)")
    p.add_argument("--max-train-windows", type=int, default=None,
                   help="use only the first N training windows (the CPU run: less target work)")
    p.add_argument("--max-val-windows", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training: stop at the first evaluation past it (CPU runs)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads on the CPU")
    p.add_argument("--smoke", action="store_true", help="6 steps on a small slice (seconds)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--card-only", action="store_true",
                   help="no training: measure acceptance of the head in --out, write README.md")
    args = p.parse_args(argv)
    if not 0.0 <= args.teacher_generated <= 1.0:
        p.error(f"--teacher-generated {args.teacher_generated}: a fraction in [0, 1]")
    if args.select == "auto":
        args.select = "chain" if args.teacher_generated > 0 else "ce"
    if args.smoke:
        args.steps, args.batch_size, args.seq_len = 6, 2, 32
        args.warmup, args.eval_every, args.log_every = 2, 3, 2
    return args


# -- data, the frozen target, the losses ------------------------------------------------

def load_target(path: str, device):
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    cfg.rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get(
        "rope_theta", getattr(cfg, "rope_theta", 1e6))
    target = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target, cfg, AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def target_features(target, x, autocast):
    """Post-norm last-layer hidden states ``[B, L, H]`` (what the lm_head reads), fp32."""
    with autocast():
        return target.model(input_ids=x).last_hidden_state.float()


def head_losses(head, target, x, feats, args, autocast, train: bool, passes=None,
                skip: int = 0):
    """CE and feature loss of ``x_{p+2}`` summed over the passes, and each pass's top-1.

    Pass 0 reads the target's features ``h_p`` (with noise in training); pass ``u > 0`` reads
    at position ``p`` the head's own ``f_{p-1}`` of pass ``u - 1``, so pass ``u`` is the
    ``(u+1)``-th chained draft step of inference from a true feature ``u`` positions back.

    Args:
        x: tokens ``[B, L]``; feats: the target's features of ``x`` ``[B, L, H]``.
        train: noise and soft labels (``--labels target``); else plain CE against ``x``.
        passes: how many passes (default: ``args.unroll`` in training, else 1).
        skip: top-1 only from position ``skip`` on (a generated sequence's prompt excluded).

    Returns:
        ``(ce_sum, feat_sum, [top-1 of each pass])`` (0-d tensors).
    """
    passes = passes or (args.unroll if train else 1)
    emb = target.model.embed_tokens(x[:, 1:]).float()                       # [B, L-1, H]
    h_in = feats[:, :-1]                                                    # h_p, p < L-1
    if train and args.feature_noise > 0:
        h_in = h_in + (torch.rand_like(h_in) * 2 - 1) * args.feature_noise
    soft = None
    if train and args.labels == "target":  # soft labels: the target's own p(x_{p+2})
        soft = torch.softmax(target.lm_head(feats[:, 1:-1]).float(), dim=-1)  # [B, L-2, V]
    ce_sum, feat_sum, accs = 0.0, 0.0, []
    for _ in range(passes):
        with autocast():
            f = head(emb, h_in).float()                                     # f_p [B, L-1, H]
        logits = target.lm_head(f[:, :-1]).float()                          # -> x_{p+2}
        if soft is not None:
            ce = -(soft * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        else:
            ce = F.cross_entropy(logits.flatten(0, 1), x[:, 2:].flatten())
        ce_sum = ce_sum + ce
        feat_sum = feat_sum + F.smooth_l1_loss(f[:, :-1], feats[:, 1:-1])
        accs.append((logits[:, skip:].argmax(-1) == x[:, 2 + skip:]).float().mean())
        # Next pass: position p reads the head's own f_{p-1} (~h_p) instead of h_p.
        h_in = torch.cat((feats[:, :1], f[:, :-1]), dim=1)
    return ce_sum, feat_sum, accs


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows ``[N, seq_len]`` from the start."""
    n = (len(ids) - 1) // seq_len
    return ids[:n * seq_len].view(n, seq_len)


@torch.no_grad()
def evaluate(head, target, val, feats, args, autocast, passes: int = 1,
             skip: int = 0) -> tuple[float, list[float]]:
    """Mean CE of pass 0 and the top-1 of each of ``passes`` chained passes on ``val``."""
    head.eval()
    ces, accs = [], []
    for i in range(0, len(val), args.batch_size):
        ce, _, acc = head_losses(head, target, val[i:i + args.batch_size],
                                 feats[i:i + args.batch_size], args, autocast, train=False,
                                 passes=passes, skip=skip)
        ces.append(ce.item() / passes)
        accs.append([a.item() for a in acc])
    head.train()
    return sum(ces) / len(ces), [sum(a[u] for a in accs) / len(accs) for u in range(passes)]


def init_config(path: str) -> dict:
    """The ``--init`` head's config.json (checked before any work).

    Raises:
        ValueError: naming ``--init`` when the folder holds no head checkpoint.
    """
    folder = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise ValueError(f"--init {path!r}: no {name} there (an EAGLE head folder)")
    return json.loads((folder / "config.json").read_text())


def init_head(head, path: str) -> None:
    """Load the EAGLE head in ``path`` into ``head`` (``--init``), fp32.

    Raises:
        ValueError: naming ``--init`` when there is no checkpoint or it does not fit.
    """
    from safetensors.torch import load_file

    f = Path(path) / "model.safetensors"
    if not f.is_file():
        raise ValueError(f"--init {path!r}: no model.safetensors there")
    theirs, ours = load_file(str(f)), head.state_dict()
    bad = sorted(set(theirs) ^ set(ours)) or [k for k in ours if theirs[k].shape != ours[k].shape]
    if bad:
        raise ValueError(f"--init {path!r} does not fit the head (first mismatch: {bad[0]}; "
                         "--intermediate-size must match the checkpoint's)")
    head.load_state_dict({k: v.float().to(ours[k].device) for k, v in theirs.items()})


def main(argv=None) -> dict:
    """Train and save; returns the statistics written to the model card."""
    args = parse_args(argv)
    cmd = "python scripts/train_eagle_head.py " + shlex.join(sys.argv[1:] if argv is None
                                                             else argv)
    device = torch.device(args.device if args.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    if str(REPO) not in sys.path:  # `python scripts/...` without an installed mrv2
        sys.path.append(str(REPO))
    import mrv2  # noqa: F401  (before transformers: on the CPU it routes Triton to its interpreter)

    if args.init and not args.card_only:
        init_config(args.init)
    try:
        if not args.card_only:
            stats = train(args, device, cmd)
            if args.smoke:
                return stats
        from eagle_head_card import write_card  # scripts/eagle_head_card.py

        write_card(Path(args.out), TARGET)
        return json.loads((Path(args.out) / "training_log.json").read_text())["stats"]
    finally:
        torch.set_num_threads(threads)


#: Chained passes scored on the target's greedy continuations (the draft steps K = 1 .. 3).
CHAIN = 3


def generated(target, tok, train_ids, val_ids, args, autocast):
    """The target's own continuations: ``(pool, gen_val, seconds)``, ``[n, seq_len]`` each.

    ``pool``: ``--teacher-pool`` sequences continuing random training-split prompts (half
    greedy, half T = 1; empty without ``--teacher-generated``); ``gen_val``: greedy
    continuations of validation-split prompts (always: the chain top-1 of the log).
    """
    t0 = time.time()
    eos, n_val = tok.eos_token_id, 4 if args.smoke else 64
    empty = torch.empty(0, args.seq_len, dtype=train_ids.dtype, device=train_ids.device)
    pool = empty if args.teacher_generated <= 0 else teacher_sequences(
        target, train_ids, 8 if args.smoke else args.teacher_pool, args.seq_len - 1, eos,
        autocast, args.seed)
    gen_val = teacher_sequences(target, val_ids, n_val, args.seq_len - 1, eos, autocast,
                                args.seed + 1, greedy_only=True)
    return pool, gen_val, time.time() - t0


def train(args, device, command) -> dict:
    from safetensors.torch import save_file

    t0, cuda = time.time(), device.type == "cuda"
    torch.manual_seed(args.seed)
    if cuda:
        torch.set_float32_matmul_precision("high")
    target, tcfg, tok = load_target(args.target, device)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)

    # --- data: the target's split (first 90% of the characters), its tokenizer ------------
    text = Path(args.data).read_text(encoding="utf-8")
    text = text[:100_000] if args.smoke else text
    split = int(0.9 * len(text))
    raw = tok.backend_tokenizer
    train_ids = torch.tensor(raw.encode(text[:split]).ids, device=device)
    val_ids = torch.tensor(raw.encode(text[split:]).ids, device=device)
    train_w, val_w = windows(train_ids, args.seq_len), windows(val_ids, args.seq_len)
    if args.smoke:
        args.max_train_windows, args.max_val_windows = 16, 4
    train_w, val_w = train_w[:args.max_train_windows], val_w[:args.max_val_windows]
    # The target's own continuations (training pool, greedy validation), distill_draft's.
    pool, gen_val, t_pool = generated(target, tok, train_ids, val_ids, args, autocast)
    # The frozen target's features, once per window (the only target compute).
    t_feat = time.time()
    train_f, val_f, pool_f, gen_val_f = (
        torch.cat([target_features(target, w[i:i + 64], autocast)
                   for i in range(0, len(w), 64)] or [w[:, :, None].float()])
        for w in (train_w, val_w, pool, gen_val))
    t_feat = time.time() - t_feat
    print(f"data: {len(train_w)} train / {len(val_w)} val windows of {args.seq_len} tokens, "
          f"{len(pool)} / {len(gen_val)} of the target's own ({t_pool:.0f}s); "
          f"target features in {t_feat:.0f}s", flush=True)
    skip = prompt_len(args.seq_len - 1) - 1  # a generated sequence's continuation starts here

    # --- the head ---------------------------------------------------------------------------
    hcfg = argparse.Namespace(
        hidden_size=tcfg.hidden_size, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
        intermediate_size=args.intermediate_size or tcfg.intermediate_size,
        rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta)
    if args.init:  # the checkpoint's MLP width, unless given
        hcfg.intermediate_size = args.intermediate_size or init_config(args.init)[
            "intermediate_size"]
    head = EagleHead(hcfg).to(device)
    if args.init:
        init_head(head, args.init)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"head: fc {2 * hcfg.hidden_size}->{hcfg.hidden_size} + 1 Qwen3 layer "
          f"(MLP {hcfg.intermediate_size}), {n_params:,} parameters, device {device}", flush=True)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    log, best = [], {"val": float("inf"), "step": 0, "state": None, "acc": 0.0,
                     "chain": [], "score": -float("inf")}
    n_gen = round(args.teacher_generated * args.batch_size)
    t_train = time.time()
    for step in range(0 if args.init else 1, args.steps + 1):  # step 0: the --init head
        entry = {"step": step}
        if step:
            lr = lr_at(step - 1, args)
            for g in opt.param_groups:
                g["lr"] = lr
            pick = torch.randint(0, len(train_w), (args.batch_size - n_gen,), device=device,
                                 generator=gen)
            xb, fb = train_w[pick], train_f[pick]
            if n_gen:  # rows of the target's own continuations
                pick = torch.randint(0, len(pool), (n_gen,), device=device, generator=gen)
                xb, fb = torch.cat((xb, pool[pick])), torch.cat((fb, pool_f[pick]))
            ce, feat, accs = head_losses(head, target, xb, fb, args, autocast, train=True)
            acc = accs[0]
            loss = ce + args.feature_weight * feat
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            if step % args.log_every == 0 or step == args.steps:
                entry.update(train_ce=round(ce.item() / args.unroll, 4),
                             train_feat=round(feat.item() / args.unroll, 4),
                             train_acc=round(acc.item(), 4), lr=round(lr, 6))
                print(f"step {step:5d}/{args.steps}  ce {entry['train_ce']:.4f}  feat "
                      f"{entry['train_feat']:.4f}  acc {entry['train_acc']:.3f}  "
                      f"{time.time() - t_train:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            val, (vacc,) = evaluate(head, target, val_w, val_f, args, autocast)
            _, chain = evaluate(head, target, gen_val, gen_val_f, args, autocast,
                                passes=CHAIN, skip=skip)
            entry.update(val_ce=round(val, 4), val_acc=round(vacc, 4),
                         gen_chain_top1=[round(a, 4) for a in chain])
            score = -val if args.select == "ce" else sum(chain)
            flag = ""
            if score > best["score"]:
                best.update(val=val, step=step, acc=vacc, chain=chain, score=score,
                            state={k: v.detach().clone() for k, v in head.state_dict().items()})
                flag = " (best)"
            print(f"step {step:5d}  val ce {val:.4f}  val top-1 {vacc:.3f}  chain top-1 on "
                  f"the target's text {' '.join(f'{a:.3f}' for a in chain)}{flag}", flush=True)
        if len(entry) > 1:
            log.append(entry)
        if ("val_ce" in entry and args.time_budget
                and time.time() - t_train > args.time_budget):
            print(f"time budget {args.time_budget:.0f}s spent at step {step}", flush=True)
            break
    t_train = time.time() - t_train

    # --- save: bf16 safetensors in the EAGLE-1 layout, an HF-style config -------------------
    head.load_state_dict(best["state"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(args.target) / "config.json").read_text())
    cfg.update(architectures=["EagleQwen3ForCausalLM"], num_hidden_layers=1,
               intermediate_size=hcfg.intermediate_size, layer_types=["full_attention"],
               dtype="bfloat16", eagle_method="eagle",
               eagle_target=Path(args.target).name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    hw = (torch.cuda.get_device_name(device) if cuda else
          f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          "threads)")
    stats = {"params": n_params, "best_step": best["step"],
             "best_val_ce": round(best["val"], 4), "best_val_top1": round(best["acc"], 4),
             "best_gen_chain_top1": [round(a, 4) for a in best["chain"]],
             "train_windows": len(train_w), "val_windows": len(val_w),
             "pool_sequences": len(pool) if n_gen else 0, "gen_val_sequences": len(gen_val),
             "pool_seconds": round(t_pool, 1),
             "steps_run": step, "tokens_seen": step * args.batch_size * args.seq_len,
             "feature_seconds": round(t_feat, 1), "train_seconds": round(t_train, 1),
             "total_seconds": round(time.time() - t0, 1), "hardware": hw,
             "torch": torch.__version__, "date": datetime.date.today().isoformat(),
             "command": command}
    (out / "training_log.json").write_text(json.dumps(
        {"args": vars(args), "config": cfg, "stats": stats, "log": log}, indent=1))
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors files are written 0600
    print(f"wrote {out}: best step {best['step']}, val ce {best['val']:.4f}, val top-1 "
          f"{best['acc']:.3f}, {n_params:,} params, {stats['total_seconds']:.0f}s", flush=True)
    return stats


if __name__ == "__main__":
    main()
