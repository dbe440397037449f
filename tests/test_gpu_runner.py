"""GPU smoke tests of the whole V2 path (LLM.generate) in bf16 with compiled kernels."""

import os
import pathlib
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from mrv2 import LLM, SamplingParams
from mrv2.models.loader import DEFAULT_MODEL_DIR


def _qwen3_config_dir():
    root = pathlib.Path(os.environ.get("MRV2_SHARED_DATA", pathlib.Path(__file__).parents[2] / "shared" / "data"))
    d = root / "qwen3-tokenizer"
    if not (d / "config.json").is_file():
        pytest.skip("Qwen3-0.6B config.json not found (set MRV2_SHARED_DATA)")
    return d


def test_embedded_model_generates_on_gpu():
    if not (pathlib.Path(DEFAULT_MODEL_DIR) / "config.json").is_file():
        pytest.skip("embedded model not trained yet")
    llm = LLM(max_num_seqs=8)
    prompts = ["ROMEO:", "JULIET:", "First Citizen:", "KING RICHARD III:"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    for o in outs:
        print(repr(o.prompt + o.outputs[0].text))
        assert len(o.outputs[0].token_ids) > 0
    # A seeded request samples the same tokens alone and inside a batch.
    sp = SamplingParams(temperature=0.8, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate(["ROMEO:"], sp, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(["JULIET:", "Nurse:", "ROMEO:"], [SamplingParams(temperature=1.0, max_tokens=20), SamplingParams(temperature=0, max_tokens=40), sp], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone


def test_qwen3_0_6b_dummy_throughput_smoke():
    llm = LLM(model=str(_qwen3_config_dir()), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=2048, max_num_seqs=256)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 150000, (128,), generator=g).tolist()}
               for _ in range(256)]
    sp = SamplingParams(temperature=0.6, max_tokens=128, ignore_eos=True, seed=0)
    llm.generate(prompts[:8], sp, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"Qwen3-0.6B shape, dummy bf16, 256 x (128 in, 128 out): {n / dt:.0f} output tok/s "
          f"({dt:.2f} s, {llm.engine.num_steps} steps)")
    assert n == 256 * 128
