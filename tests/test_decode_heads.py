"""decode_heads: decode attention with several KV heads a program in one flat loop, against
``paged_attention_ref``.

Under the interpreter in fp32, on ``test_kernels_attention``'s batches (shuffled pages, NaN in
every cache slot and block-table entry no request owns): contexts on and off tile and page
boundaries, one key, padding requests and tokens, GQA groups 1 / 2 / 4, page sizes, 1-8
heads a program, key tiles 16 / 64, a request order, the routing in ``paged_attention``,
argument errors, and the embedded model's greedy tokens with the path on vs off. bf16 at the
Qwen3-0.6B shape at batch 256 on the GPU, with PDL, in a CUDA graph.
"""

import dataclasses

import pytest
import torch
from test_kernels_attention import make_batch

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2 import LLM, SamplingParams
from mrv2.kernels import attention, decode_attention, decode_heads
from mrv2.kernels.attention import paged_attention, paged_attention_ref
from mrv2.kernels.decode_heads import decode_heads_attention, heads_per_program
from mrv2.platform import HAS_CUDA

# (cached keys before, 1): decodes of 1, 16, 17, 64, 65, 100, 129 keys.
REQS = [(0, 1), (15, 1), (16, 1), (63, 1), (64, 1), (99, 1), (128, 1)]


def _launches(monkeypatch) -> list[int]:
    """The request counts of every ``decode_heads_attention`` call from here on."""
    calls = []
    orig = decode_heads.decode_heads_attention
    monkeypatch.setattr(decode_heads, "decode_heads_attention",
                        lambda *a, **k: calls.append(a[2].num_reqs) or orig(*a, **k))
    return calls


def _check(reqs, num_heads, num_kv_heads, head_dim=16, block_size=16, heads=None, config=None,
           **kw):
    q, kv_cache, md = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, **kw)
    scale = head_dim ** -0.5
    expected = paged_attention_ref(q, kv_cache, md, scale)
    got = decode_heads_attention(q, kv_cache, md, scale, torch.zeros_like(q), heads=heads,
                                 config=config)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    n = int(md.query_start_loc[-1])
    assert torch.isfinite(got[:n]).all() and (got[n:] == 0).all()   # padding rows untouched
    return got


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("block_n", [16, 64])
def test_matches_reference_any_heads_a_program(heads, block_n):
    _check(REQS, 16, 8, heads=heads, config={"block_n": block_n}, num_pad_reqs=2,
           num_pad_tokens=3)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_gqa_groups_and_page_sizes(num_heads, num_kv_heads, block_size):
    _check(REQS[:5], num_heads, num_kv_heads, block_size=block_size, config={"block_n": 16})


def test_a_request_order_changes_no_result():
    reqs = [(40, 1), (0, 1), (300, 1), (5, 1), (77, 1)]
    q, kv_cache, md = make_batch(reqs, 4, 2, 16, num_pad_reqs=2, num_pad_tokens=1, seed=3)
    plain = decode_heads_attention(q, kv_cache, md, 0.25, torch.zeros_like(q))
    md_o = dataclasses.replace(md, req_order=attention.request_order(md.seq_lens))
    got = decode_heads_attention(q, kv_cache, md_o, 0.25, torch.zeros_like(q))
    assert torch.equal(got, plain)
    torch.testing.assert_close(plain, paged_attention_ref(q, kv_cache, md, 0.25),
                               atol=1e-5, rtol=1e-5)


def test_takes_the_pdl_flag_and_gives_the_same_result(monkeypatch):
    from test_pdl import _SpyAll

    from mrv2.kernels import pdl
    spy = _SpyAll(monkeypatch, (decode_heads, "_decode_heads_kernel"))
    q, kv_cache, md = make_batch(REQS, 4, 2, 16, seed=5)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "use_pdl", lambda device, on=on: on)
        outs[on] = decode_heads_attention(q, kv_cache, md, 0.25, torch.zeros_like(q))
    assert spy.pdl == [("_decode_heads_kernel", False), ("_decode_heads_kernel", True)]
    assert torch.equal(outs[False], outs[True])


def test_heads_per_program_rule():
    assert heads_per_program(8) == decode_heads.HEADS == 8
    assert heads_per_program(8, 4) == 4 and heads_per_program(6) == 2
    assert heads_per_program(1) == 1 and heads_per_program(12, 8) == 4


