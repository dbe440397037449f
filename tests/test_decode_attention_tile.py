"""``decode_attention_tile``: the fused decode kernel's helpers, one at a time, against torch.

Each helper runs inside a small test kernel under the interpreter, in fp32:

* ``_request_range``: a request's token, lengths, this split's key range and ``kv_hi`` (equal
  shares and fixed parts; a padding row of ``q_len`` 0);
* ``_token_meta``: the token's RoPE angles through its position, and its cache slot; a padding
  row reads nothing and gets slot -1;
* ``_new_token_kv``: a KV head's raw k and v from the qkv row, zeros where the program does not
  own the new token;
* ``_norm_rope``: q/k-norm (on and off) then RoPE of a few heads, as the two halves;
* ``_load_key_tile`` + ``_attend_key_tile``: one tile of cached keys through a shuffled block
  table, the masked last tile (NaN past the sequence), into a fresh or running online softmax.
"""

import pytest
import torch
import triton
import triton.language as tl

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.attention_tile import _LOG2E
from mrv2.kernels.decode_attention_tile import (
    _attend_key_tile,
    _load_key_tile,
    _new_token_kv,
    _norm_rope,
    _request_range,
    _token_meta,
)
from mrv2.platform import DEVICE


@triton.jit
def _request_range_kernel(qsl_ptr, seq_lens_ptr, out_ptr, NUM_SPLITS: tl.constexpr,
                          BLOCK_N: tl.constexpr, PART_TILES: tl.constexpr):
    split = tl.program_id(1)
    t, q_len, seq_len, lo, hi, kv_hi = _request_range(qsl_ptr, seq_lens_ptr, split, NUM_SPLITS,
                                                      BLOCK_N, "", PART_TILES)
    o = out_ptr + (tl.program_id(0) * NUM_SPLITS + split) * 6
    tl.store(o, t)
    tl.store(o + 1, q_len)
    tl.store(o + 2, seq_len)
    tl.store(o + 3, lo)
    tl.store(o + 4, hi)
    tl.store(o + 5, kv_hi)


@pytest.mark.parametrize("num_splits,part_tiles", [(1, 0), (3, 0), (4, 1)])
def test_request_range_matches_torch(num_splits, part_tiles):
    block_n = 4
    seq_lens = torch.tensor([1, 9, 16, 0], dtype=torch.int32)        # the last: padding
    qsl = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    out = torch.full((4, num_splits, 6), -7, dtype=torch.int32, device=DEVICE)
    _request_range_kernel[(4, num_splits)](qsl.to(DEVICE), seq_lens.to(DEVICE), out,
                                           NUM_SPLITS=num_splits, BLOCK_N=block_n,
                                           PART_TILES=part_tiles)
    for b, s in enumerate(seq_lens.tolist()):
        tiles = part_tiles or triton.cdiv(triton.cdiv(s, block_n), num_splits)  # equal shares
        for split in range(num_splits):
            lo = split * tiles * block_n
            hi = min(lo + tiles * block_n, s)
            want = [qsl[b].item(), (qsl[b + 1] - qsl[b]).item(), s, lo, hi, min(hi, s - 1)]
            assert out[b, split].tolist() == want, (b, split)


