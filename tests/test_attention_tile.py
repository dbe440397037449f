"""``attention_tile._attend_tile``, the one key tile of the online softmax that
``paged_attention`` and ``decode_heads`` share, against a torch step of the same math.

One tile is folded into a running (acc, max, sum) state, fresh or mid-walk: keys found
through a shuffled block table, a tile starting on a page boundary, the masked last tile
(keys past the sequence, whose cache slots and table entries hold NaN / garbage), causal
positions, a padding row that sees no key, the second KV head, and a head dim below its
padded block. fp32 ('ieee' dots), interpreted on the CPU.
"""

import pytest
import torch
import triton
import triton.language as tl

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.attention_tile import _LOG2E, _attend_tile
from mrv2.platform import DEVICE


@triton.jit
def _one_tile_kernel(q_ptr, acc_ptr, m_ptr, l_ptr, pos_ptr, kv_ptr, bt_ptr, qk_scale,
                     start, seq_end, b, kh0,
                     stride_ckv, stride_cb, stride_co, stride_ch, stride_cd, stride_bt,
                     HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, MASKED: tl.constexpr):
    r = tl.arange(0, BLOCK_M)
    e = tl.arange(0, BLOCK_E)
    rows = r[:, None] * BLOCK_E + e[None, :]                               # [BM, BE]
    q = tl.load(q_ptr + rows)
    acc, m_i, l_i = tl.load(acc_ptr + rows), tl.load(m_ptr + r), tl.load(l_ptr + r)
    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, seq_end, tl.load(pos_ptr + r), b,
                                 kv_ptr, bt_ptr, qk_scale, kh0, e * stride_cd, e < HEAD_DIM,
                                 stride_ckv, stride_cb, stride_co, stride_ch, stride_bt,
                                 PAGE_SIZE, BLOCK_N, MASKED, "ieee")
    tl.store(acc_ptr + rows, acc)
    tl.store(m_ptr + r, m_i)
    tl.store(l_ptr + r, l_i)


def tile_ref(acc, m_i, l_i, q, start, seq_end, pos, b, kv, bt, qk_scale, kh, block_n, masked):
    """The same step in torch: scores in log2 units, then the online-softmax update."""
    page_size, head_dim = kv.shape[2], kv.shape[-1]
    n = torch.arange(start, start + block_n)
    ok = n < seq_end if masked else torch.ones(block_n, dtype=torch.bool)
    page = torch.where(ok, bt[b, (n // page_size).clamp(max=bt.shape[1] - 1)], 0).long()
    k, v = (torch.where(ok[:, None], kv[i, page, n % page_size, kh], 0.0) for i in (0, 1))
    s = q[:, :head_dim] @ k.T * qk_scale                                   # [BM, BN]
    if masked:
        s = torch.where((n[None, :] <= pos[:, None]) & ok[None, :], s, float("-inf"))
    m_new = torch.maximum(m_i, s.max(1).values)
    alpha, p = torch.exp2(m_i - m_new), torch.exp2(s - m_new[:, None])
    return acc[:, :head_dim] * alpha[:, None] + p @ v, m_new, l_i * alpha + p.sum(1)


@pytest.mark.parametrize("start,masked", [(16, False), (32, True), (0, True)])
@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("head_dim", [16, 12])
def test_one_tile_matches_torch(start, masked, fresh, head_dim):
    g = torch.Generator().manual_seed(start + 7 * head_dim + fresh)
    page_size, block_n, block_m, block_e, kv_heads, seq_end, b, kh = 8, 16, 16, 16, 2, 40, 1, 1
    pages = -(-seq_end // page_size)
    perm = torch.randperm(12, generator=g)
    bt = torch.full((2, 8), 10**6, dtype=torch.int32)          # garbage past the pages
    bt[b, :pages] = perm[:pages].to(torch.int32)
    kv = torch.full((2, 12, page_size, kv_heads, head_dim), float("nan"))
    for i in range(seq_end):                                   # only real keys hold numbers
        kv[:, bt[b, i // page_size], i % page_size] = torch.randn(2, kv_heads, head_dim,
                                                                  generator=g)
    q = torch.zeros(block_m, block_e)
    q[:, :head_dim] = torch.randn(block_m, head_dim, generator=g)
    # positions: a decode token (the last key), earlier prefill rows, a padding row (-1)
    pos = torch.tensor([seq_end - 1, 35, 33, 20, 5] + [seq_end - 1] * 10 + [-1],
                       dtype=torch.int32)
    if fresh:
        acc, m_i, l_i = torch.zeros(block_m, block_e), torch.full((block_m,), -1e30), \
            torch.zeros(block_m)
    else:
        acc = torch.zeros(block_m, block_e)
        acc[:, :head_dim] = torch.randn(block_m, head_dim, generator=g)
        m_i, l_i = torch.randn(block_m, generator=g), torch.rand(block_m, generator=g) + 0.5
    qk_scale = head_dim ** -0.5 * _LOG2E
    want = tile_ref(acc, m_i, l_i, q, start, seq_end, pos, b, kv, bt, qk_scale, kh, block_n,
                    masked)
    got = [t.clone().to(DEVICE) for t in (acc, m_i, l_i)]
    _one_tile_kernel[(1,)](q.to(DEVICE), *got, pos.to(DEVICE), kv.to(DEVICE), bt.to(DEVICE),
                           qk_scale, start, seq_end, b, kh, *kv.stride(), bt.stride(0),
                           HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_E=block_e, MASKED=masked)
    torch.testing.assert_close(got[0][:, :head_dim], want[0], atol=1e-5, rtol=1e-5)
    for g_t, w_t in zip(got[1:], want[1:]):
        torch.testing.assert_close(g_t, w_t, atol=1e-5, rtol=1e-5)
    if masked:   # the padding row saw no key: its state is as it came in
        assert got[1][-1] == m_i[-1] and got[2][-1] == l_i[-1]
