"""The EAGLE-1 draft head: ``fc(concat(embed(token), target feature))`` -> decoder layer(s).

Which variant: **EAGLE-1** (Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty"), as vLLM's ``EagleLlamaForCausalLM`` runs it. The head
sees, at position ``p``, the embedding of token ``x_{p+1}`` and the target's last-layer
hidden state ``h_p`` (after the target's final norm: the very vector its lm_head reads),
mixes them with ``fc`` (``2H -> H``), runs one decoder layer whose input norm is skipped
(EAGLE-1 drops it: ``fc``'s output is the residual stream) and returns
``mlp_out + residual`` *without* a final norm: a predicted next feature ``f_p`` that lives
where ``h_{p+1}`` lives, so the target's lm_head (shared, never copied) turns it into the
logits of ``x_{p+2}``; chained steps feed ``f_p`` back as the next feature. EAGLE-3's fused
low/mid/high-layer features and reduced draft vocabulary are not built: they need hooks in
the target's layers and a vocabulary map, and the tiny target has 4 layers and 2,048 ids.

Checkpoint layout (``load_eagle_head``): the EAGLE-1 format of the published heads vLLM
loads (yuhuili/EAGLE-LLaMA3-Instruct-8B style): a ``config.json`` of the head's base
architecture with ``num_hidden_layers`` (usually 1) and safetensors ``fc.weight`` (and an
optional ``fc.bias``), ``layers.N.self_attn.*``, ``layers.N.mlp.*``,
``layers.N.post_attention_layernorm.weight``; ``embed_tokens.weight`` / ``lm_head.weight``
only where the head has its own (else the target's are shared); names may carry a
``model.`` prefix. ``model_type`` ``qwen3`` turns the per-head q/k norm on (the Qwen3
variant), ``llama`` off. vLLM's wrapped ``{"model_type": "eagle", "model": {...}}`` config
is read too. See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from mrv2.models.loader import _open_safetensors, weight_files
from mrv2.models.qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding, model_dims, rope_theta

#: Checkpoint names of EAGLE-3 heads (refused, with a message that says so).
_EAGLE3 = re.compile(r"^(model\.)?(midlayer\.|d2t$|t2d$)")
#: Names dropped on purpose: EAGLE-1's first layer has no input norm; RoPE buffers.
_DROPPED = re.compile(r"^layers\.0\.input_layernorm\.weight$|rotary_emb\.inv_freq$")


def read_head_config(path: str | Path):
    """The head's Hugging Face config (vLLM's wrapped ``model_type: eagle`` unwrapped).

    Raises:
        ValueError: no readable ``config.json``.
    """
    from transformers import AutoConfig

    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"EAGLE head {path}: cannot read config.json ({e})") from None
    if raw.get("model_type") == "eagle" and isinstance(raw.get("model"), dict):
        raw = {**raw["model"], "architectures": raw.get("architectures", [])}
    model_type = raw.pop("model_type", "llama")
    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as e:
        raise ValueError(f"EAGLE head {path}: model_type {model_type!r} ({e})") from None


class EagleHead(nn.Module):
    """EAGLE-1 head over a flat token layout and its own paged KV cache.

    Args:
        config: the head's Hugging Face config (``hidden_size`` = the target's).
        fc_bias: whether ``fc`` has a bias (original EAGLE-1 heads do, vLLM's do not).

    Forward: ``embeds [T, H]``, ``features [T, H]``, ``positions [T]`` -> ``[T, H]``
    predicted next features (attention metadata from the forward context, as for the
    target).
    """

    def __init__(self, config, fc_bias: bool = False):
        super().__init__()
        d = model_dims(config)
        use_qk_norm = getattr(config, "model_type", "llama") == "qwen3"
        bias = bool(getattr(config, "attention_bias", False))
        self.config = config
        self.fc = nn.Linear(2 * d.hidden_size, d.hidden_size, bias=fc_bias)
        self.rotary_emb = Qwen3RotaryEmbedding(d.head_dim, config.max_position_embeddings,
                                               rope_theta(config))
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, self.rotary_emb, use_qk_norm, bias, bias)
            for _ in range(d.num_layers))
        # NOTE: EAGLE-1 skips the first layer's input norm: fc's output IS the residual.
        self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens: nn.Embedding | None = None  # only when the checkpoint has one
        self.lm_head: nn.Linear | None = None

    def forward(self, embeds: torch.Tensor, features: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.cat((embeds, features), dim=-1))                   # [T, H]
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return h + residual                                                 # [T, H], no norm


def _canonical(name: str) -> str:
    return name.removeprefix("model.")


def load_eagle_head(path: str | Path, dtype: torch.dtype, device: torch.device
                    ) -> tuple[EagleHead, object]:
    """Build an ``EagleHead`` from a checkpoint folder (EAGLE-1 layout, see the module).

    Args:
        path: the head's folder (``config.json`` + ``*.safetensors``).
        dtype, device: as the target's.

    Returns:
        ``(head in eval mode, its config)``.

    Raises:
        ValueError: an EAGLE-3 checkpoint, a missing / unexpected tensor or a shape
            mismatch, named.
    """
    path = Path(path)
    config = read_head_config(path)
    files = weight_files(path)
    shapes: dict[str, tuple[tuple[int, ...], Path, str]] = {}
    for f in files:
        with _open_safetensors(f) as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _EAGLE3.match(name):
                    raise ValueError(f"EAGLE head {path}: tensor {name!r} belongs to an EAGLE-3 "
                                     "head; mrv2 runs EAGLE-1 heads only")
                canon = _canonical(name)
                if not _DROPPED.search(canon):
                    shapes[canon] = (tuple(sf.get_slice(name).get_shape()), f, name)
    head = EagleHead(config, fc_bias="fc.bias" in shapes)
    d = model_dims(config)
    if "embed_tokens.weight" in shapes:
        head.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size)
    if "lm_head.weight" in shapes:
        head.lm_head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)
    head = head.to(dtype).to(device)
    params = dict(head.named_parameters())
    unexpected = sorted(set(shapes) - set(params))
    if unexpected:
        raise ValueError(f"EAGLE head {path}: unexpected tensor(s) {', '.join(unexpected[:6])}"
                         " (expected fc.*, layers.N.*, and optionally embed_tokens / lm_head)")
    missing = sorted(set(params) - set(shapes))
    if missing:
        raise ValueError(f"EAGLE head {path}: checkpoint is missing tensor(s) "
                         f"{', '.join(missing[:6])}")
    for canon, (shape, f, _) in shapes.items():
        if shape != tuple(params[canon].shape):
            raise ValueError(f"EAGLE head {path}: tensor {canon!r} has shape {shape} in "
                             f"{f.name}, expected {tuple(params[canon].shape)}")
    with torch.no_grad():
        for f in files:
            with _open_safetensors(f) as sf:
                for canon, (_, g, name) in shapes.items():
                    if g == f:
                        params[canon].copy_(sf.get_tensor(name))  # casts to dtype / device
    return head.eval(), config
