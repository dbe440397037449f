"""Helpers of the robustness, engine-API and fuzz tests: the stories260K LLM, leak checks."""

from __future__ import annotations

import pytest
from shared_paths import SHARED_DATA

STORIES = SHARED_DATA / "stories260K" / "hf-llama"
PROMPT = {"prompt_token_ids": [1, 403, 407]}


def stories_llm(**kw):
    """``LLM`` on stories260K (vocab 512, no tokenizer), small limits; skips without the data."""
    from mrv2 import LLM

    if not STORIES.is_dir():
        pytest.skip(f"{STORIES} not present")
    args = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8}
    args.update(kw)
    return LLM(model=str(STORIES), **args)


def assert_nothing_held(llm) -> None:
    """No request, state row or KV block is held by ``llm`` (and no step in flight)."""
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert not llm.scheduler.requests and not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.runner.state.num_reqs == 0, llm.runner.state.req_ids
    assert llm.runner.state.num_free_rows == llm.runner.state.max_num_reqs
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks
    assert llm.engine._pending is None
