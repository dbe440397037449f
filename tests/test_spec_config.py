"""SpeculativeConfig: vLLM's dict format, defaults, and a clear ValueError per bad key."""

import dataclasses
import pathlib

import pytest

from mrv2.spec_decode.config import SpeculativeConfig, check_draft_compatible

DRAFT = str(pathlib.Path(__file__).resolve().parents[1] / "mrv2" / "assets"
            / "tiny-qwen3-shakespeare")


def test_ngram_dict():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 3)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 4)
    assert cfg.verification == "exact" and cfg.sync_accepted_counts is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_speculative_tokens = 5


@pytest.mark.parametrize("given, expected", [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)),
                                             ({"prompt_lookup_min": 2}, (2, 2))])
def test_ngram_defaults_as_vllm(given, expected):
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == expected


def test_draft_model_dict_and_mrv2_keys():
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": DRAFT,
                                       "num_speculative_tokens": 5,
                                       "verification": "probabilistic",
                                       "sync_accepted_counts": True})
    assert cfg.model == DRAFT and cfg.verification == "probabilistic"
    assert cfg.sync_accepted_counts is True and cfg.prompt_lookup_max is None


def test_none_and_built_pass_through():
    assert SpeculativeConfig.from_dict(None) is None
    cfg = SpeculativeConfig("ngram", 2)
    assert SpeculativeConfig.from_dict(cfg) is cfg


@pytest.mark.parametrize("config, key", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "eagle7", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": DRAFT}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/dir"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": DRAFT,
      "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "verification": "fast"}, "verification"),
])
def test_bad_config_names_the_key(config, key):
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_dict(config)


def test_wrong_types():
    with pytest.raises(TypeError, match="must be a dict"):
        SpeculativeConfig.from_dict([("method", "ngram")])
    with pytest.raises(TypeError, match="sync_accepted_counts"):
        SpeculativeConfig("ngram", 2, sync_accepted_counts=1)
    with pytest.raises(TypeError, match="model"):
        SpeculativeConfig("draft_model", 2, model=3)


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_check_draft_compatible():
    target = {"vocab_size": 512, "eos_token_id": 2, "max_position_embeddings": 1024}
    check_draft_compatible(target, _Cfg(vocab_size=512, eos_token_id=2), max_model_len=1024)
    with pytest.raises(ValueError, match="vocab_size"):
        check_draft_compatible(target, {"vocab_size": 1000})
    with pytest.raises(ValueError, match="eos_token_id"):
        check_draft_compatible(target, {"vocab_size": 512, "eos_token_id": 7})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        check_draft_compatible(target, {"vocab_size": 512, "max_position_embeddings": 256},
                               max_model_len=1024)
