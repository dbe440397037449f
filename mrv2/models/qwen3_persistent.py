"""Qwen3's 1-2-row decode forward as two launches a layer (mrv2/kernels/persistent_layer.py).

``Qwen3Model.forward`` takes this path for a decode batch of 1-2 tokens on a Hopper GPU
(``persistent_layer.ENABLED``: off by default, ``MRV2_PERSISTENT_DECODE=1`` turns it on) when no linear
after attention has a bias (Qwen3's layout): the first layer's norm + qkv, then per layer

    attention      q/k-norm + RoPE + KV write + paged attention (one or two kernels)
    layer_tail     o_proj + add | norm + gate_up + SiLU * up | down + add | next norm + qkv

instead of ``Qwen3DecoderLayer.forward_decode``'s qkv, attention, o_proj, gate_up, down.
The numerics are the per-GEMM kernels' (tests/test_persistent_layer.py).
"""

from __future__ import annotations

import torch
from torch import nn

from mrv2.kernels import persistent_layer
from mrv2.kernels.persistent_layer import layer_tail
from mrv2.kernels.skinny_fused import skinny_norm_linear


def use_persistent_decode(layers: nn.ModuleList, h: torch.Tensor) -> bool:
    """Whether a decode forward over ``h [T, hidden]`` takes :func:`forward_decode_persistent`.
    Reads only shapes, flags and which biases exist: graph- and sync-safe."""
    return persistent_layer.ENABLED and 1 <= h.shape[0] <= persistent_layer.MAX_M and all(
        la.self_attn.o_proj.bias is None and la.mlp._packed["gate_up"][1] is None
        and la.mlp.down_proj.bias is None and la.self_attn._packed["qkv"][1] is None
        for la in layers)


def forward_decode_persistent(layers: nn.ModuleList, positions: torch.Tensor,
                              h: torch.Tensor) -> torch.Tensor:
    """Run the decoder ``layers`` over the residual stream ``h [T, hidden]`` (updated in
    place and returned; the final norm is the caller's) with one ``layer_tail`` a layer.

    Args:
        layers: the model's ``Qwen3DecoderLayer`` s; positions: ``[T]``.
        h: ``[T, hidden]``, T = 1 or 2.
    """
    layers = list(layers)
    ln1 = layers[0].input_layernorm
    qkv = skinny_norm_linear(h, ln1.weight, ln1.variance_epsilon,
                             layers[0].self_attn._packed["qkv"][0])     # [T, (H + 2 Hkv) D]
    for i, layer in enumerate(layers):
        attn, mlp, ln2 = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        out = attn.attend(positions, qkv)                                  # [T, H * D]
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        head = (nxt.input_layernorm.weight, nxt.input_layernorm.variance_epsilon,
                nxt.self_attn._packed["qkv"][0]) if nxt is not None else ()
        qkv = layer_tail(out, h, attn.o_proj.weight, ln2.weight, ln2.variance_epsilon,
                         mlp._packed["gate_up"][0], mlp.down_proj.weight, *head)
    return h
