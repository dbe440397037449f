"""paged_attention (Triton) against its torch reference on mixed prefill/decode batches."""

import dataclasses
import json
import pathlib
import sys

import pytest
import torch

from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import attention
from mrv2.kernels.attention import paged_attention, paged_attention_ref
from mrv2.platform import DEVICE

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size=16, num_pad_reqs=0,
               num_pad_tokens=0, seed=0, dtype=torch.float32, device=DEVICE):
    """A random step. reqs: list of (num_cached_before, q_len), one per real request.

    Pages are handed out in a shuffled order; cache slots no request owns, block-table
    entries past a request's pages and queries of padding tokens are NaN / garbage, so
    any read the kernel should not make shows up in the output.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in reqs] + [0] * num_pad_reqs
    q_lens = [n for _, n in reqs] + [0] * num_pad_reqs
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3
    max_blocks = max(pages + [1]) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_table = torch.full((len(seq_lens), max_blocks), 10**6, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    for b, (s, n) in enumerate(zip(seq_lens, pages)):
        ids, perm = perm[:n], perm[n:]
        block_table[b, :n] = torch.tensor(ids, dtype=torch.int32)
        for i in range(s):  # only the slots of real tokens hold numbers
            kv_cache[:, ids[i // block_size], i % block_size] = torch.randn(
                2, num_kv_heads, head_dim, generator=g)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens + num_pad_tokens, num_heads, head_dim, generator=g)
    q[num_tokens:] = float("nan")
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    md = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64, device=device),
        max_query_len=max(q_lens + [0]), max_seq_len=max(seq_lens + [0]))
    return q.to(device, dtype), kv_cache.to(device, dtype), md


def check(reqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, atol=1e-5,
          **kw):
    q, kv_cache, md = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, **kw)
    scale = head_dim ** -0.5
    expected = paged_attention_ref(q, kv_cache, md, scale)
    got = paged_attention(q, kv_cache, md, scale)
    num_tokens = int(md.query_start_loc[-1])
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    assert torch.isfinite(got[:num_tokens]).all()
    assert (got[num_tokens:] == 0).all()  # uncovered padding tokens come back zero
    return q, kv_cache, md, expected


@pytest.mark.parametrize("reqs", [
    [(0, 1)],                              # one token, nothing cached
    [(15, 1), (16, 1), (17, 1), (31, 1)],  # decodes around page boundaries (16, 17, 18, 32)
    [(0, 16), (0, 32), (0, 33)],           # prefills of exactly 1 and 2 pages, and 2 + 1
    [(200, 3)],                            # long cached prefix, short new chunk
    [(40, 24)],                            # a prefill chunk in the middle of a sequence
    [(0, 20), (7, 1), (63, 1), (30, 9), (64, 1)],  # mixed prefill + decode
])
def test_matches_reference(reqs):
    check(reqs)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (2, 2, 8), (4, 2, 8), (8, 2, 8),      # GQA groups 1 / 2 / 4 at stories260K's head_dim
    (4, 1, 64), (6, 2, 64),               # group 4 and a group of 3 (padded to 4)
    (2, 1, 24),                           # head_dim that is no power of two
])
def test_gqa_and_head_dims(num_heads, num_kv_heads, head_dim):
    check([(5, 1), (0, 19), (20, 4)], num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_page_sizes(block_size):
    check([(9, 1), (0, 12), (33, 2)], block_size=block_size)


def test_padding_requests_and_tokens():
    # Padding rows (seq_len 0, no tokens) at the end and padding tokens past the last
    # request, as a captured CUDA graph replays a smaller batch.
    check([(3, 1), (0, 5)], num_pad_reqs=3, num_pad_tokens=4)


def test_empty_batch():
    q, kv_cache, md = make_batch([], 4, 2, 16, num_pad_reqs=2)
    assert paged_attention(q, kv_cache, md, 0.25).shape == (0, 4, 16)
    assert paged_attention_ref(q, kv_cache, md, 0.25).shape == (0, 4, 16)


@pytest.mark.parametrize("early_meta", [True, False])
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv(num_splits, early_meta, monkeypatch):
    # Flash-decoding path (chosen on the GPU for small batches); more splits than pages too;
    # the metadata loaded before the PDL wait (EARLY_META, the default) or after it.
    monkeypatch.setattr(attention, "EARLY_META", early_meta)
    reqs = [(40, 1), (0, 1), (70, 3), (5, 2)]
    q, kv_cache, md = make_batch(reqs, 4, 2, 16, num_pad_reqs=1, num_pad_tokens=2)
    expected = paged_attention_ref(q, kv_cache, md, 0.25)
    got = paged_attention(q, kv_cache, md, 0.25, num_splits=num_splits)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_out_buffer_and_strided_q():
    # q as a view into a fused qkv projection, written into a caller's buffer.
    q, kv_cache, md = make_batch([(10, 3), (0, 4)], 4, 2, 16, num_pad_tokens=1)
    qkv = torch.randn(q.shape[0], 8 * 16, device=DEVICE)
    qkv[:, :64] = q.reshape(q.shape[0], 64)
    q_view = qkv[:, :64].view(q.shape[0], 4, 16)
    out = torch.full((q.shape[0], 4, 16), 7.0, device=DEVICE)
    res = paged_attention(q_view, kv_cache, md, 0.25, out=out)
    assert res is out
    torch.testing.assert_close(out[:7], paged_attention_ref(q, kv_cache, md, 0.25)[:7],
                               atol=1e-5, rtol=1e-5)
    assert (out[7:] == 7.0).all()  # rows no request covers are left untouched


def test_reference_is_causal_softmax():
    # The spec on one tiny request, written out by hand: 2 new tokens after 1 cached.
    q, kv_cache, md = make_batch([(1, 2)], 1, 1, 8, block_size=2)
    keys = torch.cat([kv_cache[0, md.block_table[0, 0], :2, 0],
                      kv_cache[0, md.block_table[0, 1], :1, 0]])  # [3, 8]
    vals = torch.cat([kv_cache[1, md.block_table[0, 0], :2, 0],
                      kv_cache[1, md.block_table[0, 1], :1, 0]])  # [3, 8]
    out = paged_attention_ref(q, kv_cache, md, 0.5)
    for i, pos in enumerate([1, 2]):
        w = torch.softmax(q[i, 0] @ keys[:pos + 1].T * 0.5, dim=0)
        torch.testing.assert_close(out[i, 0], w @ vals[:pos + 1])


def test_bench_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_attention
    finally:
        sys.path.pop(0)
    result = bench_attention.main(["--smoke", "--out", str(tmp_path / "a.json")])
    saved = json.loads((tmp_path / "a.json").read_text())
    assert saved["cases"] and saved["cases"][0]["us"] > 0
    # fp32 under the interpreter matches the reference tightly; bf16 on the GPU does not.
    tol = 1e-5 if saved["dtype"] == "float32" else 2e-2
    assert result["cases"][0]["max_abs_err_vs_ref"] < tol


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_matches_reference_bf16_cuda(num_splits):
    # Qwen3-0.6B's attention shape in bf16 on the GPU, mixed batch with padding.
    reqs = [(0, 37), (100, 1), (15, 1), (1000, 1), (250, 70), (16, 1), (63, 2)]
    q, kv_cache, md = make_batch(reqs, 16, 8, 128, num_pad_reqs=2, num_pad_tokens=3,
                                 dtype=torch.bfloat16, device="cuda")
    expected = paged_attention_ref(q, kv_cache, md, 128 ** -0.5)
    got = paged_attention(q, kv_cache, md, 128 ** -0.5, num_splits=num_splits)
    num_tokens = int(md.query_start_loc[-1])
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.isfinite(got[:num_tokens]).all()


@pytest.mark.gpu
def test_decode_fp32_cuda():
    # fp32 on the GPU uses IEEE dots (no TF32), so it matches the reference tightly.
    q, kv_cache, md = make_batch([(500, 1), (31, 1), (0, 1)], 16, 8, 128, device="cuda")
    expected = paged_attention_ref(q, kv_cache, md, 128 ** -0.5)
    got = paged_attention(q, kv_cache, md, 128 ** -0.5)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# -- longest_first: a request order for the programs (changes placement, not results) ------

def test_request_order_is_longest_first_stable_and_puts_padding_last():
    from mrv2.kernels.attention import request_order

    seq_lens = torch.tensor([5, 900, 0, 37, 900, 1, 0], dtype=torch.int32, device=DEVICE)
    order = request_order(seq_lens)
    assert order.dtype == torch.int32
    assert order.tolist() == [1, 4, 3, 0, 5, 2, 6]  # ties (900, 0) keep batch order


@pytest.mark.parametrize("early_meta", [True, False])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_request_order_changes_no_result(num_splits, early_meta, monkeypatch):
    # Each program reads its request from req_order: any permutation (longest first, or a
    # random one) must give the batch-order result exactly, padding rows included; with the
    # order and lengths read before the PDL wait (EARLY_META) or after it.
    monkeypatch.setattr(attention, "EARLY_META", early_meta)
    reqs = [(40, 1), (0, 1), (300, 1), (5, 1), (77, 1)]
    q, kv_cache, md = make_batch(reqs, 4, 2, 16, num_pad_reqs=2, num_pad_tokens=1, seed=3)
    plain = paged_attention(q, kv_cache, md, 0.25, num_splits=num_splits)
    torch.testing.assert_close(plain, paged_attention_ref(q, kv_cache, md, 0.25),
                               atol=1e-5, rtol=1e-5)
    from mrv2.kernels.attention import request_order

    g = torch.Generator().manual_seed(0)
    for order in (request_order(md.seq_lens),
                  torch.randperm(md.num_reqs, generator=g).to(torch.int32).to(DEVICE)):
        md_o = dataclasses.replace(md, req_order=order)
        got = paged_attention(q, kv_cache, md_o, 0.25, num_splits=num_splits)
        assert torch.equal(got[:len(reqs)], plain[:len(reqs)])


def test_longest_first_orders_only_large_gpu_decode_batches():
    from mrv2.kernels import attention

    reqs = [(i % 7, 1) for i in range(attention.ORDER_MIN_REQS)]
    _, _, md = make_batch(reqs, 2, 1, 16)
    md = dataclasses.replace(md, max_seq_len=attention.ORDER_MIN_SEQ_LEN)  # a bound
    ordered = attention.longest_first(md)
    assert (ordered.req_order is not None) == (md.seq_lens.is_cuda and attention.ORDER_ENABLED)
    small = dataclasses.replace(md, seq_lens=md.seq_lens[:attention.ORDER_MIN_REQS - 1])
    assert attention.longest_first(small) is small  # the fused kernel's range: no order
    short = dataclasses.replace(md, max_seq_len=attention.ORDER_MIN_SEQ_LEN - 1)
    assert attention.longest_first(short) is short  # short contexts: not worth the sort
    assert attention.longest_first(dataclasses.replace(md, max_query_len=2)).req_order is None


@pytest.mark.gpu
def test_longest_first_on_the_gpu_bf16():
    from mrv2.kernels import attention

    reqs = [((i * 37) % 300, 1) for i in range(attention.ORDER_MIN_REQS + 3)]
    q, kv_cache, md = make_batch(reqs, 16, 8, 128, num_pad_reqs=5, dtype=torch.bfloat16,
                                 device="cuda")
    md = dataclasses.replace(md, max_seq_len=max(md.max_seq_len, attention.ORDER_MIN_SEQ_LEN))
    md_o = attention.longest_first(md)
    assert md_o.req_order is not None
    assert md_o.req_order.tolist()[:2] == sorted(range(len(reqs)), key=lambda b: -reqs[b][0])[:2]
    plain = paged_attention(q, kv_cache, md, 128 ** -0.5)
    got = paged_attention(q, kv_cache, md_o, 128 ** -0.5)
    assert torch.equal(got[:len(reqs)], plain[:len(reqs)])


@pytest.mark.parametrize("decode_one_loop", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_gpus_two_loop_form_and_the_decode_one_loop(decode_one_loop, num_splits,
                                                        monkeypatch):
    """The interpreter runs every program as one masked loop (``_ONE_LOOP``); the GPU runs the
    full tiles first, then the causal tile, or with ``DECODE_ONE_LOOP`` a decode token's keys
    all in the masked loop. Both forms interpreted, on a mixed step (prefills, decodes on and
    off tile boundaries, a long cached prefix, padding rows and tokens) against the reference."""
    from mrv2.kernels import attention
    monkeypatch.setattr(attention, "_ONE_LOOP", False)
    monkeypatch.setattr(attention, "DECODE_ONE_LOOP", decode_one_loop)
    reqs = [(0, 20), (7, 1), (63, 1), (30, 9), (64, 1), (95, 1), (200, 1)]
    q, kv_cache, md = make_batch(reqs, 4, 2, 16, num_pad_reqs=1, num_pad_tokens=2)
    expected = paged_attention_ref(q, kv_cache, md, 0.25)
    for cfg in ({"block_n": 16}, {"block_n": 64}):
        got = paged_attention(q, kv_cache, md, 0.25, num_splits=num_splits, config=cfg)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# -- fixed-size key partitions (DECODE_PARTITIONS): every split a fixed number of tiles --------

@pytest.mark.parametrize("part_tiles", [1, 2, 3])
def test_fixed_partitions_match_the_reference(part_tiles, monkeypatch):
    """Split s covers keys [s * part_tiles * block_n, ...): requests shorter than the launch
    leave their last parts empty (a part of no keys merges as nothing), one ends exactly on a
    part's end, a prefill chunk and a padding request ride along; NaN slots catch a stray
    read. Under the interpreter (one masked loop) and in the GPU's two-loop form."""
    from mrv2.kernels import attention

    block_n = 16
    reqs = [(0, 1), (15, 1), (2 * block_n * part_tiles - 1, 1), (70, 1), (9, 6), (200, 1)]
    q, kv_cache, md = make_batch(reqs, 4, 2, 16, num_pad_reqs=1, num_pad_tokens=2, seed=11)
    num_splits = -(-md.max_seq_len // (part_tiles * block_n))  # the parts cover every key
    expected = paged_attention_ref(q, kv_cache, md, 0.25)
    cfg = {"block_n": block_n, "num_splits": num_splits, "part_tiles": part_tiles}
    for one_loop in (True, False):
        monkeypatch.setattr(attention, "_ONE_LOOP", one_loop)
        got = paged_attention(q, kv_cache, md, 0.25, config=cfg)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Evidence the parts are fixed, not equal shares: one split fewer than the longest
    # request needs leaves its last keys unread (equal shares would still cover them).
    part = part_tiles * block_n
    fewer = -(-md.max_seq_len // part) - 1
    short = paged_attention(q, kv_cache, md, 0.25, config={**cfg, "num_splits": fewer})
    longest = max(range(len(reqs)), key=lambda b: sum(reqs[b]))
    t = int(md.query_start_loc[longest])
    assert not torch.allclose(short[t], expected[t], atol=1e-3)
    covered = [int(md.query_start_loc[b]) for b in range(len(reqs))
               if sum(reqs[b]) <= fewer * part and reqs[b][1] == 1]
    assert covered
    torch.testing.assert_close(short[covered], expected[covered], atol=1e-5, rtol=1e-5)


def test_partition_rule_picks_parts_of_max_seq_len(monkeypatch):
    """``partition_launch``: the first rule whose request range and ``min_seq_len`` hold sets
    ``part_tiles`` = keys / block_n and ``num_splits`` = the parts of ``max_seq_len``; no
    rule, or one part, leaves the launch alone; a hand-given split count turns it off."""
    from mrv2.kernels import attention

    rules = [{"lo": 33, "hi": 128, "min_seq_len": 1024, "keys": 256, "num_warps": 4},
             {"lo": 129, "hi": 256, "keys": 512}]
    monkeypatch.setattr(attention, "DECODE_PARTITIONS", rules)
    base = {"block_n": 64, "num_splits": 1, "num_warps": 2, "num_stages": 3, "part_tiles": 0}
    cfg = attention.partition_launch(dict(base), 64, 2048)
    assert (cfg["part_tiles"], cfg["num_splits"], cfg["num_warps"]) == (4, 8, 4)
    assert attention.partition_launch(dict(base), 64, 2000)["num_splits"] == 8   # 7.8 parts
    assert attention.partition_launch(dict(base), 64, 1000) == base       # below min_seq_len
    assert attention.partition_launch(dict(base), 32, 2048) == base       # no rule for 32
    assert attention.partition_launch(dict(base), 200, 512) == base       # one part of 512
    cfg = attention.partition_launch(dict(base), 200, 513)
    assert (cfg["part_tiles"], cfg["num_splits"], cfg["num_warps"]) == (8, 2, 2)
    # a num_splits rule: equal shares (part_tiles 0), capped at the key tiles
    monkeypatch.setattr(attention, "DECODE_PARTITIONS", [{"lo": 1, "hi": 9, "num_splits": 4}])
    cfg = attention.partition_launch(dict(base), 5, 2048)
    assert (cfg["part_tiles"], cfg["num_splits"]) == (0, 4)
    assert attention.partition_launch(dict(base), 5, 100)["num_splits"] == 2
    assert attention.partition_launch(dict(base), 5, 64) == base
    monkeypatch.setattr(attention, "DECODE_PARTITIONS", rules)
    # the GPU picker applies it to decode launches only (one query token a request)
    monkeypatch.setattr(attention, "TRITON_INTERPRET", False)
    monkeypatch.setattr(attention, "_num_sms", lambda: 132)
    assert attention._pick_config(64, 8, 2, 1, 2048)["part_tiles"] == 4
    assert attention._pick_config(64, 8, 2, 2, 2048)["part_tiles"] == 0


def test_partition_rule_drives_the_launch(monkeypatch):
    """With a rule on, ``paged_attention`` launches the partitioned kernel (the picker's
    ``part_tiles`` reaches the kernel) and still equals the reference."""
    from mrv2.kernels import attention

    seen = []
    orig = attention._pick_config

    def pick(*args):
        cfg = orig(*args)
        cfg.update(block_n=16, num_splits=1, part_tiles=0, kv_fold=1)
        attention.partition_launch(cfg, args[0], args[4])
        seen.append(dict(cfg))
        return cfg
    monkeypatch.setattr(attention, "_pick_config", pick)
    monkeypatch.setattr(attention, "DECODE_PARTITIONS", [{"lo": 1, "hi": 8, "keys": 32}])
    reqs = [(3, 1), (100, 1), (40, 1), (64, 1)]
    q, kv_cache, md = make_batch(reqs, 4, 2, 16, num_pad_reqs=1, seed=4)
    got = paged_attention(q, kv_cache, md, 0.25)
    assert (seen[-1]["part_tiles"], seen[-1]["num_splits"]) == (2, 4)    # 101 keys / 32
    torch.testing.assert_close(got, paged_attention_ref(q, kv_cache, md, 0.25),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("part_tiles", [2, 4])
def test_fixed_partitions_bf16_cuda(part_tiles):
    # Qwen3-0.6B's shape, bf16, mixed decode contexts (1 key to 1,500), parts of 128 / 256 keys.
    reqs = [(0, 1), (1500, 1), (127, 1), (128, 1), (700, 1), (31, 1), (1023, 1)]
    q, kv_cache, md = make_batch(reqs, 16, 8, 128, num_pad_reqs=2, dtype=torch.bfloat16,
                                 device="cuda")
    splits = -(-md.max_seq_len // (64 * part_tiles))
    got = paged_attention(q, kv_cache, md, 128 ** -0.5,
                          config={"block_n": 64, "num_splits": splits, "part_tiles": part_tiles})
    expected = paged_attention_ref(q, kv_cache, md, 128 ** -0.5)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.isfinite(got[:len(reqs)]).all()
