"""The Hugging Face ``transformers`` baseline: ``generate`` on the same model and weights.

The weights come from mrv2's own loader (same folder, same dtype, same dummy seed)
and are copied into ``AutoModelForCausalLM`` by name: mrv2 keeps Hugging Face's
module names, so the two state dicts must have exactly the same keys; any
difference fails loudly. Batches are left-padded (pad id 0, with an attention
mask) and sampled like the mrv2 requests (temperature 0.6, no top-k/top-p).

``generate`` cannot stop one row of a batch early, so a batch runs to its longest
requested output (``min_new_tokens = max_new_tokens`` also keeps EOS from ending it)
and only the tokens each request asked for are counted. Requests are sorted by
length before batching to waste as little as possible.
"""

from __future__ import annotations

import time

import torch

from mrv2.bench.llm_runs import ModelSpec
from mrv2.bench.timing import latency_rows, sweep_rows, throughput_figures, timed
from mrv2.bench.workloads import Workload

NOTES = [
    ("hf: transformers generate, batches sorted by (output_len, input_len) and left-padded; "
    "each batch runs to its longest requested output, only requested tokens are counted "
    "(generated_tokens includes the waste)"),
    "hf: steps = forward passes (one per generated position of each batch)",
]


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Load ``src``'s state dict into ``dst`` after checking the key sets are equal.

    Raises:
        ValueError: keys missing on either side (named), or a tied ``lm_head`` that
            does not end up equal to the embedding.
    """
    src_sd, dst_keys = src.state_dict(), set(dst.state_dict())
    only_src, only_dst = sorted(set(src_sd) - dst_keys), sorted(dst_keys - set(src_sd))
    if only_src or only_dst:
        raise ValueError(f"mrv2 and transformers state dicts differ: only in mrv2 {only_src[:8]}, "
                         f"only in transformers {only_dst[:8]}")
    dst.load_state_dict(src_sd, strict=True)
    if getattr(dst.config, "tie_word_embeddings", False):
        emb, head = dst.get_input_embeddings().weight, dst.get_output_embeddings().weight
        if not torch.equal(emb, head):
            raise ValueError("tie_word_embeddings is set but lm_head != embed_tokens after loading")


def build_hf_model(spec: ModelSpec):
    """``AutoModelForCausalLM`` from the model's config, holding mrv2's weights.

    Returns:
        ``(hf_model in eval mode, mrv2 model_info)``.
    """
    from mrv2 import platform
    from mrv2.bench.roofline import model_info
    from mrv2.models.loader import load_model

    net, cfg = load_model(spec.model, spec.dtype, platform.DEVICE, load_format=spec.load_format,
                          seed=spec.seed)
    info = model_info(net, cfg, next(net.parameters()).dtype)
    from transformers import AutoModelForCausalLM

    dtype = next(net.parameters()).dtype
    with torch.device(platform.DEVICE):
        try:
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:  # transformers 4.x names it torch_dtype
            hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    # NOTE: no hf.to(dtype): it would also cast the fp32 RoPE inv_freq buffer to bf16.
    if hf.dtype != dtype:
        raise ValueError(f"transformers built the model in {hf.dtype}, expected {dtype}")
    copy_weights(net, hf)
    del net
    return hf.eval(), info


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of shape ``[B, max_len]``, padded on the left with 0."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def sample_batch(model, ids, mask, max_new: int, temperature: float,
                 cache_implementation: str | None = None) -> torch.Tensor:
    """``generate`` ``max_new`` sampled tokens for every row; returns ``[B, width + max_new]``."""
    # NOTE: with a static cache transformers would torch.compile the forward, once per new
    # shape, inside the timed run; the benchmark measures the cache, not the compiler.
    kw = ({"cache_implementation": cache_implementation, "disable_compile": True}
          if cache_implementation else {})
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                          temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                          min_new_tokens=max_new, pad_token_id=0, **kw)


def generate_timed(model, wl: Workload, batch_size: int, max_tokens: int | None = None,
                   cache_implementation: str | None = None) -> dict:
    """Time ``generate`` over the whole workload in length-sorted batches.

    Args:
        model: the HF model.
        wl: the workload (``max_tokens`` overrides every output length).
        batch_size: requests per ``generate`` call.
        cache_implementation: ``None`` (dynamic cache) or e.g. ``"static"``.

    Returns:
        ``throughput_figures`` (requested tokens only) plus ``generated_tokens``,
        ``num_batches`` and ``short_rows`` (rows that got fewer tokens than asked).
    """
    want = [max_tokens or n for n in wl.output_lens]
    order = sorted(range(wl.num_requests), key=lambda i: (want[i], len(wl.prompts[i])))
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    device = next(model.parameters()).device
    inputs = [left_pad([wl.prompts[i] for i in g], device) for g in groups]  # before the clock

    def run():
        counted = generated = steps = short = 0
        for g, (ids, mask) in zip(groups, inputs):
            m = max(want[i] for i in g)
            got = sample_batch(model, ids, mask, m, wl.temperature,
                               cache_implementation).shape[1] - ids.shape[1]
            counted += sum(min(want[i], got) for i in g)
            short += sum(got < want[i] for i in g)
            generated, steps = generated + got * len(g), steps + got
        return counted, generated, steps, short

    (counted, generated, steps, short), wall = timed(run)
    return {**throughput_figures(wall, counted, steps), "generated_tokens": generated,
            "num_batches": len(groups), "batch_size": batch_size, "short_rows": short}


def _warm_up(model, wl: Workload, cache_implementation: str | None, rows: int = 2) -> float:
    """An untimed ``generate`` of 4 tokens for the first ``rows`` prompts; returns seconds."""
    ids, mask = left_pad(wl.prompts[:rows], next(model.parameters()).device)
    return timed(lambda: sample_batch(model, ids, mask, 4, wl.temperature,
                                      cache_implementation))[1]


def run_throughput(spec: ModelSpec, wl: Workload, *, batch_size: int,
                   cache_implementation: str | None = None, sweep: list[Workload] | None = None,
                   log=print) -> tuple[dict, dict]:
    """Build the HF baseline and time ``generate`` on the workload.

    Returns:
        ``(figures, model_info)``.
    """
    t0 = time.perf_counter()
    model, info = build_hf_model(spec)
    res = {"build_s": time.perf_counter() - t0,
           "settings": {"cache_implementation": cache_implementation or "dynamic",
                        "batch_size": batch_size, "dtype": info["dtype"],
                        "attn_implementation": getattr(model.config, "_attn_implementation", None)}}
    log(f"[bench] hf: built in {res['build_s']:.1f} s; warm-up")
    res["warmup_s"] = _warm_up(model, wl, cache_implementation)
    torch.manual_seed(spec.seed)
    log(f"[bench] hf: timed run of {wl.num_requests} requests in batches of {batch_size}")
    res.update(generate_timed(model, wl, batch_size, None, cache_implementation))
    res["num_requests"] = wl.num_requests
    log(f"[bench] hf: {res['output_tok_s']:,.1f} output tok/s ({res['wall_s']:.2f} s)")
    if sweep:
        log(f"[bench] hf: batch sweep {[w.num_requests for w in sweep]}")
        res["sweep"] = sweep_rows(
            lambda w, m: generate_timed(model, w, w.num_requests, m, cache_implementation),
            sweep, lambda w: _warm_up(model, w, cache_implementation, w.num_requests))
    return res, info


def run_latency(spec: ModelSpec, batches: list[Workload], *, iters: int,
                cache_implementation: str | None = None, log=print) -> tuple[dict, dict]:
    """Build the HF baseline and measure TTFT/TPOT at each batch size (one batch each)."""
    t0 = time.perf_counter()
    model, info = build_hf_model(spec)
    res = {"build_s": time.perf_counter() - t0,
           "settings": {"cache_implementation": cache_implementation or "dynamic",
                        "dtype": info["dtype"]}}
    res["warmup_s"] = sum(_warm_up(model, w, cache_implementation, w.num_requests)
                          for w in batches)
    log(f"[bench] hf: latency at batch sizes {[w.num_requests for w in batches]}")
    res["batches"] = latency_rows(lambda w, m: generate_timed(
        model, w, w.num_requests, m, cache_implementation), batches, iters)
    return res, info