@triton.jit
def _token_meta_kernel(pos_ptr, cs_ptr, slot_ptr, qsl_ptr, cos_ptr, sin_ptr, slot_out_ptr,
                       stride_cp, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    b = tl.program_id(0)
    t = tl.load(qsl_ptr + b)
    t_ok = tl.load(qsl_ptr + b + 1) - t > 0
    c = tl.arange(0, BLOCK_HALF)
    c_ok = c < HALF
    cos, sin, slot = _token_meta(pos_ptr, cs_ptr, slot_ptr, t, t_ok, stride_cp, c, c_ok, HALF, "")
    tl.store(cos_ptr + b * BLOCK_HALF + c[None, :], cos)
    tl.store(sin_ptr + b * BLOCK_HALF + c[None, :], sin)
    tl.store(slot_out_ptr + b, slot)


def test_token_meta_reads_the_angles_through_the_position_and_the_slot():
    half, block_half = 6, 8                                   # a head dim of 12, padded
    g = torch.Generator().manual_seed(0)
    cos_sin = torch.randn(20, 2 * half, generator=g)
    positions = torch.tensor([3, 17, 0], dtype=torch.int64)
    slots = torch.tensor([40, 7, 99], dtype=torch.int64)
    qsl = torch.tensor([0, 1, 2, 2], dtype=torch.int32)        # request 2: padding (q_len 0)
    cos, sin = (torch.full((3, block_half), 5.0, device=DEVICE) for _ in range(2))
    slot_out = torch.full((3,), -7, dtype=torch.int64, device=DEVICE)
    _token_meta_kernel[(3,)](positions.to(DEVICE), cos_sin.to(DEVICE), slots.to(DEVICE),
                             qsl.to(DEVICE), cos, sin, slot_out, cos_sin.stride(0),
                             HALF=half, BLOCK_HALF=block_half)
    for b in range(2):
        row = cos_sin[positions[b]]
        torch.testing.assert_close(cos[b, :half].cpu(), row[:half])
        torch.testing.assert_close(sin[b, :half].cpu(), row[half:])
        assert (cos[b, half:] == 0).all() and (sin[b, half:] == 0).all()   # the padded lanes
    assert slot_out.tolist()[:2] == slots.tolist()[:2]
    assert slot_out[2].item() == -1                   # padding: no slot read
    # padding: row 0 of the table (t is not read)
    torch.testing.assert_close(cos[2, :half].cpu(), cos_sin[0, :half])


@triton.jit
def _new_token_kv_kernel(qkv_ptr, own_ptr, out_ptr, stride_xt, NUM_Q_HEADS: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    kh = tl.program_id(1)
    c = tl.arange(0, BLOCK_HALF)
    has_new = tl.load(own_ptr + t * NUM_KV_HEADS + kh) != 0
    k1, k2, v1, v2 = _new_token_kv(qkv_ptr, t, kh, stride_xt, c, has_new, NUM_Q_HEADS,
                                   NUM_KV_HEADS, HALF)
    o = out_ptr + ((t * NUM_KV_HEADS + kh) * 4) * BLOCK_HALF + c[None, :]
    tl.store(o, k1)
    tl.store(o + BLOCK_HALF, k2)
    tl.store(o + 2 * BLOCK_HALF, v1)
    tl.store(o + 3 * BLOCK_HALF, v2)


def test_new_token_kv_reads_its_kv_head_only_where_it_owns_the_token():
    H, Hkv, half, block_half, T = 4, 2, 6, 8, 3
    d = 2 * half
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * Hkv) * d, generator=g)
    own = torch.tensor([[1, 0], [1, 1], [0, 1]], dtype=torch.int32)
    out = torch.full((T, Hkv, 4, block_half), 5.0, device=DEVICE)
    _new_token_kv_kernel[(T, Hkv)](qkv.to(DEVICE), own.to(DEVICE), out, qkv.stride(0),
                                   NUM_Q_HEADS=H, NUM_KV_HEADS=Hkv, HALF=half,
                                   BLOCK_HALF=block_half)
    k = qkv[:, H * d:(H + Hkv) * d].reshape(T, Hkv, d)
    v = qkv[:, (H + Hkv) * d:].reshape(T, Hkv, d)
    for t in range(T):
        for kh in range(Hkv):
            want = torch.zeros(4, block_half)
            if own[t, kh]:
                want[0, :half], want[1, :half] = k[t, kh, :half], k[t, kh, half:]
                want[2, :half], want[3, :half] = v[t, kh, :half], v[t, kh, half:]
            torch.testing.assert_close(out[t, kh].cpu(), want)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, eps, HALF: tl.constexpr,
                      BLOCK_HALF: tl.constexpr, R: tl.constexpr, USE_NORM: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, BLOCK_HALF)
    c_ok = c < HALF
    mask = c_ok[None, :]
    ptrs = x_ptr + r[:, None] * (2 * HALF) + c[None, :]                  # [R, BH]
    cos = tl.load(cos_ptr + c, mask=c_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + c, mask=c_ok, other=0.0)[None, :]
    x1, x2 = _norm_rope(tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + HALF, mask=mask,
                                                                        other=0.0),
                        w_ptr, c, c_ok, cos, sin, eps, HALF, USE_NORM, tl.float32)
    o = out_ptr + r[:, None] * (2 * HALF) + c[None, :]
    tl.store(o, x1, mask=mask)
    tl.store(o + HALF, x2, mask=mask)


@pytest.mark.parametrize("use_norm", [True, False])
def test_norm_rope_matches_torch(use_norm):
    half, R, eps = 6, 4, 1e-6
    g = torch.Generator().manual_seed(2)
    x = torch.randn(R, 2 * half, generator=g)
    w = 1 + 0.1 * torch.randn(2 * half, generator=g)
    angle = torch.rand(half, generator=g) * 3
    cos, sin = angle.cos(), angle.sin()
    out = torch.empty(R, 2 * half, device=DEVICE)
    _norm_rope_kernel[(1,)](x.to(DEVICE), w.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), out, eps,
                            HALF=half, BLOCK_HALF=8, R=R, USE_NORM=use_norm)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w if use_norm else x
    x1, x2 = y[:, :half], y[:, half:]                                    # rotate-half RoPE
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)