def test_bad_input_raises_before_work():
    q, kv_cache, md = make_batch([(3, 1), (0, 2)], 4, 2, 16)
    with pytest.raises(ValueError, match="max_query_len 1"):
        decode_heads_attention(q, kv_cache, md, 0.25, torch.zeros_like(q))
    q, kv_cache, md = make_batch([(3, 1)], 4, 2, 16)
    with pytest.raises(ValueError, match="power of two dividing 2"):
        decode_heads_attention(q, kv_cache, md, 0.25, torch.zeros_like(q), heads=4)
    with pytest.raises(ValueError, match="does not fit"):
        decode_heads_attention(q[:, :3], kv_cache, md, 0.25, torch.zeros_like(q[:, :3]))


def test_paged_attention_routes_only_large_plain_decode_launches(monkeypatch):
    calls = _launches(monkeypatch)
    monkeypatch.setattr(decode_heads, "ENABLED", True)
    monkeypatch.setattr(decode_heads, "MIN_REQS", 3)
    q, kv_cache, md = make_batch(REQS[:4], 4, 2, 16)
    expected = paged_attention_ref(q, kv_cache, md, 0.25)
    torch.testing.assert_close(paged_attention(q, kv_cache, md, 0.25), expected,
                               atol=1e-5, rtol=1e-5)
    assert calls == [4]
    paged_attention(q, kv_cache, md, 0.25, num_splits=2)           # a split asked for
    paged_attention(q, kv_cache, md, 0.25, config={"block_n": 16})  # a benchmark's launch
    q2, kv2, md2 = make_batch(REQS[:2], 4, 2, 16)                   # below MIN_REQS
    paged_attention(q2, kv2, md2, 0.25)
    q3, kv3, md3 = make_batch([(3, 1), (0, 5), (9, 1)], 4, 2, 16)   # a prefill in the step
    paged_attention(q3, kv3, md3, 0.25)
    long_md = dataclasses.replace(md, max_seq_len=decode_heads.MAX_SEQ_LEN + 1)
    paged_attention(q, kv_cache, long_md, 0.25)                     # contexts may be long
    assert calls == [4]
    monkeypatch.setattr(decode_heads, "ENABLED", False)
    paged_attention(q, kv_cache, md, 0.25)
    assert calls == [4]


def test_llm_greedy_on_equals_off(monkeypatch):
    """End to end, fp32: every decode step of the embedded model through it vs not."""
    llm = LLM(max_model_len=96, max_num_seqs=4, dtype="float32", enforce_eager=True)
    prompts = ["ROMEO:", "JULIET:\nO Romeo,", "First Citizen:", "KING HENRY:"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
    calls = _launches(monkeypatch)
    monkeypatch.setattr(decode_heads, "MIN_REQS", 1)
    # NOTE: on the GPU small decode batches take the fused decode attention, never
    # paged_attention; turn it off so both runs reach the router.
    monkeypatch.setattr(decode_attention, "ENABLED", False)

    def tokens(on):
        monkeypatch.setattr(decode_heads, "ENABLED", on)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    off = tokens(False)
    assert not calls
    on = tokens(True)
    assert calls and on == off


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16, PDL and CUDA graphs need the GPU")
@pytest.mark.parametrize("heads", [2, 8])
def test_gpu_bf16_batch_256_in_a_cuda_graph(heads):
    reqs = [((i * 37) % 300, 1) for i in range(256)]
    q, kv_cache, md = make_batch(reqs, 16, 8, 128, num_pad_reqs=4, dtype=torch.bfloat16,
                                 device="cuda")
    scale = 128 ** -0.5
    expected = paged_attention_ref(q, kv_cache, md, scale)
    out = torch.zeros_like(q)
    decode_heads_attention(q, kv_cache, md, scale, out, heads=heads)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    eager = out.clone()
    out.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_heads_attention(q, kv_cache, md, scale, out, heads=heads)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the sync detector needs the GPU")
def test_gpu_v2_loop_with_decode_heads_runs_under_sync_debug_error(monkeypatch):
    """The V2 step loop with every decode step through this kernel (fused decode attention
    off, the request floor at 1), async and CUDA graphs: no CPU-GPU sync."""
    from device_utils import generate_without_sync

    monkeypatch.setattr(decode_heads, "ENABLED", True)
    monkeypatch.setattr(decode_heads, "MIN_REQS", 1)
    monkeypatch.setattr(decode_attention, "ENABLED", False)
    calls = _launches(monkeypatch)
    llm = LLM(max_model_len=96, max_num_seqs=8, async_scheduling=True)
    prompts = [f"Speak, {name}:" for name in ("ROMEO", "JULIET", "HAMLET", "LEAR", "PUCK")]
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)                 # warm-up: compile
    assert calls                                                  # the path ran (eager warm-up)
    outs = generate_without_sync(llm, prompts, params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
