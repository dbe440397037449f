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
own features in chained steps) and, with ``--unroll 2``, a second pass that feeds the head
its own features (a cheap version of EAGLE-3's training-time test). The embedding and
lm_head are the target's and are not saved: the checkpoint holds ``fc.weight`` and
``layers.0.*`` only, the EAGLE-1 layout vLLM's ``EagleLlamaForCausalLM`` loads
(``mrv2/spec_decode/eagle_head.py``).

    python scripts/train_eagle_head.py                                  # GPU, ~1 min
    python scripts/train_eagle_head.py --device cpu --steps 300 --batch-size 8   # CPU
    python scripts/train_eagle_head.py --smoke --out /tmp/eagle         # seconds, CPU
    python scripts/train_eagle_head.py --card-only      # re-measure acceptance, rewrite README

After training (not with ``--smoke``) the script measures acceptance with mrv2 itself
(greedy, K = 3, the same prompts for no speculation, n-gram, the shipped draft model and
the new head) and writes the model card ``README.md`` with the training figures.
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
from torch import nn

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
    p.add_argument("--unroll", type=int, choices=(1, 2), default=1,
                   help="2: a second pass on the head's own features (chained-step robustness)")
    p.add_argument("--max-train-windows", type=int, default=None,
                   help="use only the first N training windows (the CPU run: less target work)")
    p.add_argument("--max-val-windows", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads on the CPU")
    p.add_argument("--smoke", action="store_true", help="6 steps on a small slice (seconds)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--card-only", action="store_true",
                   help="no training: measure acceptance of the head in --out, write README.md")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size, args.seq_len = 6, 2, 32
        args.warmup, args.eval_every, args.log_every = 2, 3, 2
    return args


# -- the head in plain torch (the training twin of mrv2/spec_decode/eagle_head.py) --------

class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
                * self.weight.float()).to(x.dtype)


def rope(x, cos, sin):
    """Rotate-half RoPE of ``x [B, H, L, D]`` with ``cos/sin [L, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.h, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.d, c.rms_norm_eps), RMSNorm(self.d, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.h, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, self.hkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.hkv, self.d).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.h // self.hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # [B, H, L, D]
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """A Qwen3 decoder layer without its input norm (EAGLE-1's first layer)."""

    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(x, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """``fc(concat(embed, feature))`` -> one layer; names are the checkpoint's."""

    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([Layer(c)])
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, embeds, features):
        """``[B, L, H]`` embeddings of ``x_{p+1}`` and features ``h_p`` -> ``f_p [B, L, H]``."""
        pos = torch.arange(embeds.shape[1], device=embeds.device).float()
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(embeds.dtype), emb.sin().to(embeds.dtype)
        x = self.fc(torch.cat((embeds, features), dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


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


def head_losses(head, target, x, feats, args, autocast, train: bool):
    """CE (and accuracy) of ``x_{p+2}`` and the feature loss; ``x [B, L]``, ``feats`` of x."""
    emb = target.model.embed_tokens(x[:, 1:]).float()                       # [B, L-1, H]
    h_in = feats[:, :-1]                                                    # h_p, p < L-1
    if train and args.feature_noise > 0:
        h_in = h_in + (torch.rand_like(h_in) * 2 - 1) * args.feature_noise
    ce_sum, feat_sum, acc = 0.0, 0.0, None
    for u in range(args.unroll if train else 1):
        with autocast():
            f = head(emb, h_in).float()                                     # f_p [B, L-1, H]
        logits = target.lm_head(f[:, :-1]).float()                          # -> x_{p+2}
        if train and args.labels == "target":  # soft labels: the target's own p(x_{p+2})
            soft = torch.softmax(target.lm_head(feats[:, 1:-1]).float(), dim=-1)
            ce = -(soft * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        else:
            ce = F.cross_entropy(logits.flatten(0, 1), x[:, 2:].flatten())
        feat = F.smooth_l1_loss(f[:, :-1], feats[:, 1:-1])
        ce_sum, feat_sum = ce_sum + ce, feat_sum + feat
        if acc is None:
            acc = (logits.argmax(-1) == x[:, 2:]).float().mean()
        # Unrolled pass: position p reads the head's own f_{p-1} (~h_p) instead of h_p.
        h_in = torch.cat((feats[:, :1], f[:, :-1]), dim=1) if u == 0 else h_in
    return ce_sum, feat_sum, acc


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
def evaluate(head, target, val, feats, args, autocast) -> tuple[float, float]:
    head.eval()
    ces, accs = [], []
    for i in range(0, len(val), args.batch_size):
        ce, _, acc = head_losses(head, target, val[i:i + args.batch_size],
                                 feats[i:i + args.batch_size], args, autocast, train=False)
        ces.append(ce.item())
        accs.append(acc.item())
    head.train()
    return sum(ces) / len(ces), sum(accs) / len(accs)


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
    try:
        if not args.card_only:
            stats = train(args, device, cmd)
            if args.smoke:
                return stats
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from eagle_head_card import write_card  # scripts/eagle_head_card.py

        write_card(Path(args.out), TARGET)
        return json.loads((Path(args.out) / "training_log.json").read_text())["stats"]
    finally:
        torch.set_num_threads(threads)


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
    # The frozen target's features, once per window (the only target compute).
    t_feat = time.time()
    train_f, val_f = (torch.cat([target_features(target, w[i:i + 64], autocast)
                                 for i in range(0, len(w), 64)]) for w in (train_w, val_w))
    t_feat = time.time() - t_feat
    print(f"data: {len(train_w)} train / {len(val_w)} val windows of {args.seq_len} tokens; "
          f"target features in {t_feat:.0f}s", flush=True)

    # --- the head ---------------------------------------------------------------------------
    hcfg = argparse.Namespace(
        hidden_size=tcfg.hidden_size, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
        intermediate_size=args.intermediate_size or tcfg.intermediate_size,
        rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta)
    head = EagleHead(hcfg).to(device)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"head: fc {2 * hcfg.hidden_size}->{hcfg.hidden_size} + 1 Qwen3 layer "
          f"(MLP {hcfg.intermediate_size}), {n_params:,} parameters, device {device}", flush=True)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    log, best = [], {"val": float("inf"), "step": 0, "state": None, "acc": 0.0}
    t_train = time.time()
    for step in range(1, args.steps + 1):
        lr = lr_at(step - 1, args)
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(0, len(train_w), (args.batch_size,), device=device, generator=gen)
        ce, feat, acc = head_losses(head, target, train_w[pick], train_f[pick], args,
                                    autocast, train=True)
        loss = ce + args.feature_weight * feat
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        entry = {"step": step}
        if step % args.log_every == 0 or step == args.steps:
            entry.update(train_ce=round(ce.item() / args.unroll, 4),
                         train_feat=round(feat.item() / args.unroll, 4),
                         train_acc=round(acc.item(), 4), lr=round(lr, 6))
            print(f"step {step:5d}/{args.steps}  ce {entry['train_ce']:.4f}  feat "
                  f"{entry['train_feat']:.4f}  acc {entry['train_acc']:.3f}  "
                  f"{time.time() - t_train:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            val, vacc = evaluate(head, target, val_w, val_f, args, autocast)
            entry.update(val_ce=round(val, 4), val_acc=round(vacc, 4))
            flag = ""
            if val < best["val"]:
                best.update(val=val, step=step, acc=vacc,
                            state={k: v.detach().clone() for k, v in head.state_dict().items()})
                flag = " (best)"
            print(f"step {step:5d}  val ce {val:.4f}  val top-1 {vacc:.3f}{flag}", flush=True)
        if len(entry) > 1:
            log.append(entry)
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
             "train_windows": len(train_w), "val_windows": len(val_w),
             "tokens_seen": args.steps * args.batch_size * args.seq_len,
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
