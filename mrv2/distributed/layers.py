"""Megatron-style sharding of a Qwen3 / Llama model over the ranks of a TP group.

The idea (Shoeybi et al., 2019): a rank runs a *narrower* copy of the model. Its q/k/v
and gate/up projections are column-parallel (each rank holds a slice of the output
features: its heads, its part of the intermediate size), so attention and the SwiGLU run
on local data with no communication. The o_proj and down_proj that follow are
row-parallel (each rank holds the matching slice of the input features), so each rank
produces a *partial sum* of the full output: one all-reduce per layer and sub-block makes
it whole. The embedding and lm_head are split over the vocabulary.

So a rank's model is ``Qwen3ForCausalLM(local_config(...))`` (``num_attention_heads``,
``num_key_value_heads`` and ``intermediate_size`` divided by the TP size, ``head_dim`` and
``vocab_size`` kept) with four kinds of module swapped in by :func:`shard_model`;
``mrv2/models/qwen3.py`` is unchanged and keeps Hugging Face's names, and
:func:`shard_spec` says which slice of each checkpoint tensor a rank reads.

KV heads: with at least as many KV heads as ranks each rank holds ``H_kv / tp`` of them;
with fewer (e.g. 1 KV head, tp 2), each is replicated on ``tp / H_kv`` ranks, so every
rank's query heads find their KV head locally (``tp % H_kv == 0``).

Logits: the lm_head's vocabulary shards are **all-gathered**, so every rank holds the full
``[N, vocab]`` logits and runs the unchanged sampler (penalties, top-k/top-p, logprobs all
need whole rows), and every rank samples the same tokens (same logits, same stateless
(seed, position) noise), which its own state table appends on its device: no token is
sent between ranks. The alternative, reducing each rank's (max, argmax) of the Gumbel-
perturbed logits, sends 2 numbers per row instead of ``vocab / tp``, but serves only plain
sampling; it is the optimisation to make when the gather shows in a profile (chapter 11).
See notebooks/11_tensor_parallel.ipynb.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.distributed.parallel_state import tp_all_gather, tp_all_reduce
from mrv2.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3MLP, model_dims


@dataclass(frozen=True)
class TPLayout:
    """What one rank holds of the model.

    Attributes:
        tp_size, tp_rank: the group size and this rank.
        num_heads, num_kv_heads: this rank's query and KV heads.
        total_kv_heads: the model's KV heads.
        head_dim: unchanged by sharding.
        intermediate_size: this rank's slice of the MLP.
        vocab_size: the full vocabulary.
        vocab_per_rank: rows of each rank's embedding / lm_head shard, ``ceil(V / tp)``
            (the last shard's rows past ``V`` are zero padding).
    """

    tp_size: int
    tp_rank: int
    num_heads: int
    num_kv_heads: int
    total_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    vocab_per_rank: int

    @property
    def q_head_start(self) -> int:
        return self.tp_rank * self.num_heads

    @property
    def kv_head_start(self) -> int:
        """This rank's first KV head (ranks that share a replicated head get the same one)."""
        if self.total_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads
        return self.tp_rank // (self.tp_size // self.total_kv_heads)

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.vocab_per_rank


def check_tp_size(hf_config, tp_size) -> None:
    """Raise ``ValueError`` naming the field when ``tp_size`` cannot shard this model.

    Args:
        hf_config: the model's Hugging Face config.
        tp_size: the requested ``tensor_parallel_size``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    d = model_dims(hf_config)
    if d.num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide num_attention_heads="
                         f"{d.num_heads}")
    if d.num_kv_heads % tp_size and tp_size % d.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} and num_key_value_heads="
                         f"{d.num_kv_heads}: one must divide the other (KV heads are split "
                         "over the ranks, or replicated when there are fewer than ranks)")
    if hf_config.intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide intermediate_size="
                         f"{hf_config.intermediate_size}")


def tp_layout(hf_config, tp_size: int, tp_rank: int) -> TPLayout:
    """Rank ``tp_rank``'s :class:`TPLayout` (checks ``tp_size`` first).

    Args:
        hf_config: the model's Hugging Face config.
        tp_size: ranks in the group.
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
    """
    check_tp_size(hf_config, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    d = model_dims(hf_config)
    return TPLayout(tp_size, tp_rank, d.num_heads // tp_size,
                    max(1, d.num_kv_heads // tp_size), d.num_kv_heads, d.head_dim,
                    hf_config.intermediate_size // tp_size, d.vocab_size,
                    -(-d.vocab_size // tp_size))


def local_config(hf_config, layout: TPLayout):
    """The config of one rank's narrower model (heads and intermediate size divided).

    ``head_dim`` is written explicitly (``hidden / heads`` would change); ``vocab_size``
    stays whole: the sampler sees full logits rows.
    """
    cfg = copy.deepcopy(hf_config)
    cfg.num_attention_heads = layout.num_heads
    cfg.num_key_value_heads = layout.num_kv_heads
    cfg.head_dim = layout.head_dim
    cfg.intermediate_size = layout.intermediate_size
    return cfg


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of dim ``dim`` of a checkpoint tensor whose dim has ``full``
    entries (``stop > full``: the rows past ``full`` are zero padding)."""

    dim: int
    start: int
    stop: int
    full: int


#: Column-parallel modules (output features split), with the range they split by.
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
#: Row-parallel modules (input features split); their bias is whole, added once.
_ROW = {"o_proj": "q", "down_proj": "mlp"}


def _feature_range(layout: TPLayout, kind: str) -> tuple[int, int, int]:
    D = layout.head_dim
    if kind == "q":
        return (layout.q_head_start * D, (layout.q_head_start + layout.num_heads) * D,
                layout.num_heads * layout.tp_size * D)
    if kind == "kv":
        return (layout.kv_head_start * D, (layout.kv_head_start + layout.num_kv_heads) * D,
                layout.total_kv_heads * D)
    n = layout.intermediate_size
    return layout.tp_rank * n, (layout.tp_rank + 1) * n, n * layout.tp_size


def shard_spec(name: str, layout: TPLayout) -> Shard | None:
    """Which slice of checkpoint tensor ``name`` this rank holds (``None``: all of it).

    Args:
        name: a Hugging Face parameter name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        layout: this rank's layout.
    """
    module, _, param = name.rpartition(".")
    module = module.rpartition(".")[2]
    if module in ("embed_tokens", "lm_head"):
        start = layout.vocab_start
        return Shard(0, start, start + layout.vocab_per_rank, layout.vocab_size)
    if module in _COLUMN:  # weight [out, in] and bias [out]: split the outputs
        return Shard(0, *_feature_range(layout, _COLUMN[module]))
    if module in _ROW and param == "weight":  # weight [out, in]: split the inputs
        return Shard(1, *_feature_range(layout, _ROW[module]))
    return None


def shard_tensor(full: torch.Tensor, spec: Shard | None) -> torch.Tensor:
    """This rank's piece of an in-memory full tensor (zero-padded past ``spec.full``)."""
    if spec is None:
        return full.clone()
    if full.shape[spec.dim] != spec.full:
        raise ValueError(f"expected {spec.full} entries on dim {spec.dim}, got "
                         f"{tuple(full.shape)}")
    piece = full.narrow(spec.dim, spec.start, min(spec.stop, spec.full) - spec.start)
    pad = spec.stop - spec.start - piece.shape[spec.dim]
    if pad:
        shape = list(piece.shape)
        shape[spec.dim] = pad
        piece = torch.cat([piece, piece.new_zeros(shape)], dim=spec.dim)
    return piece.clone()


class RowParallelLinear(nn.Linear):
    """A linear layer holding a slice of the *input* features: its outputs are partial
    sums, all-reduced over the ranks; the (whole) bias is added once, after the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tp_all_reduce(F.linear(x, self.weight))                  # [T, out], summed
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[vocab_start, vocab_start + num_embeddings)`` of the embedding table.

    An id outside this rank's rows looks up row 0 and is zeroed; the all-reduce then
    brings each token the one rank's row that holds it (a masked lookup, no sync).
    """

    def __init__(self, layout: TPLayout, hidden_size: int):
        super().__init__(layout.vocab_per_rank, hidden_size)
        self.vocab_start = layout.vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start                                  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)                # [T] bool
        out = F.embedding(local.masked_fill(outside, 0), self.weight)         # [T, hidden]
        return tp_all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary rows of the lm_head; the logits shards are all-gathered
    (see the module docstring for why gather rather than a reduced argmax)."""

    def __init__(self, layout: TPLayout, hidden_size: int):
        super().__init__(hidden_size, layout.vocab_per_rank, bias=False)
        self.vocab_size = layout.vocab_size
        self.padded = layout.vocab_per_rank * layout.tp_size != layout.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = tp_all_gather(F.linear(hidden, self.weight))             # [N, tp * V_rank]
        # NOTE: the padded tail of the last shard must not reach the sampler.
        return logits[:, :self.vocab_size].contiguous() if self.padded else logits


def _row_parallel(linear: nn.Linear) -> RowParallelLinear:
    with torch.device(linear.weight.device):
        return RowParallelLinear(linear.in_features, linear.out_features,
                                 bias=linear.bias is not None, dtype=linear.weight.dtype)


def shard_model(model: Qwen3ForCausalLM, layout: TPLayout) -> Qwen3ForCausalLM:
    """Swap in the parallel modules of one rank, in place (before the weights exist).

    Args:
        model: built from ``local_config(hf_config, layout)`` (its q/k/v, gate/up, o_proj
            and down_proj already have this rank's shapes), typically on the meta device.
        layout: this rank's layout.

    Returns:
        ``model``: o_proj and down_proj row-parallel, the embedding and lm_head
        vocabulary-parallel (tied again when the config ties them).
    """
    for module in model.modules():
        if isinstance(module, Qwen3Attention):
            module.o_proj = _row_parallel(module.o_proj)
        elif isinstance(module, Qwen3MLP):
            module.down_proj = _row_parallel(module.down_proj)
    hidden = model.config.hidden_size
    with torch.device(model.lm_head.weight.device):
        model.model.embed_tokens = VocabParallelEmbedding(layout, hidden)
        model.lm_head = ParallelLMHead(layout, hidden)
    model.tie_weights()
    return model
