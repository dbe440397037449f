"""Qwen3 (and, with q/k-norm off, Llama / Qwen2) over a flat token layout and a paged KV cache.

The model sees one flat batch of tokens, ``input_ids [num_tokens]`` with their absolute
``positions [num_tokens]``: prefill chunks and decode tokens of many requests side by
side, no padding and no ``[batch, seq]`` shape. Where each request's keys and values
live comes from the ``AttentionMetadata`` of the forward context, so attention writes the
new keys/values into the paged cache and then attends over it. Module names are Hugging
Face's, so loading a checkpoint is a name map (see loader.py).
See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from mrv2.forward_context import get_attn_metadata
from mrv2.kernels.activation import silu_and_mul, silu_and_mul_ref
from mrv2.kernels.attention import paged_attention
from mrv2.kernels.decode_attention import decode_rope_attention, use_fused_rope_attention
from mrv2.kernels.kv_cache import write_kv_cache
from mrv2.kernels.layernorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from mrv2.kernels.rotary import build_cos_sin_cache, qk_norm_rope, qk_norm_rope_ref
from mrv2.kernels.skinny_gemm import Linear, linear
from mrv2.kernels.small_m_fused import SKINNY_OPS, fused_decode_ops
from mrv2.models.qwen3_persistent import forward_decode_persistent, use_persistent_decode
from mrv2.platform import TRITON_INTERPRET

#: Fused Triton kernels for the norms (+ residual add), q/k-norm + RoPE and SiLU * up.
#: ``MRV2_FUSED_KERNELS=0`` turns them off (the torch references run instead).
#: NOTE: off under Triton's interpreter, where a fused launch costs 3-10 ms against ~0.1 ms
#: for the torch ops it replaces: tests/test_llm_e2e.py took 257 s with them, 179 s without.
#: There their torch references (same numerics) stand in; tests/test_kernels_fused.py
#: checks every kernel against its reference and runs this model through the kernels.
FUSED_KERNELS: bool = not TRITON_INTERPRET and os.environ.get("MRV2_FUSED_KERNELS", "1") != "0"


@dataclass(frozen=True)
class ModelDims:
    """The sizes the runner needs to allocate and bind the KV cache."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


def model_dims(config) -> ModelDims:
    """Read layer/head sizes from a Hugging Face config (``head_dim`` defaults to hidden/heads)."""
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return ModelDims(config.num_hidden_layers, num_heads, num_kv_heads, head_dim,
                     config.hidden_size, config.vocab_size)


def kv_cache_shape(config, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of ONE layer's KV cache: ``(2, num_blocks, block_size, num_kv_heads, head_dim)``."""
    d = model_dims(config)
    return (2, num_blocks, block_size, d.num_kv_heads, d.head_dim)


def rope_theta(config) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5.x) or ``rope_theta`` (4.x).

    Raises:
        ValueError: for a RoPE scaling type other than none/default (YaRN, linear, ...).
    """
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported by mrv2 "
                         "(only plain RoPE: rope_type 'default' or none)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def pack_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack linears that read the same input into one matrix (one GEMM for all of them).

    The returned weight's row blocks *are* the linears' parameters afterwards (each
    ``weight`` becomes a view of it), so the modules keep Hugging Face's names and
    shapes (loading stays a name map, ``q_proj.weight`` is still ``[H * D, hidden]``)
    while ``F.linear(x, weight, bias)`` computes ``[q | k | v]`` in a single launch.

    Args:
        linears: ``nn.Linear`` modules with the same ``in_features``, all with or all
            without a bias.

    Returns:
        ``(weight [sum of out_features, in_features], bias [sum] or None)``.
    """
    weight = torch.cat([m.weight.detach() for m in linears])              # [sum out, in]
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None  # [sum out]
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=m.weight.requires_grad)
        if has_bias:
            m.bias = nn.Parameter(bias[start:end], requires_grad=m.bias.requires_grad)
        start = end
    return weight, bias


class _PackedLinears(nn.Module):
    """Base of the modules whose projections run as one packed GEMM (see ``pack_linears``).

    NOTE: ``Module.to()`` / ``to_empty()`` give every parameter new storage, which would
    silently unpack the views: ``_apply`` re-packs after each such conversion.
    """

    def _packed_groups(self) -> dict[str, tuple[nn.Linear, ...]]:
        raise NotImplementedError

    def _pack(self) -> None:
        self._packed = {name: pack_linears(*group)
                        for name, group in self._packed_groups().items()}

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._pack()
        return self


