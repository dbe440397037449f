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


def test_warm_up_is_a_burst_that_chunks_prefills_on_the_gpu_only(monkeypatch):
    """The engine process's warm-up: nothing on the CPU; on the GPU one burst (here with the
    platform flag forced, on the CPU) whose prompts of spread lengths overflow one step's
    token budget, so prefills split across steps and run beside decodes, and whose output
    lengths are staggered, so the decode batch shrinks through its sizes."""
    from mrv2 import LLM, platform
    from mrv2.serve.engine_core import warm_up

    llm = LLM(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=64)
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
    assert len(lens) == 4 and len(set(lens)) > 1          # spread lengths
    assert max(lens) <= 64 - 17 and sum(lens) > 48        # more than one step's budget
    assert [p.max_tokens for p in params] == [1, 2, 3, 4] and all(p.ignore_eos for p in params)
    warm_up(object())                                    # not an LLM (the fake): nothing
    assert len(calls) == 1


def test_engine_loop_reports_the_steps_that_compiled(tmp_path, monkeypatch, capsys):
    """The engine process's loop counts Triton compiles per step (Triton's cache-miss hook):
    a step that compiled is named on stderr and, when tracing, in ``<trace>.steps.jsonl``,
    which ``mrv2.serve.trace`` lists. A stand-in core calls the hook as a compile would."""
    import json
    import threading
    from multiprocessing import Pipe
    from types import SimpleNamespace

    knobs = pytest.importorskip("triton").knobs
    from mrv2.serve import engine_core
    from mrv2.serve.trace import summarize

    class Core:
        num_steps, left = 0, 3

        def has_work(self):
            return self.left > 0

        def step(self):
            self.num_steps += 1
            self.left -= 1
            if self.num_steps == 2:  # what Triton does on a kernel variant's first launch
                knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name="_paged_attention_kernel"))
            return []

        def stats(self):
            return {}

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MRV2_SERVE_TRACE", str(trace))
    ours, theirs = Pipe()
    thread = threading.Thread(target=engine_core._serve, args=(theirs, Core()), daemon=True)
    thread.start()
    for _ in range(3):
        assert ours.poll(10)
        ours.recv()
    ours.send(("stop",))
    thread.join(10)
    assert not thread.is_alive()
    assert knobs.runtime.jit_cache_hook is None                  # the hook is put back
    err = capsys.readouterr().err
    assert "engine step 2: 1 Triton kernel variant(s) compiled" in err
    assert "_paged_attention_kernel" in err and "engine step 1" not in err
    from pathlib import Path

    (step,) = [json.loads(line) for line in Path(f"{trace}.steps.jsonl").read_text().splitlines()]
    assert step["step"] == 2 and step["compiled"] == ["_paged_attention_kernel"]
    trace.write_text(json.dumps({"request_id": "r", "submit": step["end"] - 0.5,
                                 "end": step["end"] + 0.1}) + "\n")
    text = summarize(str(trace))
    assert "engine steps that compiled Triton kernels in this window: 1" in text
    assert "step 2 ended 500 ms" in text
