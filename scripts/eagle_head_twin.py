"""The EAGLE-1 head in plain torch: the training twin of ``mrv2/spec_decode/eagle_head.py``.

Used by ``scripts/train_eagle_head.py`` (and by tests/test_spec_eagle.py, which checks mrv2's
paged head against it). Parameter names are the checkpoint's (EAGLE-1 layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