class Qwen3RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in fp32 (one fused kernel).

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square before the reciprocal square root.

    Forward: ``norm(x)``, or with a ``residual`` the residual-stream form
    ``(norm(x + residual), x + residual)`` (see mrv2/kernels/layernorm.py).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # NOTE: HF rounds to the input dtype BEFORE the weight product; we multiply in fp32
        # and round once (as vLLM does). Identical in fp32, slightly more accurate in bf16.
        if residual is None:
            norm = rms_norm if FUSED_KERNELS else rms_norm_ref
            return norm(x, self.weight, self.variance_epsilon)               # [T, hidden]
        add_norm = fused_add_rms_norm if FUSED_KERNELS else fused_add_rms_norm_ref
        return add_norm(x, residual, self.weight, self.variance_epsilon)


class Qwen3RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX style) RoPE with a cos/sin cache indexed by absolute position.

    Args:
        head_dim: rotated size (the whole head).
        max_position: positions ``0 .. max_position - 1`` are cached.
        theta: the RoPE base.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        self.head_dim, self.max_position, self.theta = head_dim, max_position, theta
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(head_dim, max_position, theta),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        # NOTE: Module.to(bf16) would round the cache and to_empty() would wipe it;
        # rebuild it in fp32 on whatever device the module moved to.
        super()._apply(fn, recurse)
        device = self.cos_sin_cache.device
        if device.type != "meta":
            self.cos_sin_cache = build_cos_sin_cache(self.head_dim, self.max_position,
                                                     self.theta, device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: Qwen3RMSNorm | None = None, k_norm: Qwen3RMSNorm | None = None,
                v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
                slot_mapping: torch.Tensor | None = None):
        """Per-head q/k-norm (when given), then RoPE of ``q [T, H, D]`` and ``k [T, H_kv, D]``:
        one launch for both (mrv2/kernels/rotary.py), fp32 math, input dtypes out.

        With ``kv_cache`` (and ``v``, ``slot_mapping``) the keys and values also go into
        the paged cache, in the same launch when the fused kernels are on; then the
        result is ``(q, None)``."""
        norm = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.variance_epsilon)
        if FUSED_KERNELS:
            return qk_norm_rope(q, k, positions, self.cos_sin_cache, *norm, v=v,
                                kv_cache=kv_cache, slot_mapping=slot_mapping)
        q, k = qk_norm_rope_ref(q, k, positions, self.cos_sin_cache, *norm)
        if kv_cache is None:
            return q, k
        write_kv_cache(k, v, kv_cache, slot_mapping)
        return q, None


class Qwen3Attention(_PackedLinears):
    """GQA self-attention over the paged KV cache of this layer.

    ``q_proj``, ``k_proj`` and ``v_proj`` are views of one packed matrix: one GEMM
    computes all three (``pack_linears``).

    Args:
        config: a Hugging Face Qwen3/Llama/Qwen2 config.
        rotary_emb: the RoPE module shared by all layers.
        use_qk_norm: per-head RMSNorm on q and k (Qwen3); off = Llama/Qwen2.
        qkv_bias: biases on q/k/v_proj (Qwen2, or Llama/Qwen3 ``attention_bias``).
        o_bias: bias on o_proj (Llama/Qwen3 ``attention_bias``).
    """

    def __init__(self, config, rotary_emb: Qwen3RotaryEmbedding, use_qk_norm: bool,
                 qkv_bias: bool, o_bias: bool):
        super().__init__()
        d = model_dims(config)
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim = \
            d.num_heads, d.num_kv_heads, d.head_dim
        if H % Hkv:
            raise ValueError(f"num_attention_heads ({H}) must be a multiple of "
                             f"num_key_value_heads ({Hkv})")
        self.scale = D ** -0.5
        self.q_proj = nn.Linear(d.hidden_size, H * D, bias=qkv_bias)
        self.k_proj = nn.Linear(d.hidden_size, Hkv * D, bias=qkv_bias)
        self.v_proj = nn.Linear(d.hidden_size, Hkv * D, bias=qkv_bias)
        self.o_proj = Linear(H * D, d.hidden_size, bias=o_bias)
        self.use_qk_norm = use_qk_norm
        if use_qk_norm:
            self.q_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
            self.k_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        # NOTE: a plain list keeps the shared RoPE module out of this layer's state_dict.
        self._rotary = [rotary_emb]
        # [2, num_blocks, block_size, H_kv, D], bound by bind_kv_cache(); not a buffer.
        self.kv_cache: torch.Tensor | None = None
        self._pack()

    def _packed_groups(self):
        return {"qkv": (self.q_proj, self.k_proj, self.v_proj)}

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = linear(hidden_states, *self._packed["qkv"])             # [T, (H + 2 H_kv) D]
        return self.o_proj(self.attend(positions, qkv))                # [T, hidden]

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Everything between the two projections: q/k-norm + RoPE + KV write, attention.
        ``qkv [T, (H + 2 H_kv) D]`` -> ``[T, H * D]`` (o_proj's input)."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: call bind_kv_cache(model, kv_caches) first")
        md = get_attn_metadata()
        T = qkv.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if use_fused_rope_attention(qkv, md):  # decode: one kernel (MRV2_FUSED_ROPE_ATTENTION=0: two)
            w = (self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon) \
                if self.use_qk_norm else (None, None, 0.0)
            return decode_rope_attention(qkv, positions, self._rotary[0].cos_sin_cache, *w,
                                         self.kv_cache, md, self.scale, H, Hkv).view(T, H * D)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)       # views, token stride
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        # q/k-norm (Qwen3) and RoPE of q and k: one fused kernel.
        norms = (self.q_norm, self.k_norm) if self.use_qk_norm else (None, None)
        # The new keys/values go into the cache first: attention reads prefix AND new tokens.
        # NOTE: one launch with the RoPE above when the fused kernels are on (no k_out).
        q, _ = self._rotary[0](positions, q, k, *norms, v=v, kv_cache=self.kv_cache,
                               slot_mapping=md.slot_mapping)                    # [T, H, D]
        # NOTE: no zero fill (a memset per layer): every token of a request gets its row;
        # the rows of graph padding tokens stay garbage, and nothing reads them (their KV
        # slot is -1, their logits are never taken, each row of a GEMM is its own).
        out = paged_attention(q, self.kv_cache, md, self.scale,
                              out=torch.empty_like(q))                          # [T, H, D]
        return out.reshape(T, H * D)                                            # [T, H * D]


