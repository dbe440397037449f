"""Issue 16: under a burst of requests the first tokens stream as soon as they exist.

At request rate inf on the H200 nearly every request got its first token only once all
256 had been admitted (TTFT p50 3.4 s). These tests pin the pieces of the online path
that held first tokens back: the SSE response kept each event until the next one came,
and the engine process read its pipe only between two steps, so the API process's event
loop blocked in ``send`` (a full pipe) while a step ran, streaming nothing meanwhile.
"""

from __future__ import annotations

import asyncio
import time

import pytest


def test_sse_response_sends_an_event_before_the_next_one_exists():
    from mrv2.serve.api_server import SSEResponse

    sent, first_out = [], asyncio.Event()

    async def events():
        yield b"data: 0\n\n"
        await first_out.wait()  # NOTE: the next event exists only once the client got this one
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    async def receive():
        await asyncio.Event().wait()  # the client stays

    async def send(msg):
        sent.append(msg)
        if msg.get("body") == b"data: 0\n\n":
            first_out.set()

    async def on_close():
        pass

    async def main():
        await asyncio.wait_for(SSEResponse(events(), on_close)({"type": "http"}, receive, send),
                               5)

    asyncio.run(main())
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 0\n\n", True), (b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]


def test_sse_response_without_the_last_event_ends_with_an_empty_body():
    from mrv2.serve.api_server import SSEResponse

    sent = []

    async def events():
        yield b"data: 0\n\n"

    async def receive():
        await asyncio.Event().wait()

    async def send(msg):
        sent.append(msg)

    async def on_close():
        sent.append("closed")

    asyncio.run(asyncio.wait_for(SSEResponse(events(), on_close)({"type": "http"}, receive,
                                                                  send), 5))
    assert [(m["body"], m["more_body"]) for m in sent[1:-1]] == [(b"data: 0\n\n", True),
                                                                 (b"", False)]
    assert sent[-1] == "closed"


def test_fake_engine_prefills_in_chunks_and_samples_when_a_prompt_completes():
    from mrv2 import SamplingParams
    from mrv2.serve.fake import FakeLLM

    llm = FakeLLM(step_ms=0, cpu_ms=0, max_num_batched_tokens=10)
    eng = llm.llm_engine
    eng.add_request("a", {"prompt_token_ids": [1] * 6}, SamplingParams(max_tokens=3))
    eng.add_request("b", {"prompt_token_ids": [1] * 12}, SamplingParams(max_tokens=3))
    got = []
    for _ in range(4):
        eng.step()
        got.append(sorted(r.request_id for r in eng.updated))
    # step 1: a's 6 + 4 of b; step 2: a decodes (1), b's last 8 (its first token);
    # then both decode; a finishes in step 3, b in step 4 (a finished one is not updated)
    assert got == [["a"], ["a", "b"], ["b"], []]
    assert [len(g[0].output_token_ids) for g in eng._groups.values()] == [3, 3]


def test_engine_process_reads_a_burst_while_a_step_runs():
    """A burst far larger than the pipe's buffer, sent just after a step began: the event
    loop goes on at once. Before, the engine read its pipe only between two steps, so the
    loop blocked in ``send`` (a full pipe) for the rest of the step: while it did, it
    admitted no request and wrote no chunk (issue 16, at 256 streams where the API
    process is the bound)."""
    from mrv2 import SamplingParams
    from mrv2.serve.async_engine import AsyncLLM
    from mrv2.serve.fake import FakeLLM

    step_s = 0.6
    engine = AsyncLLM(engine_process=True, factory=FakeLLM,
                      llm_kwargs={"step_ms": step_s * 1e3, "cpu_ms": 0})
    big = {"prompt_token_ids": [7] * 20_000}  # ~60 KB a command; 40: ~12 pipe buffers
    sp = SamplingParams(max_tokens=1)

    async def main():
        keep = await engine.add_request("keep", {"prompt_token_ids": [5, 6]},
                                        SamplingParams(max_tokens=2))
        await keep.__anext__()  # a step just ended: the next one has begun
        t0 = time.perf_counter()
        burst = [asyncio.create_task(engine.add_request(f"b{i}", big, sp)) for i in range(40)]
        await asyncio.sleep(0)  # NOTE: one loop iteration: the 40 adds are sent in it
        stall = time.perf_counter() - t0
        for s in await asyncio.gather(*burst):
            async for _ in s:
                pass
        async for _ in keep:
            pass
        return stall

    try:
        stall = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    # NOTE: before: ~the rest of the step (0.5-0.6 s); now the pickling of 40 commands
    assert stall < step_s / 2, f"the event loop stalled {stall:.2f} s (steps of {step_s} s)"


