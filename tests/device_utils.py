"""Run a kernel on ``mrv2.platform.DEVICE`` from a test that builds its inputs on the CPU."""

import functools

import torch

from mrv2.platform import DEVICE


def on_device(fn):
    """``fn`` run on ``DEVICE``: tensor arguments move there (a no-op on the CPU), tensors
    it changed in place are copied back, results come back to the CPU, so the CPU
    references stay on the CPU and compare with the device kernels' outputs."""
    def move(a):
        return a.to(DEVICE) if isinstance(a, torch.Tensor) else a

    def back(r, pairs):
        if isinstance(r, torch.Tensor):
            for orig, dev in pairs:
                if r is dev:
                    return orig
            return r.cpu()
        if isinstance(r, tuple):
            return tuple(back(x, pairs) for x in r)
        if isinstance(r, list):
            return [back(x, pairs) for x in r]
        return r

    @functools.wraps(fn)
    def wrapped(*args, **kw):
        dargs = [move(a) for a in args]
        dkw = {k: move(v) for k, v in kw.items()}
        res = fn(*dargs, **dkw)
        pairs = [(a, d) for a, d in zip(list(args) + list(kw.values()), dargs + list(dkw.values()))
                 if isinstance(a, torch.Tensor)]
        for orig, dev in pairs:
            if dev is not orig:
                orig.copy_(dev)  # in-place outputs (logits, out=) back to the CPU tensor
        return back(res, pairs)

    return wrapped


def assert_finished_cleanly(outputs) -> None:
    """Every completion ended by a stop condition, none by ``finish_reason="error"``.

    NOTE: the engine contains faults (``mrv2/fault.py``): an error inside a step, e.g. the
    RuntimeError of ``torch.cuda.set_sync_debug_mode("error")``, finishes the requests with
    ``"error"`` instead of raising. A sync-debug proof must look at the finish reasons.
    """
    bad = [(o.request_id, c.finish_reason, c.stop_reason) for o in outputs for c in o.outputs
           if c.finish_reason not in ("stop", "length")]
    assert not bad, f"requests did not finish cleanly: {bad[:3]}"


def generate_without_sync(llm, prompts, params):
    """``llm.generate`` under ``torch.cuda.set_sync_debug_mode("error")``, checked clean.

    The one shape of every no-sync proof of the step loop: kernels already compiled by
    the caller's warm-up, then a run in which any CPU-GPU sync is an error; since the
    engine contains errors, the proof is that every request finished cleanly.

    Returns:
        The ``RequestOutput`` list.
    """
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_finished_cleanly(outs)
    return outs


def qwen3_layer_weights(g, **kw):
    """One Qwen3-0.6B decoder layer's fused-GEMM weights, drawn from generator ``g`` (``kw``:
    device and dtype): ``(norm weight [1024], qkv [4096, 1024], o_proj [1024, 2048],
    gate_up [6144, 1024], down [1024, 3072])``, scaled like a trained layer's."""
    import torch

    return (1 + 0.1 * torch.randn(1024, generator=g, **kw),
            torch.randn(4096, 1024, generator=g, **kw) * 0.05,
            torch.randn(1024, 2048, generator=g, **kw) * 0.05,
            torch.randn(6144, 1024, generator=g, **kw) * 0.05,
            torch.randn(1024, 3072, generator=g, **kw) * 0.05)
