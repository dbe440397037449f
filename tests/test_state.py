"""RequestStateTable: stable rows, free list, staged writes applied in one kernel."""

import random

import numpy as np
import pytest
import torch

from mrv2.kernels.state_writes import FLOAT_PARAMS, apply_state_writes_ref
from mrv2.platform import DEVICE
from mrv2.state import SAMPLING_DEFAULTS, RequestStateTable


def _random_sampling(rng: random.Random) -> dict:
    keys = rng.sample(sorted(SAMPLING_DEFAULTS), rng.randint(0, len(SAMPLING_DEFAULTS)))
    values = {"temperature": rng.uniform(0, 2), "top_k": rng.randint(-1, 50),
              "top_p": rng.uniform(0.1, 1), "min_p": rng.uniform(0, 0.5),
              "seed": rng.randint(-2**63, 2**63 - 1), "repetition_penalty": rng.uniform(1, 2),
              "presence_penalty": rng.uniform(-1, 1), "frequency_penalty": rng.uniform(-1, 1)}
    return {k: values[k] for k in keys}


def _expected_row(sampling: dict) -> tuple[int, list[float], int]:
    p = {**SAMPLING_DEFAULTS, **sampling}
    return int(p["top_k"]), [float(p[n]) for n in FLOAT_PARAMS], int(p["seed"])


def _assert_row(table: RequestStateTable, row: int, ids: list[int], prompt_len: int,
                sampling: dict) -> None:
    top_k, floats, seed = _expected_row(sampling)
    assert table.token_ids[row, :len(ids)].tolist() == ids
    assert table.prompt_len[row] == prompt_len
    assert table.prefill_len[row] == len(ids) and table.total_len[row] == len(ids)
    assert table.num_computed_tokens[row] == 0 and table.last_sampled_token[row] == -1
    assert table.top_k[row] == top_k and table.seed[row] == seed
    torch.testing.assert_close(table.float_params[:, row].cpu(), torch.tensor(floats))


def test_kernel_matches_reference():
    rng = random.Random(0)
    table = RequestStateTable(6, 40, DEVICE)
    staged = []
    for i in range(5):
        n = rng.choice([1, 17, 40, rng.randint(1, 40)])
        ids = [rng.randrange(1000) for _ in range(n)]
        sampling, plen = _random_sampling(rng), rng.randint(1, n)
        row = table.add_request(f"r{i}", ids, plen, sampling)
        top_k, floats, seed = _expected_row(sampling)
        staged.append((row, ids, plen, top_k, floats, seed))
    table.apply_staged_writes()
    assert not table.has_staged_writes

    ref = RequestStateTable(6, 40, DEVICE)  # fresh tensors, same initial contents
    names = ("token_ids", "prompt_len", "prefill_len", "total_len", "num_computed_tokens",
             "last_sampled_token", "top_k", "float_params", "seed")
    apply_state_writes_ref(staged, *(getattr(ref, n) for n in names))
    for n in names:
        torch.testing.assert_close(getattr(table, n), getattr(ref, n), msg=n)
    # The named float views alias float_params.
    torch.testing.assert_close(table.temperature, table.float_params[0])
    torch.testing.assert_close(table.frequency_penalty, table.float_params[5])


def test_defaults_and_boundaries():
    table = RequestStateTable(2, 8, DEVICE)
    assert table.temperature.tolist() == [1.0, 1.0] and table.top_k.tolist() == [-1, -1]
    full = list(range(8))                                 # exactly max_model_len tokens
    a = table.add_request("a", full, 3, {"seed": None, "temperature": 0.0})
    b = table.add_request("b", [7], 1)                    # one token
    assert (a, b) == (0, 1) and table.num_free_rows == 0 and table.num_reqs == 2
    table.apply_staged_writes()
    _assert_row(table, a, full, 3, {"temperature": 0.0})
    _assert_row(table, b, [7], 1, {})
    before = {n: getattr(table, n).clone() for n in ("token_ids", "total_len", "seed")}
    table.apply_staged_writes()                           # nothing staged: a no-op
    for n, t in before.items():
        assert torch.equal(getattr(table, n), t)
    assert table.req_ids == ["a", "b"]


def test_errors_name_the_problem():
    table = RequestStateTable(2, 8, DEVICE)
    table.add_request("a", [1, 2], 2)
    with pytest.raises(ValueError, match="already"):
        table.add_request("a", [1], 1)
    with pytest.raises(ValueError, match="max_model_len"):
        table.add_request("b", list(range(9)), 9)
    with pytest.raises(ValueError, match="max_model_len"):
        table.add_request("b", [], 1)
    with pytest.raises(ValueError, match="prompt_len"):
        table.add_request("b", [1, 2], 3)
    with pytest.raises(ValueError, match="token id"):
        table.add_request("b", [1, -2], 2)
    with pytest.raises(ValueError, match="temprature"):
        table.add_request("b", [1], 1, {"temprature": 0.5})
    assert table.num_free_rows == 1                       # failed adds took no row
    table.add_request("b", [1], 1)
    with pytest.raises(RuntimeError, match="full"):
        table.add_request("c", [1], 1)
    with pytest.raises(KeyError, match="'zz'"):
        table.remove_request("zz")


