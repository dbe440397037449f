"""A fake ``LLM`` for measuring the server alone: fixed-time steps, one random token each.

``FakeLLM`` has the shape ``EngineCore`` uses (``llm_engine`` with ``add_request`` /
``abort_request`` / ``engine.step()``, ``scheduler``, ``kv_manager``) and the embedded
model's tokenizer, so the HTTP layer, the incremental detokenizer and the engine loop do
their real work while a step costs ``cpu_ms`` of Python holding the GIL (the engine's host
work) plus a sleep to ``step_ms`` (the GPU). Serve it with

    python -m mrv2.serve.fake --port 8000 --step-ms 10 --cpu-ms 3 --engine-process on
    python -m mrv2 bench serve --base-url http://127.0.0.1:8000 --workload standard \\
        --request-rate inf --max-concurrency 256

``scripts/bench_serve_api.py`` does this with ``--cpu-ms 0`` and a short step, so the API
process is the bound, and reports its chunks/s, tokens/s and CPU per chunk. With
``--max-num-batched-tokens 8192 --prefill-ms-per-1k 4`` prompts prefill in chunks under a
step's token budget, as the real scheduler's, so a burst's TTFT spreads over steps as on a
GPU (issue 16's reproduction: ``MRV2_SERVE_TRACE``, ``mrv2/serve/trace.py``).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from types import SimpleNamespace


class _Req:
    def __init__(self, request_id: str, prompt, ids: list[int], max_tokens: int):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, ids
        self.max_tokens, self.index = max_tokens, 0
        self.num_computed_tokens = 0  # prompt tokens prefilled (with max_num_batched_tokens)
        self.prompt_logprobs = self.logprobs = self.cumulative_logprob = None
        self.num_cached_tokens = 0
        self.output_token_ids: list[int] = []
        self.finish_reason = self.stop_reason = None
        self.output_text = ""

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class _FakeEngine:
    """``LLMEngine`` and ``Engine`` in one: n=1 requests, a token per running request a step."""

    def __init__(self, llm, step_ms: float, cpu_ms: float, max_num_seqs: int,
                 max_num_batched_tokens: int | None = None, prefill_ms_per_1k: float = 0.0):
        self.llm, self.engine = llm, self
        self.step_s, self.cpu_s, self.max_num_seqs = step_ms / 1e3, cpu_ms / 1e3, max_num_seqs
        self.budget, self.prefill_s = max_num_batched_tokens, prefill_ms_per_1k / 1e6
        self._groups: dict[str, list[_Req]] = {}
        self._owner: dict[str, str] = {}
        self.updated: list[_Req] = []
        self._rng = random.Random(0)

    def add_request(self, request_id: str, prompt, params) -> None:
        if params.n != 1:
            raise ValueError("n: the fake engine serves n=1 only")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = (list(prompt["prompt_token_ids"]) if isinstance(prompt, dict)
               else self.llm.tokenizer.encode(prompt))
        req = _Req(request_id, prompt if isinstance(prompt, str) else None, ids,
                   params.max_tokens or 16)
        self._groups[request_id], self._owner[request_id] = [req], request_id
        self.llm.scheduler.waiting.append(req)

    def abort_request(self, request_id) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self.pop(rid)

    def pop(self, request_id: str) -> None:
        for req in self._groups.pop(request_id, ()):
            self._owner.pop(req.request_id, None)
        sch = self.llm.scheduler
        sch.running = [r for r in sch.running if r.request_id in self._owner]
        sch.waiting = [r for r in sch.waiting if r.request_id in self._owner]

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def _schedule(self) -> tuple[list[_Req], int]:
        """The requests that sample this step, and the prompt tokens it prefills."""
        sch = self.llm.scheduler
        while sch.waiting and len(sch.running) < self.max_num_seqs:
            sch.running.append(sch.waiting.pop(0))
        if self.budget is None:  # prefill is free: every running request samples
            return sch.running, 0
        # As the real scheduler: decodes first, then prompt chunks in what the budget leaves;
        # a request samples its first token in the step that completes its prompt.
        budget, prefilled, sampling = self.budget, 0, []
        for req in sch.running:
            left = len(req.prompt_token_ids) - req.num_computed_tokens
            if left <= 0:
                if budget > 0:
                    budget -= 1
                    sampling.append(req)
                continue
            chunk = min(left, budget)
            req.num_computed_tokens += chunk
            budget, prefilled = budget - chunk, prefilled + chunk
            if chunk == left:
                sampling.append(req)
        return sampling, prefilled

    def step(self) -> list[_Req]:
        t0 = time.perf_counter()
        sch = self.llm.scheduler
        sampling, prefilled = self._schedule()
        while time.perf_counter() - t0 < self.cpu_s:  # the host work: holds the GIL
            pass
        step_s = self.step_s + prefilled * self.prefill_s
        time.sleep(max(0.0, step_s - (time.perf_counter() - t0)))  # the GPU
        finished = []
        for req in sampling:
            req.output_token_ids.append(self._rng.randrange(self.llm.hf_config.vocab_size))
            if len(req.output_token_ids) >= req.max_tokens:
                req.finish_reason = "length"
                req.output_text = self.llm.tokenizer.decode(req.output_token_ids)
                finished.append(req)
        self.updated = [r for r in sampling if not r.is_finished]
        sch.running = [r for r in sch.running if not r.is_finished]
        return finished


def FakeLLM(step_ms: float = 10.0, cpu_ms: float = 3.0, max_num_seqs: int = 256,
            max_model_len: int = 4096, max_num_batched_tokens: int | None = None,
            prefill_ms_per_1k: float = 0.0):
    """An ``LLM``-shaped object with fixed-time steps (see the module docstring).

    Args:
        step_ms: wall time of one step.
        cpu_ms: the part of it spent in Python holding the GIL.
        max_num_seqs: requests running at once.
        max_model_len: reported to ``/v1/models``.
        max_num_batched_tokens: tokens a step computes (decodes first, then prompt chunks,
            as the real scheduler); ``None``: prompts cost nothing, every running request
            gets a token each step.
        prefill_ms_per_1k: step time added per 1000 prompt tokens prefilled in it.
    """
    from mrv2.llm import _load_tokenizer

    path = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen3-shakespeare"
    tok = _load_tokenizer(path)
    llm = SimpleNamespace(model_path=path, tokenizer=tok, device="cpu", dtype="fake",
                          hf_config=SimpleNamespace(vocab_size=len(tok)),
                          scheduler_config=SimpleNamespace(max_model_len=max_model_len),
                          scheduler=SimpleNamespace(running=[], waiting=[]),
                          kv_manager=SimpleNamespace(num_free_blocks=1, num_blocks=1))
    llm.llm_engine = _FakeEngine(llm, step_ms, cpu_ms, max_num_seqs, max_num_batched_tokens,
                                 prefill_ms_per_1k)
    return llm


def main(argv=None) -> int:
    """Serve a ``FakeLLM`` (flags: see ``--help``)."""
    import uvicorn

    from mrv2.serve.api_server import create_app
    from mrv2.serve.async_engine import AsyncLLM

    p = argparse.ArgumentParser(prog="python -m mrv2.serve.fake")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--cpu-ms", type=float, default=3.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="a step's token budget (prompts prefill in chunks); default: free")
    p.add_argument("--prefill-ms-per-1k", type=float, default=0.0,
                   help="step time added per 1000 prompt tokens prefilled")
    p.add_argument("--engine-process", choices=("on", "off"), default="on")
    a = p.parse_args(argv)
    kw = {"step_ms": a.step_ms, "cpu_ms": a.cpu_ms, "max_num_seqs": a.max_num_seqs,
          "max_num_batched_tokens": a.max_num_batched_tokens,
          "prefill_ms_per_1k": a.prefill_ms_per_1k}
    from mrv2.serve.fake import FakeLLM as factory  # NOTE: not __main__.FakeLLM (pickled)

    engine = (AsyncLLM(engine_process=True, llm_kwargs=kw, factory=factory)
              if a.engine_process == "on" else AsyncLLM(FakeLLM(**kw)))
    app = create_app(engine, "fake")
    from mrv2.serve.engine_core import freeze_heap

    freeze_heap()  # as python -m mrv2 serve does
    try:
        uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")
    finally:
        engine.shutdown()
        freeze_heap(False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
