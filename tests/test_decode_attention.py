"""decode_rope_attention (q/k-norm + RoPE + KV write + attention in one kernel) against the
two kernels it replaces, in torch (qk_norm_rope_ref, write_kv_cache, paged_attention_ref).

Under the interpreter in fp32: a decode batch with a first token (no cached keys), contexts
below, at and across page and key-tile boundaries, a graph padding request, GQA groups of 2
and 4, q/k-norm on and off, 1 to 8 splits (the owner of the new token in any split); the
cache after the call (the new slots written, nothing else touched); bad input; then the
embedded Qwen3 with the path forced on vs off (greedy tokens).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2 import LLM, SamplingParams
from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import attention, decode_attention
from mrv2.kernels.decode_attention import decode_rope_attention, decode_rope_attention_ref
from mrv2.kernels.rotary import build_cos_sin_cache
from mrv2.models import qwen3
from mrv2.platform import DEVICE, HAS_CUDA, TRITON_INTERPRET

TOL = {"rtol": 1e-4, "atol": 1e-4}
REPO = pathlib.Path(__file__).resolve().parents[1]


def _decode_batch(ctx_lens, H, Hkv, D, page=16, pad=1, seed=0, dtype=torch.float32):
    """One decode token per request after ``ctx_lens[b]`` cached tokens, plus ``pad`` graph
    padding requests; the cache holds random keys/values below each new token, NaN
    elsewhere (a read the kernel should not make shows up)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + 1 for c in ctx_lens]
    pages = [-(-s // page) for s in seq_lens]
    num_blocks = sum(pages) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_table = torch.zeros(len(seq_lens) + pad, max(pages) + 1, dtype=torch.int32)
    kv = torch.full((2, num_blocks, page, Hkv, D), float("nan"))
    slots = []
    for b, (s, n) in enumerate(zip(seq_lens, pages, strict=True)):
        ids, perm = perm[:n], perm[n:]
        block_table[b, :n] = torch.tensor(ids, dtype=torch.int32)
        for i in range(s - 1):
            kv[:, ids[i // page], i % page] = torch.randn(2, Hkv, D, generator=g)
        slots.append(ids[(s - 1) // page] * page + (s - 1) % page)
    T = len(seq_lens)
    qkv = torch.randn(T + pad, (H + 2 * Hkv) * D, generator=g)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(list(range(T + 1)) + [T] * pad, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens + [0] * pad, dtype=torch.int32),
        block_table=block_table, slot_mapping=torch.tensor(slots + [-1] * pad),
        max_query_len=1, max_seq_len=max(seq_lens))
    md = AttentionMetadata(*(x.to(DEVICE) if torch.is_tensor(x) else x
                             for x in (md.query_start_loc, md.seq_lens, md.block_table,
                                       md.slot_mapping, md.max_query_len, md.max_seq_len)))
    positions = torch.tensor([s - 1 for s in seq_lens] + [0] * pad)
    norm = (1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g))
    return (qkv.to(DEVICE, dtype), positions.to(DEVICE), kv.to(DEVICE, dtype), md,
            [w.to(DEVICE, dtype) for w in norm])


CTX = [0, 5, 15, 16, 40, 100]   # a first token, in-page, a page's end, across pages and tiles


@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (8, 2, 32)])
@pytest.mark.parametrize("use_norm", [True, False])
@pytest.mark.parametrize("cfg", [{"num_splits": 1, "block_n": 16},
                                 {"num_splits": 3, "block_n": 16},
                                 {"num_splits": 8, "block_n": 32},
                                 {"num_splits": 2, "block_n": 64},
                                 # fixed parts (attention.DECODE_PARTITIONS): 7 x 16 keys,
                                 # 4 x 32 keys; short requests leave parts empty
                                 {"num_splits": 7, "block_n": 16, "part_tiles": 1},
                                 {"num_splits": 4, "block_n": 16, "part_tiles": 2}])
@pytest.mark.parametrize("prefetch,early_meta", [(False, True), (True, True), (False, False)])
def test_matches_the_two_kernels_it_replaces(H, Hkv, D, use_norm, cfg, prefetch, early_meta,
                                             monkeypatch):
    """``prefetch``: the first cached key tile loaded before the PDL wait (``PREFETCH``);
    ``early_meta``: the step's metadata too, and the new token's k / v beside q
    (``attention.EARLY_META``, the default), or after the wait: the same numerics, and the
    NaN slots show that it reads no key it should not."""
    monkeypatch.setattr(decode_attention, "PREFETCH", prefetch)
    monkeypatch.setattr(attention, "EARLY_META", early_meta)
    qkv, positions, kv, md, (qw, kw) = _decode_batch(CTX, H, Hkv, D, seed=H + D)
    cos_sin = build_cos_sin_cache(D, 256, 10000.0, DEVICE)
    weights = (qw, kw) if use_norm else (None, None)
    kv_ref = kv.clone()
    ref = decode_rope_attention_ref(qkv, positions, cos_sin, *weights, 1e-6, kv_ref, md,
                                    D ** -0.5, H, Hkv)
    out = torch.full((qkv.shape[0], H, D), 7.0, device=DEVICE)
    decode_rope_attention(qkv, positions, cos_sin, *weights, 1e-6, kv, md, D ** -0.5, H, Hkv,
                          out=out, config=cfg)
    torch.testing.assert_close(out[:len(CTX)], ref[:len(CTX)], **TOL)
    assert (out[len(CTX):] == 7.0).all()                     # the padding row is untouched
    # the new tokens' slots hold their rotated keys and values; every other slot as before
    torch.testing.assert_close(kv.nan_to_num(123.0), kv_ref.nan_to_num(123.0), **TOL)


@pytest.mark.parametrize("cfg", [{"num_splits": 3, "block_n": 16},
                                 {"num_splits": 8, "block_n": 32}])
def test_folded_merge_equals_the_merge_kernel(cfg, monkeypatch):
    """The last split of each (token, KV head) merges in the attention kernel itself
    (``FOLD_MERGE``): the merge kernel's result, twice in a row (the counters go back to 0)."""
    qkv, positions, kv, md, (qw, kw) = _decode_batch(CTX, 8, 2, 32, seed=5)
    cos_sin = build_cos_sin_cache(32, 256, 10000.0, DEVICE)
    outs = {}
    for fold in (False, True, True):
        monkeypatch.setattr(decode_attention, "FOLD_MERGE", fold)
        out = decode_rope_attention(qkv, positions, cos_sin, qw, kw, 1e-6, kv.clone(), md,
                                    32 ** -0.5, 8, 2, config=cfg)
        if fold and fold in outs:
            assert torch.equal(out[:len(CTX)], outs[fold][:len(CTX)])  # the second launch
        outs[fold] = out
    torch.testing.assert_close(outs[True][:len(CTX)], outs[False][:len(CTX)], **TOL)
    # NOTE: keyed by the tensors' device (cuda:0 on a GPU), whatever DEVICE spells
    assert decode_attention._COUNTERS
    assert all(int(c.abs().sum()) == 0 for c in decode_attention._COUNTERS.values())


def test_bad_input_raises_before_work():
    qkv, positions, kv, md, (qw, kw) = _decode_batch([3, 4], 4, 2, 16)
    cos_sin = build_cos_sin_cache(16, 64, 10000.0, DEVICE)
    import dataclasses
    with pytest.raises(ValueError, match="max_query_len"):
        decode_rope_attention(qkv, positions, cos_sin, qw, kw, 1e-6, kv,
                              dataclasses.replace(md, max_query_len=2), 0.25, 4, 2)
    with pytest.raises(ValueError, match="does not fit"):
        decode_rope_attention(qkv[:, :-16], positions, cos_sin, qw, kw, 1e-6, kv, md, 0.25,
                              4, 2)
    with pytest.raises(ValueError, match="both"):
        decode_rope_attention(qkv, positions, cos_sin, qw, None, 1e-6, kv, md, 0.25, 4, 2)


def test_on_by_default_on_a_gpu_and_only_for_decode(monkeypatch):
    qkv, _, _, md, _ = _decode_batch([3], 4, 2, 16)
    import dataclasses
    # on by default on a GPU (MRV2_FUSED_ROPE_ATTENTION=0 turns it off), never interpreted
    assert decode_attention.ENABLED == (HAS_CUDA and not TRITON_INTERPRET
                                        and os.environ.get("MRV2_FUSED_ROPE_ATTENTION") != "0")
    monkeypatch.setattr(decode_attention, "ENABLED", True)
    assert decode_attention.use_fused_rope_attention(qkv, md)
    assert not decode_attention.use_fused_rope_attention(
        qkv, dataclasses.replace(md, max_query_len=2))
    wide = qkv.new_zeros(decode_attention.MAX_TOKENS + 1, qkv.shape[1])  # batch 33: two kernels
    assert not decode_attention.use_fused_rope_attention(wide, md)


@pytest.mark.parametrize("which", ["embedded", "stories260K", "qwen2_bias"])
def test_model_decode_logits_on_equals_off(which, monkeypatch, shared_data):
    """The embedded Qwen3 (q/k-norm), the stories260K Llama (head_dim 8: half a head is 4
    of the kernel's 16 columns) and a Qwen2-style model with q/k/v biases (no q/k-norm):
    a decode step's logits with the path on vs off (after a 4-token prefill, off)."""
    import transformers
    from test_skinny_fused import _decode_logits

    from mrv2.models.loader import DEFAULT_MODEL_DIR, load_model
    if which == "embedded":
        model, config = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    elif which == "stories260K":
        model, config = load_model(shared_data / "stories260K" / "hf-llama", dtype="float32")
    else:
        config = transformers.LlamaConfig(
            vocab_size=300, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=64, attention_bias=True)
        model = qwen3.Qwen3ForCausalLM(config).to(DEVICE).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    calls = []
    orig = decode_attention.decode_rope_attention
    monkeypatch.setattr(qwen3, "decode_rope_attention",
                        lambda *a, **k: calls.append(1) or orig(*a, **k))
    for ids in ([3], [3, 9]):
        logits = {}
        for on in (False, True):
            monkeypatch.setattr(decode_attention, "ENABLED", on)
            logits[on] = _decode_logits(model, config, ids, 4, False, monkeypatch)
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
    assert len(calls) == 2 * config.num_hidden_layers          # each layer, each decode


def test_llm_greedy_fused_rope_attention_on_equals_off(monkeypatch):
    """End to end, eager fp32: 3 prompts, a few decode steps, the path on vs off."""
    llm = LLM(max_model_len=64, max_num_seqs=3, dtype="float32", enforce_eager=True)
    prompts = ["ROMEO:", "JULIET:\nO Romeo,", "First Citizen:"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
    calls = []
    orig = decode_attention.decode_rope_attention
    monkeypatch.setattr(qwen3, "decode_rope_attention",
                        lambda *a, **k: calls.append(1) or orig(*a, **k))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(decode_attention, "ENABLED", on)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
        assert bool(calls) == on
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 and CUDA graphs need the GPU")
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("ctx", [[0, 100, 1000], [7] * 32, [1500]])
def test_gpu_bf16_qwen3_shape_vs_the_two_kernels_and_in_a_graph(ctx, prefetch, monkeypatch):
    """Qwen3-0.6B's attention shape (16 q / 8 KV heads, d 128), bf16, the decode table's
    launch (splits as a batch of 3 or 32 gets them; one request: 24 splits, the folded
    merge): against qk_norm_rope + paged_attention
    (compiled), and a CUDA-graph replay (PDL on by default) bitwise equal to eager; with
    the first key tile loaded before the PDL wait (``PREFETCH``) and without (the model
    prefetches up to 8 requests only; here every batch does, 32 included)."""
    monkeypatch.setattr(decode_attention, "PREFETCH", prefetch)
    monkeypatch.setattr(decode_attention, "PREFETCH_MAX_REQS", 64)
    from mrv2.kernels.attention import paged_attention
    from mrv2.kernels.rotary import qk_norm_rope
    qkv, positions, kv, md, (qw, kw) = _decode_batch(ctx, 16, 8, 128, seed=len(ctx),
                                                     dtype=torch.bfloat16)
    cos_sin = build_cos_sin_cache(128, 2048, 1e6, "cuda")
    T = qkv.shape[0]
    kv_two = kv.clone()
    q, k, v = qkv.split([16 * 128, 8 * 128, 8 * 128], dim=-1)
    q, _ = qk_norm_rope(q.view(T, 16, 128), k.view(T, 8, 128), positions, cos_sin, qw, kw,
                        1e-6, v=v.view(T, 8, 128), kv_cache=kv_two, slot_mapping=md.slot_mapping)
    two = paged_attention(q, kv_two, md, 128 ** -0.5)
    kv_one = kv.clone()
    one = decode_rope_attention(qkv, positions, cos_sin, qw, kw, 1e-6, kv_one, md,
                                128 ** -0.5, 16, 8)
    n = len(ctx)
    torch.testing.assert_close(one[:n].float(), two[:n].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kv_one.nan_to_num(9.0), kv_two.nan_to_num(9.0), rtol=1e-2,
                               atol=1e-2)                 # FMA contraction may differ
    kv_g = kv.clone()
    out = torch.empty_like(one)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_rope_attention(qkv, positions, cos_sin, qw, kw, 1e-6, kv_g, md, 128 ** -0.5,
                              16, 8, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:n], one[:n])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="PTX prefetches need the GPU")
@pytest.mark.parametrize("ctx", [[0, 100, 1000], [7] * 32, [190] * 24, [1500]])
def test_gpu_l2_prefetch_changes_no_bit(ctx, monkeypatch):
    """``PREFETCH_L2`` (every cached row a program reads brought into L2 before the PDL wait)
    only moves bytes: eager and a CUDA-graph replay bitwise equal to the launch without it,
    with and without ``PREFETCH``'s first tile in registers; the same cache written."""
    qkv, positions, kv, md, (qw, kw) = _decode_batch(ctx, 16, 8, 128, seed=len(ctx),
                                                     dtype=torch.bfloat16)
    cos_sin = build_cos_sin_cache(128, 2048, 1e6, "cuda")
    n = len(ctx)

    def run(l2, regs, graph=False):
        monkeypatch.setattr(decode_attention, "PREFETCH_L2", l2)
        monkeypatch.setattr(decode_attention, "PREFETCH_L2_MIN_REQS", 1)
        monkeypatch.setattr(decode_attention, "PREFETCH", regs)
        cache = kv.clone()
        out = decode_rope_attention(qkv, positions, cos_sin, qw, kw, 1e-6, cache, md,
                                    128 ** -0.5, 16, 8)
        if graph:
            cache = kv.clone()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                decode_rope_attention(qkv, positions, cos_sin, qw, kw, 1e-6, cache, md,
                                      128 ** -0.5, 16, 8, out=out)
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
        return out[:n], cache.nan_to_num(9.0)

    for regs in (False, True):
        base_out, base_cache = run(False, regs)
        for graph in (False, True):
            out, cache = run(True, regs, graph)
            assert torch.equal(out, base_out) and torch.equal(cache, base_cache)


def test_sm90_ptx_prefetches_the_keys_into_l2_before_the_wait():
    """Compiled for sm_90 (no GPU; a process of its own, where Triton compiles instead of
    interpreting), a 24-request launch with ``PREFETCH_L2``: its ``prefetch.global.L2`` all
    come before ``griddepcontrol.wait``; without it, none."""
    pytest.importorskip("triton.backends.nvidia")
    code = ("import json, sys; sys.path.insert(0, 'scripts'); import check_pdl_sm90 as c; "
            "print(json.dumps([c.decode_attention_ptx(24, l2) for l2 in (True, False)]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for l2, ptx in zip((True, False), json.loads(proc.stdout.splitlines()[-1])):
        lines = ptx.splitlines()
        pf = [i for i, line in enumerate(lines) if "prefetch.global.L2" in line]
        wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        assert len(wait) == 1
        assert (len(pf) >= 2 and max(pf) < wait[0]) if l2 else not pf


def _loads_before_the_wait(ptx: str) -> int:
    head, sep, _ = ptx.partition("griddepcontrol.wait")
    assert sep, "no griddepcontrol.wait in the PTX"
    return head.count("ld.global")


def test_sm90_early_meta_loads_the_metadata_before_the_wait():
    """Compiled for sm_90 (no GPU, a process of its own): with ``attention.EARLY_META`` a
    4-request launch issues more loads before ``griddepcontrol.wait`` than without (the
    request's lengths, the token's position, angles and slot); at 24 requests the package's
    rule (``attention.early_meta``) leaves it off: the PTX of EARLY_META off."""
    pytest.importorskip("triton.backends.nvidia")
    code = ("import json, sys; sys.path.insert(0, 'scripts'); import check_pdl_sm90 as c; "
            "print(json.dumps([c.decode_attention_ptx(4, False, early_meta=True), "
            "c.decode_attention_ptx(4, False, early_meta=False), "
            "c.decode_attention_ptx(24, False), c.decode_attention_ptx(24, False, early_meta=False)]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    on4, off4, rule24, off24 = json.loads(proc.stdout.splitlines()[-1])
    assert _loads_before_the_wait(on4) >= _loads_before_the_wait(off4) + 4
    assert rule24 == off24