def test_add_then_remove_before_apply_writes_nothing():
    table = RequestStateTable(3, 8, DEVICE)
    row = table.add_request("a", [5, 5, 5], 3)
    assert table.remove_request("a") == row
    assert not table.has_staged_writes
    assert table.add_request("b", [9], 1) == row          # the freed row comes back first
    table.apply_staged_writes()
    _assert_row(table, row, [9], 1, {})
    assert table.token_ids[row, 1:].tolist() == [0] * 7  # "a" was never written


@pytest.mark.parametrize("seed", [0, 1])
def test_random_add_finish_preempt_sequences(seed):
    """Rows never change owner while live, freed rows are reused, and the device
    table equals a pure-Python model after every step's single apply."""
    rng = random.Random(seed)
    R, L = 5, 24
    table = RequestStateTable(R, L, DEVICE)
    model: dict[str, tuple[int, list[int], int, dict]] = {}   # req -> (row, ids, plen, s)
    rows_ever_used: set[int] = set()
    next_id = 0
    for step in range(25):
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.5 and table.num_free_rows:              # add
                n = rng.randint(1, L)
                ids, sampling = [rng.randrange(50_000) for _ in range(n)], _random_sampling(rng)
                req, next_id = f"req{next_id}", next_id + 1
                plen = rng.randint(1, n)
                row = table.add_request(req, ids, plen, sampling)
                assert table.req_ids[row] == req and row not in {m[0] for m in model.values()}
                model[req] = (row, ids, plen, sampling)
                rows_ever_used.add(row)
            elif op < 0.8 and model:                          # finish
                req = rng.choice(sorted(model))
                assert table.remove_request(req) == model.pop(req)[0]
            elif model:                                       # preempt: re-add as new
                req = rng.choice(sorted(model))
                row, ids, plen, sampling = model.pop(req)
                table.remove_request(req)
                ids = (ids + [rng.randrange(50_000) for _ in range(3)])[:L]
                new_row = table.add_request(req, ids, plen, sampling)
                assert new_row == row                         # LIFO: its own row again
                model[req] = (new_row, ids, plen, sampling)
        table.apply_staged_writes()
        assert table.num_free_rows == R - len(model)
        for req, (row, ids, plen, sampling) in model.items():
            assert table.row_of(req) == row
            _assert_row(table, row, ids, plen, sampling)
        assert [r for r in table.req_ids if r is not None] == sorted(
            model, key=lambda q: model[q][0])
    assert rows_ever_used <= set(range(R)) and next_id > R    # more requests than rows


def test_packed_rows_layout():
    """Headers first, payloads back to back; meta and tail are views of the one buffer."""
    from mrv2.state import packed_rows

    packed, meta, tail, starts = packed_rows(2, [2, 0, 3])
    assert packed.dtype == np.int32 and packed.shape == (3 * 2 + 5,)
    assert meta.shape == (3, 2) and tail.shape == (5,)
    assert starts.tolist() == [0, 2, 2]
    meta[:] = [[7, 0], [8, 2], [9, 2]]
    tail[:] = [1, 2, 3, 4, 5]
    assert packed.tolist() == [7, 0, 8, 2, 9, 2, 1, 2, 3, 4, 5]
    packed, meta, tail, starts = packed_rows(4, [])
    assert packed.size == meta.size == tail.size == starts.size == 0


def test_num_computed_tokens_carried_by_the_staged_write():
    """A prefix-cache hit starts the device row at its length: kernel == reference; a
    start that leaves no token to compute is refused before anything is staged."""
    table, ref = RequestStateTable(3, 16, DEVICE), RequestStateTable(3, 16, DEVICE)
    staged = []
    for i, (n, computed) in enumerate([(16, 15), (9, 8), (5, 0)]):   # 15 = max_model_len - 1
        ids = list(range(100 + i, 100 + i + n))
        row = table.add_request(f"r{i}", ids, n, num_computed_tokens=computed)
        top_k, floats, seed = _expected_row({})
        staged.append((row, ids, n, top_k, floats, seed, computed))
    table.apply_staged_writes()
    names = ("token_ids", "prompt_len", "prefill_len", "total_len", "num_computed_tokens",
             "last_sampled_token", "top_k", "float_params", "seed")
    apply_state_writes_ref(staged, *(getattr(ref, n) for n in names))
    for n in names:
        torch.testing.assert_close(getattr(table, n), getattr(ref, n), msg=n)
    assert table.num_computed_tokens.tolist() == [15, 8, 0]
    fresh = RequestStateTable(2, 16, DEVICE)
    for bad in (4, -1):
        with pytest.raises(ValueError, match="num_computed_tokens"):
            fresh.add_request("x", [1, 2, 3, 4], 4, num_computed_tokens=bad)
    assert fresh.num_reqs == 0 and not fresh.has_staged_writes
