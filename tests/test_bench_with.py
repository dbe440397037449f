"""scripts/bench_with.py: module knobs set by hand before the mrv2 CLI runs (in-model
experiments). The parser, the checks that keep a typo from measuring nothing, and the
decode-launch override on the real ``pick_config``."""

import pytest
from script_loader import load_script

from mrv2.kernels import attention, decode_attention


@pytest.fixture(scope="module")
def bw():
    return load_script("bench_with")


def test_parse_set(bw):
    assert bw.parse_set('mrv2.kernels.pdl:X={"a": [1, 2]}') == ("mrv2.kernels.pdl", "X",
                                                                {"a": [1, 2]})
    for bad in ("mrv2.kernels.pdl:X", "mrv2.kernels.pdl=1", ":X=1", "m:=1"):
        with pytest.raises(ValueError, match="MODULE:ATTR=JSON"):
            bw.parse_set(bad)
    with pytest.raises(ValueError, match="not JSON"):
        bw.parse_set("mrv2.kernels.pdl:X=true,")


def test_apply_set_needs_an_existing_attribute(bw, monkeypatch):
    monkeypatch.setattr(decode_attention, "MAX_TOKENS", decode_attention.MAX_TOKENS)
    bw.apply_set("mrv2.kernels.decode_attention:MAX_TOKENS=7")
    assert decode_attention.MAX_TOKENS == 7
    with pytest.raises(ValueError, match="no attribute 'MAX_TOKEN'"):
        bw.apply_set("mrv2.kernels.decode_attention:MAX_TOKEN=7")


def test_decode_launch_override_only_in_its_range(bw, monkeypatch):
    monkeypatch.setattr(decode_attention, "pick_config", decode_attention.pick_config)
    before = {n: decode_attention.pick_config(n, 8, 2, 1, 256) for n in (2, 3, 32, 33)}
    bw.override_decode_launch({"lo": 3, "hi": 32, "num_splits": 8, "block_n": 64,
                               "num_warps": 2})
    for n, cfg in before.items():
        got = decode_attention.pick_config(n, 8, 2, 1, 256)
        if 3 <= n <= 32:  # 256 keys are 4 tiles of 64: the splits capped at 4
            assert got == {**cfg, "num_splits": 4, "block_n": 64, "num_warps": 2}
        else:
            assert got == cfg
    with pytest.raises(ValueError, match="block_n"):
        bw.override_decode_launch({"lo": 1, "hi": 2, "num_splits": 2})


def test_paged_launch_override_only_decode_launches_in_its_range(bw, monkeypatch):
    monkeypatch.setattr(attention, "_pick_config", attention._pick_config)
    args = [(n, 8, 2, q, 160) for n in (32, 33, 256) for q in (1, 4)]
    before = {a: attention._pick_config(*a) for a in args}
    bw.override_paged_launch({"lo": 33, "hi": 512, "block_n": 32, "num_warps": 4})
    for a, cfg in before.items():
        got = attention._pick_config(*a)
        if a[0] >= 33 and a[3] == 1:
            assert got == {**cfg, "block_n": 32, "num_warps": 4}
        else:
            assert got == cfg                                  # prefills, small batches
    for bad in ({"lo": 1, "block_n": 32}, {"lo": 1, "hi": 2}, {"lo": 1, "hi": 2, "bn": 3}):
        with pytest.raises(ValueError, match="--paged-launch needs"):
            bw.override_paged_launch(bad)


def test_main_needs_the_command_after_a_double_dash(bw, capsys):
    assert bw.main(["--set", "a:b=1"]) == 2
    assert "after --" in capsys.readouterr().err
    assert bw.main(["--set", "mrv2.kernels.decode_attention:NOPE=1", "--", "bench"]) == 2
    assert "no attribute" in capsys.readouterr().err
