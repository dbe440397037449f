"""BlockTables: staged block-id writes, the per-step gather, slot mappings."""

import random

import pytest
import torch

from mrv2.block_table import BlockTables
from mrv2.kernels.block_table import compute_slot_mappings_ref, gather_block_tables_ref
from mrv2.platform import DEVICE


def _assert_matches_model(bt: BlockTables, model: dict[int, list[int]]) -> None:
    for row, ids in model.items():
        assert bt.num_blocks[row] == len(ids)
        assert bt.block_table[row, :len(ids)].tolist() == ids


def test_append_overwrite_and_one_launch_apply():
    bt = BlockTables(4, 6, 4, 32, DEVICE)
    bt.append_block_ids(0, [3, 4], overwrite=True)
    bt.append_block_ids(0, [5], overwrite=False)          # same step: extends the run
    bt.append_block_ids(2, [9, 9, 9], overwrite=True)
    bt.append_block_ids(2, [1], overwrite=True)           # overwrite drops the staged run
    bt.append_block_ids(3, [], overwrite=False)           # nothing to write
    assert sorted(bt._staged) == [0, 2]
    bt.apply_staged_writes()
    assert not bt.has_staged_writes
    _assert_matches_model(bt, {0: [3, 4, 5], 2: [1], 3: []})
    bt.append_block_ids(0, [6, 7, 8], overwrite=False)    # fills the row exactly
    bt.append_block_ids(2, [2], overwrite=False)
    bt.apply_staged_writes()
    _assert_matches_model(bt, {0: [3, 4, 5, 6, 7, 8], 2: [1, 2]})
    with pytest.raises(ValueError, match="max_num_blocks_per_req"):
        bt.append_block_ids(0, [1], overwrite=False)
    with pytest.raises(ValueError, match="row 4"):
        bt.append_block_ids(4, [1], overwrite=True)
    bt.clear_row(0)
    assert bt.num_blocks[0] == 0


def test_random_ops_match_python_model():
    rng = random.Random(0)
    R, C = 6, 10
    bt = BlockTables(R, C, 16, 64, DEVICE)
    model: dict[int, list[int]] = {}
    for step in range(30):
        for _ in range(rng.randint(0, 5)):
            row = rng.randrange(R)
            ids = [rng.randrange(1000) for _ in range(rng.randint(0, 4))]
            overwrite = row not in model or rng.random() < 0.2
            base = [] if overwrite else model[row]
            if len(base) + len(ids) > C:
                with pytest.raises(ValueError):
                    bt.append_block_ids(row, ids, overwrite)
                continue
            bt.append_block_ids(row, ids, overwrite)
            model[row] = base + ids
        if rng.random() < 0.3 and model:                  # a request finishes
            row = rng.choice(sorted(model))
            bt.clear_row(row)
            model.pop(row)
        bt.apply_staged_writes()
        _assert_matches_model(bt, model)


@pytest.mark.parametrize("num_reqs,num_reqs_padded", [(0, 0), (0, 3), (1, 1), (5, 8), (8, 8)])
def test_gather_matches_reference(num_reqs, num_reqs_padded):
    g = torch.Generator().manual_seed(num_reqs * 10 + num_reqs_padded)
    R, C = 8, 7
    bt = BlockTables(R, C, 4, 16, DEVICE)
    bt.block_table.copy_(torch.randint(0, 1000, (R, C), generator=g, dtype=torch.int32))
    bt.input_block_table.fill_(-7)                         # stale contents from a past step
    idx_mapping = torch.randperm(R, generator=g)[:num_reqs_padded].to(torch.int32)
    idx_mapping[num_reqs:] = 12345                         # don't-care: never read
    idx_mapping = idx_mapping.to(DEVICE)
    out = bt.gather_block_tables(idx_mapping, num_reqs)
    assert out.shape == (num_reqs_padded, C)
    # A view of the static buffer.
    assert out.untyped_storage().data_ptr() == bt.input_block_table.untyped_storage().data_ptr()
    torch.testing.assert_close(out, gather_block_tables_ref(idx_mapping, num_reqs,
                                                            bt.block_table))
    assert (out[num_reqs:] == 0).all()
    with pytest.raises(ValueError, match="num_reqs"):
        bt.gather_block_tables(idx_mapping, num_reqs_padded + 1)


def _random_batch(g, R, C, block_size, num_reqs, max_query):
    """idx_mapping, query_start_loc and positions of a random mixed batch."""
    rows = torch.randperm(R, generator=g)[:num_reqs]
    lens = torch.randint(1, min(max_query, C * block_size) + 1, (num_reqs,), generator=g)
    # Computed prefix so that the query still fits in C blocks.
    computed = [int(torch.randint(0, C * block_size - int(n) + 1, (1,), generator=g))
                for n in lens]
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int64)
    qsl[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(c, c + int(n)) for c, n in zip(computed, lens)]
                          ) if num_reqs else torch.zeros(0, dtype=torch.int64)
    return rows.to(torch.int32), qsl.to(torch.int32), positions.to(torch.int32)


@pytest.mark.parametrize("seed,num_reqs,pad_reqs,pad_tokens,block_size",
                         [(0, 0, 0, 0, 4), (1, 0, 2, 5, 4), (2, 1, 0, 0, 16),
                          (3, 6, 2, 7, 4), (4, 8, 0, 3, 1), (5, 7, 1, 0, 8)])
def test_slot_mappings_match_reference(seed, num_reqs, pad_reqs, pad_tokens, block_size):
    g = torch.Generator().manual_seed(seed)
    R, C = 8, 6
    bt = BlockTables(R, C, block_size, 128, DEVICE)
    bt.block_table.copy_(torch.randint(0, 500, (R, C), generator=g, dtype=torch.int32))
    idx, qsl, positions = _random_batch(g, R, C, block_size, num_reqs, max_query=9)
    num_tokens = positions.numel()
    # Padding slots (query length 0) and padding tokens with garbage contents.
    idx = torch.cat([idx, torch.full((pad_reqs,), 999, dtype=torch.int32)])
    qsl = torch.cat([qsl, qsl[-1:].expand(pad_reqs)])
    positions = torch.cat([positions, torch.full((pad_tokens,), 777, dtype=torch.int32)])
    T = num_tokens + pad_tokens
    idx, qsl, positions = idx.to(DEVICE), qsl.to(DEVICE), positions.to(DEVICE)
    out = bt.compute_slot_mappings(idx, qsl, positions, num_reqs, T)
    ref = compute_slot_mappings_ref(idx, qsl, positions, num_reqs, T, bt.block_table,
                                    block_size)
    assert out.dtype == torch.int64 and out.shape == (T,)
    torch.testing.assert_close(out.cpu(), ref)
    assert (out[num_tokens:] == -1).all()


def test_slot_mapping_block_boundary():
    bt = BlockTables(2, 3, 4, 8, DEVICE)
    bt.append_block_ids(1, [10, 20, 30], overwrite=True)
    bt.apply_staged_writes()
    idx = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([3, 4, 7, 8], dtype=torch.int32, device=DEVICE)   # last of block 0 .. first of 2
    out = bt.compute_slot_mappings(idx, qsl, positions, 1, 5)
    assert out.tolist() == [43, 80, 83, 120, -1]
