"""Run a kernel on ``mrv2.platform.DEVICE`` from a test that builds its inputs on the CPU."""

import functools

import torch

from mrv2.kernels import small_m_resident
from mrv2.kernels.skinny_fused import (
    skinny_linear_add_ref,
    skinny_norm_gate_up_silu_ref,
    skinny_norm_linear_ref,
)
from mrv2.kernels.small_m_fused import (
    small_m_linear_add,
    small_m_norm_gate_up_silu,
    small_m_norm_linear,
)
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
    return (1 + 0.1 * torch.randn(1024, generator=g, **kw),
            torch.randn(4096, 1024, generator=g, **kw) * 0.05,
            torch.randn(1024, 2048, generator=g, **kw) * 0.05,
            torch.randn(6144, 1024, generator=g, **kw) * 0.05,
            torch.randn(1024, 3072, generator=g, **kw) * 0.05)


def qwen3_chain(h, ws, norm_linear, linear_add, norm_gate_up_silu):
    """Layers ``ws`` (``qwen3_layer_weights`` tuples) of the fused decode GEMMs on rows ``h``,
    in place, attention left out (q's first 2,048 columns stand in for its output)."""
    for nw, qkv, o, gate_up, down in ws:
        q = norm_linear(h, nw, 1e-6, qkv)
        linear_add(q[:, :2048].contiguous(), o, h)
        linear_add(norm_gate_up_silu(h, nw, 1e-6, gate_up), down, h)
    return h


def qwen3_chain_ref_fp32(h, ws):
    """``qwen3_chain`` through skinny_fused's torch references in fp32 (a new tensor)."""
    ws32 = [tuple(t.float() for t in w) for w in ws]
    return qwen3_chain(h.float(), ws32, skinny_norm_linear_ref, skinny_linear_add_ref,
                       skinny_norm_gate_up_silu_ref)


def check_ragged_fused_gemms(M, N, K, bias):
    """small_m_fused's three entry points (whichever kernel they route to) at a ragged shape,
    bf16 on the GPU, against skinny_fused's references: N not a multiple of the column block,
    bias or none, the add into a row-strided view of a wider buffer (its neighbours intact).
    Returns ``(x, norm weight, W, bias)`` of the norm + linear call, for more checks."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g, **kw)
    nw = 1 + 0.1 * torch.randn(K, generator=g, **kw)
    w = torch.randn(N, K, generator=g, **kw) / K ** 0.5
    w2 = torch.randn(2 * N, K, generator=g, **kw) / K ** 0.5
    b = torch.randn(N, generator=g, **kw) if bias else None
    b2 = torch.randn(2 * N, generator=g, **kw) if bias else None
    assert small_m_resident.fits(x, w, K)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(small_m_norm_linear(x, nw, 1e-6, w, b),
                               skinny_norm_linear_ref(x, nw, 1e-6, w, b), **tol)
    torch.testing.assert_close(small_m_norm_gate_up_silu(x, nw, 1e-6, w2, b2),
                               skinny_norm_gate_up_silu_ref(x, nw, 1e-6, w2, b2), **tol)
    wide = torch.randn(M, N + 16, generator=g, **kw)
    view = wide[:, 8:8 + N]
    ref = skinny_linear_add_ref(x, w, view.clone(), b)
    left, right = wide[:, :8].clone(), wide[:, 8 + N:].clone()
    assert small_m_linear_add(x, w, view, b) is view
    torch.testing.assert_close(view, ref, **tol)
    assert torch.equal(wide[:, :8], left) and torch.equal(wide[:, 8 + N:], right)
    return x, nw, w, b


def check_qwen3_shape_fused_gemms(M, route, atol_between=2e-2):
    """small_m_fused's entry points at the Qwen3-0.6B shapes, M rows, bf16 on the GPU, run
    twice: ``route(True)`` sends them to the kernel under test, ``route(False)`` to the one it
    is compared with. The first run within bf16 rounding of skinny_fused's torch references,
    and of the second run (``atol_between``: two kernels that sum in another order may move an
    element at a rounding boundary by one bf16 unit)."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 1024, generator=g, **kw)
    nw, qkv, o, gate_up, down = qwen3_layer_weights(g, **kw)
    attn = torch.randn(M, 2048, generator=g, **kw)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    outs = {}
    for on in (False, True):
        route(on)
        act = small_m_norm_gate_up_silu(x, nw, 1e-6, gate_up)
        outs[on] = (small_m_norm_linear(x, nw, 1e-6, qkv), act,
                    small_m_linear_add(attn, o, x.clone()), small_m_linear_add(act, down, x.clone()))
    q, act, r1, r2 = outs[True]
    torch.testing.assert_close(q, skinny_norm_linear_ref(x, nw, 1e-6, qkv), **tol)
    torch.testing.assert_close(act, skinny_norm_gate_up_silu_ref(x, nw, 1e-6, gate_up), **tol)
    torch.testing.assert_close(r1, skinny_linear_add_ref(attn, o, x.clone()), **tol)
    torch.testing.assert_close(r2, skinny_linear_add_ref(act, down, x.clone()), **tol)
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=atol_between)


def check_chain_in_a_cuda_graph(M, route, replays=1):
    """Two layers of ``qwen3_chain`` at the Qwen3-0.6B shapes, M rows, bf16 on the GPU, through
    small_m_fused's entry points: with ``route(True)`` (the kernel under test) the graph's
    replay (``replays`` back to back, the last checked) bitwise the eager chain, and its RMS
    against the fp32 chain at most 1.25x that of the ``route(False)`` chain (+1e-3): the two
    round at the same places and sum in another order, so single elements may move by a few
    bf16 units after two layers of residual adds either way."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    ws = [qwen3_layer_weights(g, **kw) for _ in range(2)]
    h0 = torch.randn(M, 1024, generator=g, **kw)

    def chain(h):
        return qwen3_chain(h, ws, small_m_norm_linear, small_m_linear_add,
                           small_m_norm_gate_up_silu)

    route(False)
    baseline = chain(h0.clone())
    route(True)
    eager = chain(h0.clone())
    h = h0.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(h)
    for _ in range(replays):
        h.copy_(h0)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(h, eager)
    ref = qwen3_chain_ref_fp32(h0, ws)

    def rms(a):
        return (a.float() - ref).pow(2).mean().sqrt().item()
    assert rms(eager) <= 1.25 * rms(baseline) + 1e-3, (rms(eager), rms(baseline))
