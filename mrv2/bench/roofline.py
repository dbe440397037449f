"""The memory roofline of a decode step: how fast could it be at best?

A decode step of ``B`` requests reads every weight once (``W`` bytes) and the whole
cached K and V of every request (``B x context x kv_bytes_per_token``). At small and
medium batches these reads dominate, so the step cannot beat

    roofline step time = (W + KV bytes) / measured copy bandwidth,
    roofline tokens/s  = B / roofline step time,

where the bandwidth is what a plain device-to-device copy reaches (bytes read +
written per second), the most a memory-bound kernel can hope for on this machine.
Compute, the activations and the logits are left out: the bound is optimistic.
"""

from __future__ import annotations

import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None,
                   iters: int = 5, reps: int | None = None) -> dict:
    """Measure a large tensor copy: (bytes read + bytes written) / time.

    Args:
        device: where to copy.
        nbytes: size of the copied tensor (default 1 GiB on a GPU, 64 MiB on the CPU).
        iters: timed measurements (after one warm-up); the best one counts.
        reps: copies per measurement, between two syncs, so the sync and the clock cost
            little next to the copies (default 10 on a GPU, 1 on the CPU).

    Returns:
        ``{"bytes", "iters", "reps", "best_s" (one copy), "bandwidth_gbs"}``
        (GB/s = 1e9 bytes/s, read + write).
    """
    device = torch.device(device)
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    reps = reps or (10 if device.type == "cuda" else 1)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first-touch page faults, allocator
    best = float("inf")
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    del src, dst
    return {"bytes": nbytes, "iters": iters, "reps": reps, "best_s": best,
            "bandwidth_gbs": 2 * nbytes / best / 1e9}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters (a tied embedding / ``lm_head`` counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """K and V bytes one cached token occupies across all layers.

    ``num_layers x 2 (K and V) x num_kv_heads x head_dim x dtype bytes``.
    """
    from mrv2.model_state import ModelState

    d = ModelState.model_dims(hf_config)
    elem = torch.empty((), dtype=dtype).element_size()
    return d.num_layers * 2 * d.num_kv_heads * d.head_dim * elem


def decode_roofline(weight_nbytes: int, kv_nbytes_per_token: int, batch: float, context: float,
                    bandwidth_gbs: float) -> dict:
    """The roofline of one decode step of ``batch`` requests with ``context`` cached tokens each.

    Args:
        weight_nbytes: bytes of the weights (read once per step).
        kv_nbytes_per_token: see :func:`kv_bytes_per_token`.
        batch: requests in the step (one new token each).
        context: mean tokens in each request's KV cache.
        bandwidth_gbs: measured copy bandwidth in GB/s.

    Returns:
        ``{"batch", "context", "weight_bytes", "kv_bytes", "bytes", "step_ms", "tok_s"}``.
    """
    kv = kv_nbytes_per_token * batch * context
    total = weight_nbytes + kv
    step_s = total / (bandwidth_gbs * 1e9)
    return {"batch": batch, "context": context, "weight_bytes": int(weight_nbytes),
            "kv_bytes": int(kv), "bytes": int(total), "step_ms": step_s * 1e3,
            "tok_s": batch / step_s}


def workload_roofline(weight_nbytes: int, kv_nbytes_per_token: int, input_lens: list[int],
                      output_lens: list[int], max_num_seqs: int, bandwidth_gbs: float) -> dict:
    """The memory roofline of a whole workload: every decode step of its schedule.

    The batch of a real run is not constant: requests of different lengths finish one
    by one and the waiting ones take their slots. This walks that schedule (at most
    ``max_num_seqs`` requests decode at once, a freed slot goes to the next request in
    order, every KV block fits) and adds up each decode step's bytes: the weights once,
    plus the cached context of every request in the step. Prefill steps (compute-bound)
    and sampling are left out, so the bound is optimistic.

    Args:
        weight_nbytes, kv_nbytes_per_token: as :func:`decode_roofline`.
        input_lens, output_lens: per request; request ``i`` decodes ``output_lens[i] - 1``
            tokens after its prefill (the first comes from the prefill step).
        max_num_seqs: requests decoding at once at most.
        bandwidth_gbs: measured copy bandwidth in GB/s.

    Returns:
        ``{"decode_steps", "output_tokens", "weight_bytes", "kv_bytes", "bytes",
        "time_s", "tok_s"}``: ``tok_s`` = all output tokens / the decode steps' time.
    """
    waiting = list(zip(input_lens, output_lens))[::-1]
    active: list[list[int]] = []  # [context now, decode tokens left]
    steps = kv_tokens = 0
    while waiting or active:
        while waiting and len(active) < max_num_seqs:
            n_in, n_out = waiting.pop()
            if n_out > 1:
                active.append([n_in + 1, n_out - 1])  # the prefill sampled the first token
        if not active:
            continue
        steps += 1
        kv_tokens += sum(ctx for ctx, _ in active)  # each request reads its whole context
        for r in active:
            r[0] += 1
            r[1] -= 1
        active = [r for r in active if r[1] > 0]
    kv = kv_tokens * kv_nbytes_per_token
    total = steps * weight_nbytes + kv
    time_s = total / (bandwidth_gbs * 1e9)
    tokens = int(sum(output_lens))
    return {"decode_steps": steps, "output_tokens": tokens, "weight_bytes": steps * int(weight_nbytes),
            "kv_bytes": int(kv), "bytes": int(total), "time_s": time_s,
            "tok_s": tokens / time_s if time_s > 0 else None}


def model_info(model: torch.nn.Module, hf_config, dtype: torch.dtype) -> dict:
    """What the roofline needs to know about a model (for the results JSON)."""
    from mrv2.model_state import ModelState

    d = ModelState.model_dims(hf_config)
    return {"num_params": sum(p.numel() for p in model.parameters()),
            "weight_bytes": weight_bytes(model),
            "kv_bytes_per_token": kv_bytes_per_token(hf_config, dtype),
            "dtype": str(dtype).removeprefix("torch."), "num_layers": d.num_layers,
            "num_kv_heads": d.num_kv_heads, "head_dim": d.head_dim,
            "hidden_size": d.hidden_size, "vocab_size": d.vocab_size}


def whole_workload_bound(workload: str, res: dict) -> dict | None:
    """The roofline of a recorded workload's whole schedule, from a results JSON.

    Newer results carry it (``res["roofline"]["workload"]``); for older files the same walk
    is redone over the workload rebuilt from the recorded config.

    Args:
        workload: the workload's name (``"standard"``, ``"host-bound"``, ...).
        res: a throughput results dict (``load_results``).

    Returns:
        ``workload_roofline``'s dict, or ``None`` when the file lacks what it needs (or the
        rebuilt workload does not match the recorded one).
    """
    from mrv2.bench.workloads import make_workload

    roof, info, cfg = res["roofline"], res.get("model_info"), res.get("config", {})
    if roof.get("workload") or not info:
        return roof.get("workload")
    wl = make_workload(workload, info["vocab_size"], seed=cfg.get("seed", 0),
                       num_requests=cfg.get("num_requests"), input_len=cfg.get("input_len"),
                       output_len=cfg.get("output_len"))
    seqs = [r["settings"]["max_num_seqs"] for r in res["runners"].values()
            if "max_num_seqs" in r.get("settings", {})]
    if not seqs or wl.output_tokens != res.get("workload_stats", {}).get("output_tokens"):
        return None
    return workload_roofline(info["weight_bytes"], info["kv_bytes_per_token"], wl.input_lens,
                             wl.output_lens, seqs[0], roof["bandwidth_gbs"])