def test_serve_trace_stamps_each_request_in_order_and_summarizes(tmp_path, monkeypatch):
    import json

    from mrv2 import SamplingParams
    from mrv2.serve.async_engine import AsyncLLM
    from mrv2.serve.fake import FakeLLM
    from mrv2.serve.trace import KEYS, summarize

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MRV2_SERVE_TRACE", str(path))
    engine = AsyncLLM(FakeLLM(step_ms=5, cpu_ms=0))

    async def main():
        for i in range(3):
            async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]},
                                           SamplingParams(max_tokens=3), f"t{i}"):
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        engine.shutdown()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["request_id"] for r in rows] == ["t0", "t1", "t2"]
    for r in rows:
        assert set(r) == {"request_id", *KEYS}
        # NOTE: the reply may resume add_request before or after the first item is read
        order = ["submit", "sent", "engine_add", "engine_first", "first_item", "first_out", "end"]
        assert [r[k] for k in order] == sorted(r[k] for k in order)
        assert r["sent"] <= r["reply"] <= r["first_out"]
    text = summarize(str(path), last=2)
    assert text.startswith("2 requests") and "engine_first" in text


def test_bench_serve_summary_splits_ttft_into_connect_and_head():
    from mrv2.bench.serve import summarize

    recs = [{"start": 0.0, "connected": 0.5, "head": 1.0, "chunks": [2.0, 3.0], "end": 3.0,
             "tokens": 2, "error": None},
            {"start": 1.0, "connected": 4.0, "head": 4.5, "chunks": [5.0], "end": 5.0,
             "tokens": 1, "error": None},
            {"start": 0.0, "chunks": [1.0], "end": 1.0, "tokens": 1, "error": None}]  # no stamps
    s = summarize(recs, duration=5.0, rate=float("inf"), max_concurrency=4, prompt_tokens=6)
    assert s["connect_ms"]["mean"] == pytest.approx(1750.0)  # 0.5 s and 3 s (a SYN retried)
    assert s["head_ms"]["p50"] == pytest.approx(2250.0)      # 1 s and 3.5 s
    assert s["ttft_ms"]["mean"] == pytest.approx(7000.0 / 3)  # 2, 4 and 1 s: all three


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


def test_warm_up_fills_one_step_budget_on_the_gpu_only(monkeypatch):
    """The engine process's warm-up: nothing on the CPU; on the GPU one burst of prompts
    that fills max_num_batched_tokens (here with the platform flag forced, on the CPU)."""
    from mrv2 import LLM, platform
    from mrv2.serve.engine_core import warm_up

    llm = LLM(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=32)
    calls = []
    real = llm.generate
    monkeypatch.setattr(llm, "generate", lambda prompts, params, **kw: calls.append(
        (prompts, params)) or real(prompts, params, **kw))
    warm_up(llm)
    assert calls == []                                   # CPU: no warm-up
    monkeypatch.setattr(platform, "HAS_CUDA", True)
    warm_up(llm)
    (prompts, params), = calls
    lens = [len(p["prompt_token_ids"]) for p in prompts]
    assert lens == [30, 30] and sum(lens) >= 48          # one step's budget, max_model_len - 2
    assert params.max_tokens == 2 and params.ignore_eos
    warm_up(object())                                    # not an LLM (the fake): nothing
    assert len(calls) == 1
