"""The attention split merge in o_proj's prologue (``skinny_merge_linear_add``).

A split attention launch leaves ``SplitParts``: each split's unnormalised ``P @ V`` and its
(max, sum). The o_proj kernel merges them while it loads x, instead of a merge kernel
launch in between. Checked under the interpreter in fp32: the merge's reference against a
plain softmax (so the reference is right on its own), the kernel against the reference
and bitwise against the unfused chain (merge kernel, then ``skinny_linear_add``) up to 4
splits (from 5 the merge kernel's padded sum of 8 is reordered in numpy), empty splits
and masked rows, bad input; the decode
kernel handing back its parts; the embedded model end to end with the merge deferred or
not. bf16 at the Qwen3-0.6B shapes on the GPU.
"""

import pytest
import torch
import transformers
from test_decode_attention import CTX, _decode_batch

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2 import LLM, SamplingParams
from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import decode_attention, persistent_layer, skinny_fused
from mrv2.kernels.attention import SplitParts, merge_splits, merge_splits_ref
from mrv2.kernels.decode_attention import decode_rope_attention
from mrv2.kernels.rotary import build_cos_sin_cache
from mrv2.kernels.skinny_fused import (
    skinny_linear_add,
    skinny_merge_linear_add,
    skinny_merge_linear_add_ref,
)
from mrv2.models.loader import DEFAULT_MODEL_DIR
from mrv2.platform import DEVICE, HAS_CUDA

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _parts(M, H, S, D, seed=0, device=DEVICE, empty=True):
    """Random split parts; with ``empty`` one split of row 0 saw no keys (as a split past
    a short request's end: max -1e30, sum 0, acc 0)."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(M, H, S, D, generator=g) * 3
    ml = torch.stack([torch.randn(M, H, S, generator=g) * 4,
                      torch.rand(M, H, S, generator=g) * 5 + 0.5], -1)
    if empty and S > 1:
        ml[0, 0, S - 1] = torch.tensor([-1.0e30, 0.0])
        acc[0, 0, S - 1] = 0
    return SplitParts(acc.to(device), ml.to(device))


def _merge_kernel(parts, dtype):
    """The unfused merge: ``_merge_splits_kernel`` into a fresh ``[M, H * D]``."""
    acc, ml = parts
    M, H, _, D = acc.shape
    out = torch.empty(M, H, D, dtype=dtype, device=acc.device)
    md = AttentionMetadata(torch.arange(M + 1, dtype=torch.int32, device=acc.device),
                           torch.ones(M, dtype=torch.int32, device=acc.device),
                           torch.zeros(M, 1, dtype=torch.int32, device=acc.device),
                           torch.zeros(M, dtype=torch.long, device=acc.device), 1, 1)
    merge_splits(acc, ml, md, out, False)
    return out.view(M, H * D)


def test_merge_reference_is_the_softmax_over_all_keys():
    # Scores x (log2 units) over 37 keys cut into 4 ranges: each range's (max, sum, acc)
    # as the attention kernel keeps them; merged, they are softmax(x ln 2) @ V.
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 3, 37, generator=g) * 5, torch.randn(2, 3, 37, 8, generator=g)
    cuts = [0, 9, 10, 30, 37]
    acc, ml = [], []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        m = x[..., lo:hi].amax(-1)                                     # [2, 3]
        p = torch.exp2(x[..., lo:hi] - m[..., None])                   # [2, 3, n]
        acc.append((p[..., None] * v[:, :, lo:hi]).sum(2))             # [2, 3, 8]
        ml.append(torch.stack([m, p.sum(-1)], -1))                     # [2, 3, 2]
    parts = SplitParts(torch.stack(acc, 2), torch.stack(ml, 2))
    expect = (torch.softmax(x * torch.log(torch.tensor(2.0)), -1)[..., None] * v).sum(2)
    torch.testing.assert_close(merge_splits_ref(parts, torch.float32), expect.flatten(1),
                               **TOL)


@pytest.mark.parametrize("M,H,S,D,N,bias", [(1, 16, 4, 128, 96, False), (2, 4, 3, 16, 40, True),
                                            (1, 2, 2, 32, 17, True), (2, 3, 7, 16, 64, False),
                                            (1, 2, 8, 32, 48, True)])
def test_kernel_matches_the_reference_and_the_unfused_chain(M, H, S, D, N, bias):
    parts = _parts(M, H, S, D, seed=S)
    g = torch.Generator().manual_seed(N)
    w = (torch.randn(N, H * D, generator=g) * (H * D) ** -0.5).to(DEVICE)
    b = torch.randn(N, generator=g).to(DEVICE) if bias else None
    res = torch.randn(M, N, generator=g).to(DEVICE)
    out = res.clone()
    assert skinny_merge_linear_add(parts, w, out, b) is out              # in place
    torch.testing.assert_close(out, skinny_merge_linear_add_ref(parts, w, res.clone(), b),
                               **TOL)
    unfused = skinny_linear_add(_merge_kernel(parts, torch.float32), w, res.clone(), b)
    if S <= 4:  # NOTE: the merge kernel pads the splits to a power of two, and numpy sums
        assert torch.equal(out, unfused)  # 8 and more elements pairwise: reordered from 5
    torch.testing.assert_close(out, unfused, **TOL)


def test_launch_overrides_and_zero_rows():
    parts = _parts(2, 4, 3, 16, seed=7)
    w, res = torch.randn(24, 64, device=DEVICE) * 0.1, torch.randn(2, 24, device=DEVICE)
    ref = skinny_merge_linear_add_ref(parts, w, res.clone())
    for kw in ({"block_n": 8, "block_k": 16}, {"block_n": 16, "block_k": 32}):
        torch.testing.assert_close(skinny_merge_linear_add(parts, w, res.clone(), **kw), ref,
                                   **TOL)
    empty = SplitParts(parts.part_acc[:0], parts.part_ml[:0])
    assert skinny_merge_linear_add(empty, w, res[:0]).shape == (0, 24)


def test_bad_input_raises_before_work():
    parts = _parts(2, 4, 3, 16)
    w, res = torch.randn(24, 64, device=DEVICE), torch.zeros(2, 24, device=DEVICE)
    with pytest.raises(ValueError, match="part_ml"):
        skinny_merge_linear_add(SplitParts(parts.part_acc, parts.part_ml[..., :1]), w, res)
    with pytest.raises(ValueError, match="fp32"):
        skinny_merge_linear_add(SplitParts(parts.part_acc.double(), parts.part_ml), w, res)
    with pytest.raises(ValueError, match="H \\* D"):
        skinny_merge_linear_add(parts, w[:, :48], res)
    with pytest.raises(ValueError, match="residual"):
        skinny_merge_linear_add(parts, w, res[:, :23])
    with pytest.raises(ValueError, match="M <="):
        big = _parts(skinny_fused.MAX_M + 1, 4, 3, 16)
        skinny_merge_linear_add(big, w, torch.zeros(skinny_fused.MAX_M + 1, 24, device=DEVICE))
    assert torch.equal(res, torch.zeros_like(res))                       # nothing written


@pytest.mark.parametrize("splits,deferred", [(1, False), (3, True), (8, True), (8, False)])
def test_decode_kernel_hands_back_its_parts(splits, deferred):
    """With ``max_deferred_splits`` >= the launch's splits (> 1) the decode kernel returns
    its ``SplitParts``, whose merge is the merged output; else the merged output."""
    qkv, positions, kv, md, (qw, kw) = _decode_batch(CTX, 8, 2, 32, seed=splits)
    cos_sin = build_cos_sin_cache(32, 256, 10000.0, DEVICE)
    cfg = {"num_splits": splits, "block_n": 16}
    args = (qkv, positions, cos_sin, qw, kw, 1e-6)
    merged = decode_rope_attention(*args, kv.clone(), md, 32 ** -0.5, 8, 2, config=cfg)
    got = decode_rope_attention(*args, kv.clone(), md, 32 ** -0.5, 8, 2, config=cfg,
                                max_deferred_splits=splits if deferred else splits - 1)
    n = len(CTX)
    if deferred and splits > 1:
        assert isinstance(got, SplitParts) and got.part_acc.shape[2] == splits
        torch.testing.assert_close(merge_splits_ref(got, torch.float32)[:n],
                                   merged[:n].flatten(1), **TOL)
    else:
        assert torch.is_tensor(got) and torch.equal(got[:n], merged[:n])


def test_llm_greedy_merge_in_o_proj_on_equals_off(monkeypatch):
    """End to end, eager fp32, the embedded model: 2 prompts of ~30-40 tokens decoded
    through the fused decode path with 4-split attention (forced: the interpreter's own
    launch has one), the merge in o_proj vs the merge kernel: the same greedy tokens."""
    monkeypatch.setattr(persistent_layer, "ENABLED", False)
    monkeypatch.setattr(skinny_fused, "ENABLED", True)
    monkeypatch.setattr(decode_attention, "ENABLED", True)
    orig_pick = decode_attention.pick_config
    monkeypatch.setattr(decode_attention, "pick_config", lambda *a: {
        **orig_pick(*a), "num_splits": 4, "block_n": 16})
    calls = []
    orig = skinny_fused.skinny_merge_linear_add
    monkeypatch.setattr(skinny_fused, "skinny_merge_linear_add",
                        lambda *a, **k: calls.append(1) or orig(*a, **k))
    llm = LLM(max_model_len=96, max_num_seqs=2, dtype="float32", enforce_eager=True)
    prompts = ["ROMEO:\nBut soft, what light through yonder window breaks?",
               "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=5)
    outs = {}
    for max_splits in (0, 8):
        monkeypatch.setattr(skinny_fused, "MERGE_MAX_SPLITS", max_splits)
        outs[max_splits] = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(calls) == bool(max_splits)
    layers = transformers.AutoConfig.from_pretrained(DEFAULT_MODEL_DIR).num_hidden_layers
    assert len(calls) % layers == 0          # every layer of each deferred decode step
    assert outs[8] == outs[0]


# --------------------------------------------------------------- bf16 (GPU only)

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs the GPU")
@pytest.mark.parametrize("M,S", [(1, 4), (2, 4), (1, 8), (2, 2)])
def test_gpu_bf16_qwen3_shape_vs_merge_kernel_then_linear_add(M, S):
    """Qwen3-0.6B's o_proj (1024 x 2048, 16 heads of 128), bf16: the fused kernel against
    the merge kernel + ``skinny_linear_add`` within 2x the unfused chain's own error (an
    fp32 reference of both), PDL as the model launches it."""
    parts = _parts(M, 16, S, 128, seed=M * S, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(S)
    w = torch.randn(1024, 2048, generator=g, device="cuda", dtype=torch.bfloat16) * 0.03
    res = torch.randn(M, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    exact = res.float() + merge_splits_ref(parts, torch.float32) @ w.float().T
    fused = skinny_merge_linear_add(parts, w, res.clone())
    unfused = skinny_linear_add(_merge_kernel(parts, torch.bfloat16), w, res.clone())
    err_f = (fused.float() - exact).abs().max().item()
    err_u = (unfused.float() - exact).abs().max().item()
    print(f"M={M} S={S}: bitwise equal {torch.equal(fused, unfused)}, err {err_f:.3g} vs "
          f"{err_u:.3g}")
    assert err_f <= 2 * err_u + 1e-2