class Qwen3MLP(_PackedLinears):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    ``gate_proj`` and ``up_proj`` are views of one packed matrix (one GEMM).

    Args:
        config: a Hugging Face config (``hidden_size``, ``intermediate_size``, ``mlp_bias``).
    """

    def __init__(self, config):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)
        self._pack()

    def _packed_groups(self):
        return {"gate_up": (self.gate_proj, self.up_proj)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = silu_and_mul if FUSED_KERNELS else silu_and_mul_ref
        gate_up = linear(x, *self._packed["gate_up"])                       # [T, 2 * inter]
        gate, up = gate_up.chunk(2, dim=-1)                                  # [T, inter] views
        return self.down_proj(act(gate, up))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    The residual stream ``x`` travels beside the hidden states and each add is fused into
    the norm after it (vLLM's pattern): the input norm adds the previous layer's MLP
    output, the post-attention norm the attention output, the model's final norm the last
    MLP output.

    Args: as :class:`Qwen3Attention`.
    """

    def __init__(self, config, rotary_emb: Qwen3RotaryEmbedding, use_qk_norm: bool,
                 qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, use_qk_norm, qkv_bias, o_bias)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``; the first layer gets the embeddings and ``residual=None``."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def can_fuse_decode(self) -> bool:
        """Whether :meth:`forward_decode` may run: the plain modules only (tensor parallelism
        swaps o_proj/down_proj for all-reducing ones; an EAGLE head drops a norm)."""
        return (isinstance(self.self_attn.o_proj, Linear)
                and isinstance(self.mlp.down_proj, Linear)
                and isinstance(self.input_layernorm, Qwen3RMSNorm)
                and isinstance(self.post_attention_layernorm, Qwen3RMSNorm))

    def forward_decode(self, positions: torch.Tensor, h: torch.Tensor,
                       ops: tuple | None = None) -> torch.Tensor:
        """The same block for a decode-sized batch (mrv2/kernels/skinny_fused.py): 4 GEMM
        kernels with the norms, residual adds and SiLU * up fused in.

        Args:
            positions: ``[T]``; h: ``[T, hidden]`` the residual stream, UPDATED IN PLACE.
            ops: the fused ``(norm_linear, linear_add, norm_gate_up_silu)`` to use
                (``fused_decode_ops``; default skinny_fused's, for 1-2 rows).

        Returns:
            ``h`` (now ``x + attn(norm(x)) + mlp(norm(...))``).
        """
        norm_linear, linear_add, norm_gate_up_silu = ops or SKINNY_OPS
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv = norm_linear(h, ln1.weight, ln1.variance_epsilon,
                          *attn._packed["qkv"])                        # [T, (H + 2 H_kv) D]
        out = attn.attend(positions, qkv)                                  # [T, H * D]
        h = linear_add(out, attn.o_proj.weight, h, attn.o_proj.bias)       # h += o_proj
        act = norm_gate_up_silu(h, ln2.weight, ln2.variance_epsilon,
                                *mlp._packed["gate_up"])                   # [T, inter]
        return linear_add(act, mlp.down_proj.weight, h, mlp.down_proj.bias)


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and the final norm (HF's ``model.*`` submodule).

    A decode-sized forward (at most ``MODEL_MAX_M`` tokens on the GPU, where the linears
    take the skinny GEMM; ``MRV2_FUSED_DECODE=0`` turns it off) runs every layer's
    ``forward_decode``: 6 kernels a layer instead of ~10.5 (mrv2/kernels/skinny_fused.py);
    and 3-16 tokens take the tensor-core version of the same kernels
    (mrv2/kernels/small_m_fused.py; ``MRV2_SMALL_M_FUSED=0`` turns it off), 3-32 in bf16 /
    fp16 on the GPU, where they hand the products to mrv2/kernels/small_m_resident.py.

    Args: as :class:`Qwen3ForCausalLM`.
    """

    def __init__(self, config, use_qk_norm: bool, qkv_bias: bool, o_bias: bool):
        super().__init__()
        d = model_dims(config)
        self.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size)
        self.rotary_emb = Qwen3RotaryEmbedding(d.head_dim, config.max_position_embeddings,
                                               rope_theta(config))
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, self.rotary_emb, use_qk_norm, qkv_bias, o_bias)
            for _ in range(d.num_layers))
        self.norm = Qwen3RMSNorm(d.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # A ModelState hook may pass precomputed (e.g. multimodal) embeddings instead of ids.
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        ops = fused_decode_ops(h)
        if ops is not None and all(la.can_fuse_decode() for la in self.layers):
            # Decode-sized: ONE residual stream h, added into in place by every layer.
            # NOTE: never into a caller's inputs_embeds (embed_tokens' output is fresh).
            if inputs_embeds is not None:
                h = h.clone(memory_format=torch.contiguous_format)
            if ops is SKINNY_OPS and use_persistent_decode(self.layers, h):
                # 1-2 rows: 2 launches a layer (mrv2/models/qwen3_persistent.py)
                return self.norm(forward_decode_persistent(self.layers, positions, h))
            for layer in self.layers:
                h = layer.forward_decode(positions, h, ops)
            return self.norm(h)                                                 # [T, hidden]
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]  # [T, hidden]


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 causal LM over a flat token layout; Llama/Qwen2 when q/k-norm is off.

    Args:
        config: a Hugging Face ``Qwen3Config``, ``LlamaConfig`` or ``Qwen2Config``.
        use_qk_norm: per-head q/k RMSNorm; ``None`` = on for ``model_type`` qwen3 only.

    Forward: ``input_ids [T]`` (or ``inputs_embeds [T, hidden]``), ``positions [T]`` ->
    ``hidden_states [T, hidden]``; ``compute_logits`` maps them to ``[n, vocab]`` (model dtype).
    Attention metadata comes from ``mrv2.forward_context.set_forward_context``.
    """

    def __init__(self, config, use_qk_norm: bool | None = None):
        super().__init__()
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []) \
                or getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention layers are not supported by mrv2")
        model_type = getattr(config, "model_type", "qwen3")
        if use_qk_norm is None:
            use_qk_norm = model_type == "qwen3"
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or model_type == "qwen2"   # Qwen2: q/k/v biases, none on o_proj
        self.config = config
        self.use_qk_norm = use_qk_norm
        self.model = Qwen3Model(config, use_qk_norm, qkv_bias, o_bias=attention_bias)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with the embedding when the config ties them."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` of ``input_ids [T]``."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` of ``hidden_states [n, hidden]`` (e.g. the sampled rows only)."""
        return self.lm_head(hidden_states)

    @property
    def dims(self) -> ModelDims:
        """num_layers, num_kv_heads, head_dim ... (what the KV cache allocator needs)."""
        return model_dims(self.config)


def rope_inputs(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(cos_sin_cache, q_norm weight or None)`` of the model's first attention layer: what
    the fused decode RoPE + attention kernel specialises on (its serve precompile)."""
    attn = next(m for m in model.modules() if isinstance(m, Qwen3Attention))
    return attn._rotary[0].cos_sin_cache, attn.q_norm.weight if attn.use_qk_norm else None


def bind_kv_cache(model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
    """Give layer ``i``'s attention the cache ``kv_caches[i]`` (shape :func:`kv_cache_shape`)."""
    attns = [m for m in model.modules() if isinstance(m, Qwen3Attention)]
    if len(kv_caches) != len(attns):
        raise ValueError(f"got {len(kv_caches)} KV caches for {len(attns)} attention layers")
    for i, (attn, cache) in enumerate(zip(attns, kv_caches)):
        if cache.dim() != 5 or cache.shape[0] != 2 or \
                tuple(cache.shape[3:]) != (attn.num_kv_heads, attn.head_dim):
            raise ValueError(f"kv_caches[{i}] has shape {tuple(cache.shape)}, expected "
                             f"(2, num_blocks, block_size, {attn.num_kv_heads}, {attn.head_dim})")
        attn.kv_cache = cache
