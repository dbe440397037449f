"""Exercise checkers of chapters 11 and 12: the learner's version against the package's.

``check_tp_shard`` compares a learner's tensor-parallel slicing of checkpoint tensors with
``mrv2.distributed.layers`` (``tp_layout``, ``shard_spec``, ``shard_tensor``) and then checks
that the learner's column- and row-parallel MLP shards recombine into the full
``Qwen3MLP``; ``check_serve_stats`` compares TTFT / TPOT / ITL percentiles computed from
per-request timestamps with ``mrv2.bench.serve.summarize``. See the "Build it yourself"
sections of notebooks/11_tensor_parallel.ipynb and 12_serving.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mrv2.exercises.ch08_10 import _close_diff
from mrv2.exercises.checks import ExerciseFailed, _raised, _require_callable

_SMALL = {"vocab_size": 101, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "tie_word_embeddings": True, "max_position_embeddings": 64}


def _shape(name: str, cfg) -> tuple[int, ...]:
    """The full checkpoint shape of ``name`` under a Hugging Face config."""
    h, d, i, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    module, _, param = name.rpartition(".")
    module = module.rpartition(".")[2]
    out_in = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
              "embed_tokens": (v, h), "lm_head": (v, h)}
    if module in out_in:
        return out_in[module] if param == "weight" else out_in[module][:1]
    return (d,) if module in ("q_norm", "k_norm") else (h,)


def _tp_cases() -> list[tuple[str, dict, str, int, int]]:
    """(name, config changes, tensor name, tp_size, tp_rank) of check_tp_shard."""
    layer = "model.layers.0."
    return [
        ("tp_size 1: every tensor whole", {}, layer + "self_attn.q_proj.weight", 1, 0),
        ("q_proj weight: column-parallel (output rows split)", {},
         layer + "self_attn.q_proj.weight", 2, 1),
        ("q_proj bias: split like the output rows", {}, layer + "self_attn.q_proj.bias", 2, 1),
        ("v_proj with 2 KV heads over 2 ranks", {}, layer + "self_attn.v_proj.weight", 2, 1),
        ("k_proj with fewer KV heads than ranks: replicated", {},
         layer + "self_attn.k_proj.weight", 4, 3),
        ("o_proj weight: row-parallel (input columns split)", {},
         layer + "self_attn.o_proj.weight", 4, 2),
        ("o_proj bias: whole (added once, after the all-reduce)", {},
         layer + "self_attn.o_proj.bias", 2, 1),
        ("gate_proj weight: column-parallel", {}, layer + "mlp.gate_proj.weight", 2, 1),
        ("down_proj weight: row-parallel", {}, layer + "mlp.down_proj.weight", 4, 1),
        ("a norm weight is whole on every rank", {}, layer + "input_layernorm.weight", 2, 1),
        ("embed_tokens, vocabulary not divisible: zero padding", {}, "model.embed_tokens.weight",
         2, 1),
        ("lm_head, vocabulary split in 4", {"tie_word_embeddings": False}, "lm_head.weight", 4, 0),
    ]


def _mlp_recombines(fn: Callable, gen: torch.Generator) -> None:
    """The learner's gate/up/down shards, summed over the ranks, give the full MLP."""
    from transformers import Qwen3Config

    from mrv2.kernels.activation import silu_and_mul_ref
    from mrv2.models.qwen3 import Qwen3MLP

    cfg = Qwen3Config(**_SMALL)
    mlp = Qwen3MLP(cfg)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3, cfg.hidden_size, generator=gen)                      # [T, hidden]
    want = mlp(x)                                                           # [T, hidden]
    name, tp = "the shards recombine: sum over 2 ranks of down(silu(gate) * up)", 2
    got = torch.zeros_like(want)
    for rank in range(tp):
        try:
            w = {p: fn(f"model.layers.0.mlp.{p}.weight", getattr(mlp, p).weight.detach().clone(),
                       cfg, tp, rank) for p in ("gate_proj", "up_proj", "down_proj")}
            partial = silu_and_mul_ref(x @ w["gate_proj"].T, x @ w["up_proj"].T)  # [T, I / tp]
            got += partial @ w["down_proj"].T                               # rank's partial sum
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e) from e
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise ExerciseFailed(f"case {name!r}: the all-reduced output differs from Qwen3MLP by "
                             f"{(got - want).abs().max().item():.3g}")