@triton.jit
def _key_tile_kernel(q_ptr, acc_ptr, m_ptr, l_ptr, kv_ptr, bt_ptr, qk_scale, start, kv_hi, b,
                     kh, stride_ckv, stride_cb, stride_co, stride_ch, stride_bt,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_HALF)
    c_ok = c < HALF
    rows = r[:, None] * (2 * BLOCK_HALF) + c[None, :]                   # [BM, BH], the halves
    q1, q2 = tl.load(q_ptr + rows), tl.load(q_ptr + rows + BLOCK_HALF)
    acc1, acc2 = tl.load(acc_ptr + rows), tl.load(acc_ptr + rows + BLOCK_HALF)
    m_i, l_i = tl.load(m_ptr + r), tl.load(l_ptr + r)
    k1, k2, v1, v2, n_ok = _load_key_tile(start, kv_hi, b, kv_ptr, bt_ptr, kh, c, c_ok,
                                          stride_ckv, stride_cb, stride_co, stride_ch,
                                          stride_bt, HALF, PAGE_SIZE, BLOCK_N, "")
    acc1, acc2, m_i, l_i = _attend_key_tile(acc1, acc2, m_i, l_i, q1, q2, k1, k2, v1, v2, n_ok,
                                            qk_scale, "ieee")
    tl.store(acc_ptr + rows, acc1)
    tl.store(acc_ptr + rows + BLOCK_HALF, acc2)
    tl.store(m_ptr + r, m_i)
    tl.store(l_ptr + r, l_i)


@pytest.mark.parametrize("start,kv_hi", [(0, 40), (16, 40), (32, 40), (8, 9)])
@pytest.mark.parametrize("fresh", [True, False])
def test_key_tile_matches_torch(start, kv_hi, fresh):
    """Keys [start, min(start + 16, kv_hi)) of KV head 1 through a shuffled table; slots past
    kv_hi hold NaN (a key the tile should not read would show)."""
    half, block_half, page, block_m, block_n, Hkv, b, kh = 6, 8, 8, 16, 16, 2, 1, 1
    d = 2 * half
    g = torch.Generator().manual_seed(start + kv_hi + fresh)
    pages = -(-kv_hi // page)
    bt = torch.full((2, 8), 10**6, dtype=torch.int32)                # garbage past the pages
    bt[b, :pages] = torch.randperm(12, generator=g)[:pages].to(torch.int32)
    kv = torch.full((2, 12, page, Hkv, d), float("nan"))
    for i in range(kv_hi):
        kv[:, bt[b, i // page], i % page] = torch.randn(2, Hkv, d, generator=g)
    q = torch.randn(block_m, d, generator=g)
    if fresh:
        acc, m_i, l_i = torch.zeros(block_m, d), torch.full((block_m,), -1e30), \
            torch.zeros(block_m)
    else:
        acc = torch.randn(block_m, d, generator=g)
        m_i, l_i = torch.randn(block_m, generator=g), torch.rand(block_m, generator=g) + 0.5
    qk_scale = d ** -0.5 * _LOG2E
    # torch: the tile's keys, scores in log2 units, the online-softmax update
    n = torch.arange(start, min(start + block_n, kv_hi))
    slots = bt[b, n // page].long()
    k, v = kv[0, slots, n % page, kh], kv[1, slots, n % page, kh]         # [n, d]
    s = q @ k.T * qk_scale
    m_new = torch.maximum(m_i, s.max(1).values)
    p, alpha = torch.exp2(s - m_new[:, None]), torch.exp2(m_i - m_new)
    want = (acc * alpha[:, None] + p @ v, m_new, l_i * alpha + p.sum(1))

    def halves(x):   # [BM, d] -> [BM, 2 * BH]: each half padded to BLOCK_HALF
        out = torch.zeros(x.shape[0], 2 * block_half)
        out[:, :half], out[:, block_half:block_half + half] = x[:, :half], x[:, half:]
        return out

    got = [halves(acc).to(DEVICE), m_i.clone().to(DEVICE), l_i.clone().to(DEVICE)]
    _key_tile_kernel[(1,)](halves(q).to(DEVICE), *got, kv.to(DEVICE), bt.to(DEVICE), qk_scale,
                           start, kv_hi, b, kh, *kv.stride()[:4], bt.stride(0), HALF=half,
                           BLOCK_HALF=block_half, PAGE_SIZE=page, BLOCK_M=block_m,
                           BLOCK_N=block_n)
    acc_got = got[0].cpu()
    acc_got = torch.cat([acc_got[:, :half], acc_got[:, block_half:block_half + half]], dim=-1)
    torch.testing.assert_close(acc_got, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].cpu(), want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2].cpu(), want[2], atol=1e-5, rtol=1e-5)
