"""The rest of vLLM's offline API: prompt types, generate's keywords, metrics, request ids,
stop-token text, default sampling params, truncation, and the CPU defaults."""

import json
import shutil

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.cpu_defaults import DEFAULT_CPU_KV_BYTES, choose_num_threads, cpu_kv_budget_bytes
from mrv2.generation_config import diff_sampling_params
from mrv2.inputs import TextPrompt, TokensPrompt, normalize_prompts
from mrv2.models.loader import DEFAULT_MODEL_DIR

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, max_num_seqs=4)


def test_prompt_types_are_typed_dicts(llm):
    ids = llm.tokenizer.encode("ROMEO:")
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="ROMEO:")], GREEDY,
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert TokensPrompt(prompt_token_ids=[1]) == {"prompt_token_ids": [1]}
    assert normalize_prompts(None, prompt_token_ids=[[1, 2]]) == [{"prompt_token_ids": [1, 2]}]
    with pytest.raises(TypeError, match="prompt 1"):
        normalize_prompts(["a", 5])
    with pytest.raises(ValueError, match="multi_modal_data"):
        normalize_prompts([{"prompt": "a", "multi_modal_data": {"image": 1}}])


def test_lora_request_and_priority(llm):
    out = llm.generate(["ROMEO:", "JULIET:"], GREEDY, use_tqdm=False, lora_request=None,
                       priority=[0, 0])
    assert len(out) == 2
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.generate("ROMEO:", GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="priority"):
        llm.generate("ROMEO:", GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, lora_request=1)
    assert not llm.engine.has_unfinished()


def test_request_ids_are_contiguous_with_n(llm):
    sp = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(["ROMEO:", "JULIET:", "Nurse:"], sp, use_tqdm=False)
    ids = [int(o.request_id) for o in outs]
    assert ids == list(range(ids[0], ids[0] + 3))
    assert all([c.index for c in o.outputs] == [0, 1] for o in outs)
    nxt = llm.generate("ROMEO:", GREEDY, use_tqdm=False)[0]
    assert int(nxt.request_id) == ids[-1] + 1


def test_metrics_are_ordered(llm):
    outs = llm.generate(["ROMEO:", "JULIET:"], SamplingParams(n=2, max_tokens=4, seed=1,
                                                               ignore_eos=True), use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
        assert m.num_generation_tokens == 8 and m.first_token_latency >= 0


def test_stop_token_text_is_dropped_unless_included(llm):
    base = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[4]
    first = base.index(stop_id)
    tok = llm.tokenizer
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_id]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == base[:first + 1] and c.stop_reason == stop_id
    assert c.text == tok.decode(base[:first])  # the stop token's text is not in `text`
    keep = llm.generate("ROMEO:", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert keep.text == tok.decode(base[:first + 1])
    length = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert length.text == tok.decode(base[:3])  # a length stop keeps its last token's text


def test_truncate_prompt_tokens(llm):
    ids = llm.tokenizer.encode("First Citizen:\nBefore we proceed any further, hear me speak.")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=5), use_tqdm=False)[0]
    ref = llm.generate({"prompt_token_ids": ids[-5:]}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids[:4]
    full = llm.generate({"prompt_token_ids": [5] * 300}, SamplingParams(
        max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(full.prompt_token_ids) == 127  # -1: max_model_len - 1 (room for one token)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_default_sampling_params_from_generation_config(tmp_path, llm):
    assert llm.get_default_sampling_params() == SamplingParams()  # the embedded model sets none
    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    cfg.update(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=7, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(cfg))
    assert diff_sampling_params(model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                           "max_tokens": 7}
    other = LLM(str(model), max_model_len=64, max_num_seqs=2)
    sp = other.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.6, 0.95, 20, 7)
    out = other.generate("ROMEO:", use_tqdm=False)[0]  # no sampling_params: the model's defaults
    assert len(out.outputs[0].token_ids) <= 7
    assert diff_sampling_params(tmp_path) == {}


def test_cpu_thread_choice():
    assert choose_num_threads(3_700_000, num_cores=16) == 1
    assert choose_num_threads(600_000_000, num_cores=16) == 16
    assert choose_num_threads(100_000_000, num_cores=16) == 4


def test_cpu_kv_budget(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert cpu_kv_budget_bytes(None, 4096, 1024) == DEFAULT_CPU_KV_BYTES
    assert cpu_kv_budget_bytes(None, 10 << 20, 64) == 640 << 20  # one full sequence at least
    assert cpu_kv_budget_bytes(1 << 20, 4096, 1024) == 1 << 20
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    assert cpu_kv_budget_bytes(None, 4096, 1024) == 1 << 29
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        cpu_kv_budget_bytes(None, 4096, 1024)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU defaults")
def test_llm_cpu_defaults(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MRV2_CPU_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    try:
        default = LLM()  # 256 x 1,024 tokens would be 1 GiB; the budget is 128 MiB
        per_token = default._kv_bytes_per_block() // default.cache_config.block_size
        assert default.kv_manager.num_blocks * default._kv_bytes_per_block() <= DEFAULT_CPU_KV_BYTES
        assert default.kv_manager.num_blocks * 16 == DEFAULT_CPU_KV_BYTES // per_token
        assert torch.get_num_threads() == 1  # a 3.7 M-parameter model: one thread
        monkeypatch.setenv("MRV2_CPU_NUM_THREADS", "2")
        small = LLM(max_model_len=64, max_num_seqs=2, kv_cache_memory_bytes=64 * per_token)
        assert small.kv_manager.num_blocks == 4 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(max_model_len=64, kv_cache_memory_bytes=0)