def check_tp_shard(fn: Callable, seed: int = 0) -> None:
    """Check a tensor-parallel slicer against ``shard_tensor(full, shard_spec(name, layout))``.

    Args:
        fn: ``fn(name, full, cfg, tp_size, tp_rank)``: ``name`` a Hugging Face parameter name
            (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ...), ``full`` the
            whole checkpoint tensor, ``cfg`` its ``Qwen3Config``; returns rank ``tp_rank``'s
            piece: column-parallel q/k/v and gate/up split their output features (heads of
            ``head_dim`` rows; KV heads replicated when there are fewer than ranks), row-parallel
            o_proj and down_proj their input features (their bias whole), the embedding and
            lm_head ``ceil(vocab / tp)`` rows each (zero rows past the vocabulary), anything
            else whole.
        seed: the random tensors' seed.

    Prints how many cases passed and returns None.

    Raises:
        TypeError: ``fn`` is not callable.
        ExerciseFailed: on the first case whose piece differs, or when the MLP's shards do not
            recombine (or ``fn`` raises).
    """
    from transformers import Qwen3Config

    from mrv2.distributed.layers import shard_spec, shard_tensor, tp_layout

    _require_callable(fn, "fn")
    gen = torch.Generator().manual_seed(seed)
    cases = _tp_cases()
    for name, changes, tensor, tp, rank in cases:
        cfg = Qwen3Config(**{**_SMALL, **changes})
        full = torch.randn(_shape(tensor, cfg), generator=gen)
        want = shard_tensor(full, shard_spec(tensor, tp_layout(cfg, tp, rank)))
        shown = (f"{tensor} {tuple(full.shape)}, tp_size={tp}, tp_rank={rank}, heads "
                 f"{cfg.num_attention_heads} (KV {cfg.num_key_value_heads}) x {cfg.head_dim}, "
                 f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}")
        try:
            got = fn(tensor, full.clone(), cfg, tp, rank)
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e) from e
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"case {name!r}: return a tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(want.shape):
            raise ExerciseFailed(f"case {name!r}: the piece has shape {tuple(got.shape)}, "
                                 f"expected {tuple(want.shape)}\n  inputs: {shown}")
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            raise ExerciseFailed(f"case {name!r}: the piece differs at index {bad}: the wrong "
                                 f"slice of the full tensor\n  inputs: {shown}")
    _mlp_recombines(fn, gen)
    print(f"check_tp_shard: all {len(cases) + 1} cases pass")


# --- chapter 12: the bench-serve statistics ---------------------------------------------------

def _serve_cases(rng: np.random.Generator) -> list[tuple[str, list[dict]]]:
    """(name, request records) of check_serve_stats; times in seconds."""
    def rec(start, gaps, tokens, error=None):
        chunks = list(start + np.cumsum(gaps)) if gaps else []
        end = (chunks[-1] if chunks else start) + 0.001
        return {"start": start, "chunks": chunks, "tokens": tokens, "error": error, "end": end}

    def load(n):
        recs = []
        for _ in range(n):
            num = int(rng.integers(1, 12))
            gaps = [float(rng.uniform(0.02, 0.2))] + list(rng.uniform(0.001, 0.02, num - 1))
            tokens = num + int(rng.integers(0, 3))     # a chunk may carry several tokens
            recs.append(rec(float(rng.uniform(0, 2)), gaps, tokens))
        return recs

    failed = rec(0.5, [0.01, 0.02], 2, error="HTTP 500: boom")
    return [
        ("one request of 4 tokens", [rec(0.0, [0.1, 0.01, 0.02, 0.015], 4)]),
        ("a one-token request has no TPOT and no ITL", [rec(0.0, [0.2], 1),
                                                        rec(0.1, [0.1, 0.01], 2)]),
        ("only one-token requests: TPOT and ITL are None", [rec(0.0, [0.2], 1)]),
        ("a failed request is left out", [rec(0.0, [0.1, 0.01], 2), failed]),
        ("a request with no chunk is left out", [rec(0.0, [], 0, error=None),
                                                 rec(0.0, [0.05, 0.01, 0.01], 3)]),
        ("no requests at all", []),
        ("fewer chunks than tokens", [rec(0.0, [0.1, 0.02], 5), rec(0.2, [0.05, 0.01], 2)]),
        ("random load of 40 requests", load(40)),
    ]


def check_serve_stats(fn: Callable, seed: int = 0) -> None:
    """Check TTFT / TPOT / ITL statistics against ``mrv2.bench.serve.summarize``.

    Args:
        fn: ``fn(records)``: ``records`` a list of dicts, one per streamed request, with
            ``start`` (send time, s), ``chunks`` (arrival time of each content chunk, s),
            ``end`` (stream closed, s), ``tokens`` (completion tokens from the usage chunk)
            and ``error`` (None, or why it failed). Returns ``{"ttft_ms": ..., "tpot_ms":
            ..., "itl_ms": ...}``, each ``{"mean", "p50", "p90", "p99"}`` in milliseconds
            (``np.percentile``; every value ``None`` when there is nothing to measure), over
            the requests without an error and with at least one chunk: TTFT = first chunk -
            start; TPOT = (end - first chunk) / (tokens - 1) for requests of 2+ tokens; ITL =
            every gap between two chunks of a request.
        seed: the random cases' seed.

    Prints how many cases passed and returns None.

    Raises:
        TypeError: ``fn`` is not callable.
        ExerciseFailed: on the first case where a statistic differs (or ``fn`` raises).
    """
    import copy

    from mrv2.bench.serve import summarize

    _require_callable(fn, "fn")
    cases = _serve_cases(np.random.default_rng(seed))
    for name, recs in cases:
        want = summarize(copy.deepcopy(recs), 1.0, float("inf"), 1, 0)
        shown = (f"{len(recs)} records" if len(recs) > 3 else
                 str([{k: (np.round(v, 4).tolist() if k == "chunks" else v) for k, v in r.items()}
                      for r in recs]))
        try:
            got = fn(copy.deepcopy(recs))
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e) from e
        if not isinstance(got, dict):
            raise ExerciseFailed(f"case {name!r}: return a dict with ttft_ms, tpot_ms, itl_ms, "
                                 f"got {got!r:.200}")
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            stats = got.get(metric)
            if not isinstance(stats, dict):
                raise ExerciseFailed(f"case {name!r}: {metric} must be a dict with mean, p50, "
                                     f"p90, p99, got {stats!r:.200}")
            for key, w in want[metric].items():
                msg = _close_diff(f"{metric}[{key!r}]", stats.get(key), w, name, shown)
                if msg:
                    raise ExerciseFailed(msg)
    print(f"check_serve_stats: all {len(cases)} cases pass")
