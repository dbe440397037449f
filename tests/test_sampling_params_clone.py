"""``SamplingParams.clone``: an independent copy, the same as ``copy.deepcopy``."""

from __future__ import annotations

import copy

from mrv2 import SamplingParams


def _full():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["a", "bc"],
                        stop_token_ids=[1, 2], logit_bias={4: -1.5}, allowed_token_ids=[1, 2, 4],
                        bad_words=["x y"], max_tokens=9, logprobs=2)
    sp.all_stop_token_ids = {1, 2, 7}
    sp.bad_words_token_ids = [[5, 6], [8]]
    return sp


def test_clone_equals_deepcopy_and_shares_no_container():
    sp = _full()
    c = sp.clone()
    assert c == copy.deepcopy(sp) and type(c) is SamplingParams
    for name, value in vars(sp).items():
        if isinstance(value, (list, dict, set)):
            assert vars(c)[name] is not value, name
    assert c.bad_words_token_ids[0] is not sp.bad_words_token_ids[0]


def test_changes_to_the_original_do_not_reach_the_clone():
    sp = _full()
    c = sp.clone()
    sp.stop.append("zz")
    sp.stop_token_ids.append(99)
    sp.logit_bias[5] = 2.0
    sp.allowed_token_ids.clear()
    sp.all_stop_token_ids.add(42)
    sp.bad_words_token_ids[0].append(9)
    sp.temperature = 0.1
    assert c == _full()


def test_clone_of_defaults_and_a_plain_string_stop():
    for sp in (SamplingParams(), SamplingParams(stop="END")):
        assert sp.clone() == sp and sp.clone() is not sp
