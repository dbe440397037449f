"""The online path: ``AsyncLLM`` without HTTP, then the OpenAI server driven by ``openai``.

One embedded-model ``LLM`` for the module. Its greedy references are computed with
``LLM.generate`` before ``AsyncLLM`` takes the engine over; the server runs in a uvicorn
thread on a free 127.0.0.1 port, so a test can inspect the engine (on the engine thread,
through ``AsyncLLM.call_sync``) while clients stream.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from mrv2 import LLM, SamplingParams
from mrv2.chat import render_conversations
from mrv2.serve.api_server import create_app
from mrv2.serve.async_engine import AsyncLLM, IncrementalText, _Delta

MODEL = "tiny"
PROMPT, LONG_PROMPT = "ROMEO:", "JULIET:"
CHAT = [{"role": "user", "content": "Speak, good sir."}]
GREEDY = {"temperature": 0, "max_tokens": 8}
STOP = {"temperature": 0, "max_tokens": 12, "stop": ["!"]}  # greedy: "\nO, I am a king!"
LONG = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def _held(llm) -> dict:
    """What the engine holds (call on the engine thread)."""
    return {"groups": len(llm.llm_engine._groups), "running": len(llm.scheduler.running),
            "waiting": len(llm.scheduler.waiting), "rows": llm.runner.state.num_reqs,
            "free_blocks": llm.kv_manager.num_free_blocks - llm.kv_manager.num_blocks,
            "pending": llm.engine._pending is not None}


IDLE = {"groups": 0, "running": 0, "waiting": 0, "rows": 0, "free_blocks": 0, "pending": False}


def _wait_idle(engine: AsyncLLM, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        held = engine.call_sync(_held, engine.llm, timeout=timeout)
        if held == IDLE or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served():
    llm = LLM(max_model_len=256, max_num_seqs=40)

    chat = render_conversations(llm.tokenizer, CHAT)[0]
    # NOTE: one batch for every reference (greedy fp32 output does not depend on the batch).
    outs = llm.generate([PROMPT, PROMPT, LONG_PROMPT, chat],
                        [SamplingParams(**kw) for kw in (GREEDY, STOP, LONG, GREEDY)],
                        use_tqdm=False)
    refs = dict(zip(("greedy", "stop", "long", "chat"), outs))
    engine = AsyncLLM(llm)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, MODEL), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    base = f"http://127.0.0.1:{port}/v1"
    yield {"llm": llm, "engine": engine, "refs": refs, "base": base,
           "client": openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)}
    server.should_exit = True
    thread.join(10)
    engine.shutdown()


# -- AsyncLLM without HTTP -----------------------------------------------------------------


async def _collect(engine, prompt, params, rid):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    texts, ids = {}, {}
    for o in outs:
        for c in o.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(c.token_ids)
    return outs, texts, ids


def test_async_engine_deltas_add_up_to_llm_generate(served):
    engine, ref = served["engine"], served["refs"]
    outs, texts, ids = asyncio.run(_collect(engine, PROMPT, SamplingParams(**GREEDY), "a0"))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert len(outs) > 1 and all(len(c.token_ids) >= 1 for o in outs for c in o.outputs)
    assert ids[0] == ref["greedy"].outputs[0].token_ids
    assert texts[0] == ref["greedy"].outputs[0].text
    assert outs[-1].outputs[0].finish_reason == "length"
    # a stop string: held back while streaming, cut at the end, as LLM.generate cuts it
    _, texts, _ = asyncio.run(_collect(engine, PROMPT, SamplingParams(**STOP), "a1"))
    assert texts[0] == ref["stop"].outputs[0].text and "!" not in texts[0]

    async def slow_consumer():  # several steps wait in the queue: they arrive as one output
        outs = []
        async for o in engine.generate(PROMPT, SamplingParams(**GREEDY), "a2"):
            outs.append(o)
            await asyncio.sleep(1.0 if len(outs) == 1 else 0)
        return outs

    outs = asyncio.run(slow_consumer())
    assert len(outs) < GREEDY["max_tokens"] and outs[-1].finished
    assert "".join(o.outputs[0].text for o in outs) == ref["greedy"].outputs[0].text
    assert [t for o in outs for t in o.outputs[0].token_ids] == ref["greedy"].outputs[0].token_ids
    assert _wait_idle(engine) == IDLE


def test_async_engine_bad_request_fails_only_its_caller(served):
    engine = served["engine"]

    async def main():
        good = asyncio.ensure_future(_collect(engine, PROMPT, SamplingParams(**GREEDY), "b0"))
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate("x " * 400, SamplingParams(), "b1"):
                pass
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("b0", PROMPT, SamplingParams())
        return await good

    _, texts, _ = asyncio.run(main())
    assert texts[0] == served["refs"]["greedy"].outputs[0].text
    assert _wait_idle(engine) == IDLE


def test_async_engine_close_aborts_and_n_streams_by_index(served):
    engine = served["engine"]

    async def main():
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), "c0")
        first = await stream.__anext__()
        await stream.aclose()  # the client is gone: the request is aborted
        _, _, ids = await _collect(engine, PROMPT, SamplingParams(
            n=2, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True), "c1")
        return first, ids

    first, ids = asyncio.run(main())
    assert not first.finished
    assert sorted(ids) == [0, 1] and all(len(v) == 6 for v in ids.values())
    assert _wait_idle(engine) == IDLE


def test_incremental_text_holds_back_a_stop_string_prefix(served):
    tok = served["llm"].tokenizer
    ids = tok.encode("ab, cd")
    assert tok.decode(ids) == "ab, cd"
    inc = IncrementalText(tok, SamplingParams(stop=["d!"]))
    sent = "".join(inc.add(_Delta(0, [t], None, None, None, None, None)) for t in ids)
    assert sent == "ab, c"  # the last character could start "d!": held back
    # the next token completes "d!": the engine cuts it; nothing sent must be taken back
    assert sent + inc.add(_Delta(0, [], None, "stop", "d!", "ab, c", None)) == "ab, c"
    plain = IncrementalText(tok, SamplingParams())
    assert "".join(plain.add(_Delta(0, [t], None, None, None, None, None)) for t in ids) == (
        "ab, cd")


def test_unset_sampling_fields_take_the_generation_config_defaults():
    from mrv2.serve.protocol import ChatCompletionRequest, CompletionRequest

    qwen3 = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}  # Qwen3's generation_config.json
    sp = CompletionRequest(prompt="x", temperature=0.2, top_k=0).to_sampling_params(qwen3)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens) == (0.2, 0, 0.95, 16)
    sp = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                               max_completion_tokens=5, logprobs=True,
                               top_logprobs=3).to_sampling_params(qwen3)
    assert (sp.temperature, sp.top_k, sp.max_tokens, sp.logprobs) == (0.6, 20, 5, 3)
    assert CompletionRequest(prompt="x").to_sampling_params().temperature == 1.0


# -- the HTTP server -----------------------------------------------------------------------


def _parallel(*calls):
    """Run the calls at once (one engine batch instead of several: CPU time)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _stream_text(chunks, chat=False):
    parts = {}
    for ch in chunks:
        for c in ch.choices:
            parts[c.index] = parts.get(c.index, "") + ((c.delta.content or "") if chat
                                                        else c.text)
    return parts


def test_completions_streamed_equals_non_streamed_equals_generate(served):
    client, ref = served["client"], served["refs"]

    def full(kw):
        return lambda: client.completions.create(model=MODEL, prompt=PROMPT, **kw)

    def streamed(kw):
        return lambda: list(client.completions.create(
            model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True},
            **kw))

    results = _parallel(full(GREEDY), streamed(GREEDY), full(STOP), streamed(STOP))
    for kind, (full, chunks) in (("greedy", results[:2]), ("stop", results[2:])):
        expect = ref[kind].outputs[0]
        assert full.choices[0].text == _stream_text(chunks)[0] == expect.text
        assert full.choices[0].finish_reason == chunks[-2].choices[0].finish_reason == (
            expect.finish_reason)
        usage = {"prompt_tokens": len(ref[kind].prompt_token_ids),
                 "completion_tokens": len(expect.token_ids)}
        for u in (full.usage, chunks[-1].usage):
            assert (u.prompt_tokens, u.completion_tokens) == tuple(usage.values())
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_equals_non_streamed_equals_llm_chat(served):
    client, expect = served["client"], served["refs"]["chat"]
    full, chunks = _parallel(
        lambda: client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY),
        lambda: list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                    **GREEDY)))
    assert full.choices[0].message.content == _stream_text(chunks, chat=True)[0]
    assert full.choices[0].message.content == expect.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert full.usage.prompt_tokens == len(expect.prompt_token_ids)


def test_n_seed_logprobs_and_token_prompts(served):
    client, llm = served["client"], served["llm"]
    kw = {"n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 5, "logprobs": 2}
    ids = llm.tokenizer.encode(PROMPT)
    full, chunks, chat = _parallel(
        lambda: client.completions.create(model=MODEL, prompt=ids, **kw),
        lambda: list(client.completions.create(model=MODEL, prompt=ids, stream=True, **kw)),
        lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                               temperature=0, logprobs=True, top_logprobs=2))
    streamed = _stream_text(chunks)
    assert [c.index for c in full.choices] == [0, 1]
    assert [c.text for c in full.choices] == [streamed[0], streamed[1]]  # seeded: the same
    for c in full.choices:
        assert len(c.logprobs.tokens) == 5 and all(len(t) <= 3 for t in c.logprobs.top_logprobs)
    assert full.usage.completion_tokens == 10
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_a_stream_behind_the_engine_gets_fewer_chunks_carrying_every_token(served):
    """Coalescing: steps that queued while the server's event loop was busy leave as one
    chunk; its text and logprobs (one entry per token) add up to the non-streamed answer."""
    client, engine = served["client"], served["engine"]
    kw = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "logprobs": 2,
          "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw)
    chunks = iter(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    got = [next(chunks)]
    (loop, _), = engine._streams.values()  # the server's event loop (the stream is open)
    loop.call_soon_threadsafe(time.sleep, 1.5)  # it falls behind; the engine thread steps on
    got += list(chunks)
    content = [c.choices[0] for c in got if c.choices]
    per_chunk = [len(c.logprobs.tokens) for c in content]
    assert sum(per_chunk) == got[-1].usage.completion_tokens == 12
    assert len(content) < 12 and max(per_chunk) >= 2  # some chunk carries several tokens
    ref = full.choices[0]
    assert "".join(c.text for c in content) == ref.text
    lps = {k: [x for c in content for x in getattr(c.logprobs, k)]
           for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert lps["tokens"] == ref.logprobs.tokens and lps["text_offset"] == ref.logprobs.text_offset
    assert lps["token_logprobs"] == pytest.approx(ref.logprobs.token_logprobs, abs=1e-5)
    assert [list(t) for t in lps["top_logprobs"]] == [list(t) for t in ref.logprobs.top_logprobs]
    assert content[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in content[:-1])


def test_a_list_of_prompts_gives_choices_in_prompt_order(served):
    client, ref = served["client"], served["refs"]
    kw = {"model": MODEL, "prompt": [PROMPT, LONG_PROMPT], "max_tokens": 3, "temperature": 0,
          "n": 2, "stream_options": {"include_usage": True}}
    kw_full = {k: v for k, v in kw.items() if k != "stream_options"}
    full, chunks = _parallel(lambda: client.completions.create(**kw_full),
                             lambda: list(client.completions.create(stream=True, **kw)))
    texts = [c.text for c in full.choices]
    assert [c.index for c in full.choices] == [0, 1, 2, 3]  # prompt i, completion j: 2 i + j
    assert texts == [_stream_text(chunks)[i] for i in range(4)]
    assert texts[0] == texts[1] and ref["greedy"].outputs[0].text.startswith(texts[0])
    assert texts[2] == texts[3] and ref["long"].outputs[0].text.startswith(texts[2])
    n_prompt = len(ref["greedy"].prompt_token_ids) + len(ref["long"].prompt_token_ids)
    for u in (full.usage, chunks[-1].usage):
        assert (u.prompt_tokens, u.completion_tokens) == (n_prompt, 12)


@pytest.mark.parametrize("bad, field", [({"temperature": -1}, "temperature"),
                                        ({"top_p": 2}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                                        ({"n": 0}, "n"), ({"extra_body": {"top_k": "x"}}, "top_k"),
                                        ({"prompt": "x " * 300}, "max_model_len")])
def test_bad_parameters_are_400_naming_the_field(served, bad, field):
    args = {"model": MODEL, "prompt": PROMPT, **bad}
    with pytest.raises(openai.BadRequestError) as info:
        served["client"].completions.create(**args)
    assert info.value.status_code == 400 and field in info.value.message
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served["client"].chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)


BAD_BODIES = [
    ("completions", "not json", "body"), ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, -5]}, "prompt_token_ids"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("completions", {"prompt": "x", "seed": 10**30}, "seed"),
    ("completions", {"prompt": "x", "echo": True}, "echo"),
    ("completions", {"prompt": "x", "logprobs": 10**6}, "logprobs"),
    ("completions", {}, "prompt"), ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "image_url")]


@pytest.mark.parametrize("route, body, field", BAD_BODIES)
def test_bad_bodies_are_400_never_500(served, route, body, field):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    resp = httpx.post(f"{served['base']}/{route}", headers={"Content-Type": "application/json"},
                      timeout=30, **kw)
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["code"] == 400 and err["type"] == "BadRequestError"
    assert field in err["message"]


def test_unknown_model_404_api_key_401_health_metrics_models(served):
    client, engine = served["client"], served["engine"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt=PROMPT)
    from starlette.testclient import TestClient

    keyed = TestClient(create_app(engine, MODEL, api_key="secret"))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    bad = keyed.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
    ok = keyed.post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200 and keyed.get("/health").status_code == 200
    root = served["base"].removesuffix("/v1")
    assert httpx.get(root + "/health").status_code == 200
    metrics = httpx.get(root + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f"mrv2:{name}{{" in metrics
    assert [m.id for m in client.models.list()] == [MODEL]


def test_disconnect_mid_stream_frees_its_request_while_another_finishes(served):
    client, engine, expect = served["client"], served["engine"], served["refs"]["long"]
    before = engine.stats()["generation_tokens_total"]
    other = {}

    def run_other():
        chunks = client.completions.create(model=MODEL, prompt=LONG_PROMPT, stream=True,
                                           temperature=0, max_tokens=12,
                                           extra_body={"ignore_eos": True})
        other["text"] = _stream_text(chunks)[0]

    quitter = client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                        max_tokens=200, extra_body={"ignore_eos": True})
    t = threading.Thread(target=run_other)
    t.start()
    it = iter(quitter)
    for _ in range(3):
        next(it)
    quitter.close()  # the client disconnects mid-stream
    t.join(60)
    assert other["text"] == expect.outputs[0].text  # the other stream is untouched
    assert _wait_idle(engine) == IDLE  # rows and KV blocks of the quitter are free
    assert engine.stats()["generation_tokens_total"] - before < 200  # it was cut short


def test_32_concurrent_streaming_clients_all_complete(served):
    aclient = openai.AsyncOpenAI(base_url=served["base"], api_key="none", max_retries=0,
                                 timeout=60)

    async def one(i):
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, stream=True, temperature=0.8,
            seed=i, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens, chunks[-2].choices[0].finish_reason

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 90)

    start = time.monotonic()
    results = asyncio.run(main())
    assert results == [(8, "length")] * 32
    assert time.monotonic() - start < 90
    assert _wait_idle(served["engine"]) == IDLE


# -- bench serve ---------------------------------------------------------------------------


@pytest.mark.parametrize("procs", [1, 2])
def test_bench_serve_streams_a_rate_against_the_server(served, procs):
    from mrv2.bench.serve import run_rate

    ids = served["llm"].tokenizer.encode(PROMPT)
    root = served["base"].removesuffix("/v1")
    row = asyncio.run(run_rate(root, MODEL, [ids] * 3, [3, 3, 3], rate=50.0,
                               max_concurrency=2, client_procs=procs))
    assert (row["completed"], row["failed"], row["output_tokens"]) == (3, 0, 9)
    assert row["ttft_ms"]["p50"] > 0 and row["tpot_ms"]["p50"] > 0


# -- the engine in its own process (engine_core.py) ----------------------------------------


def _sse_text(lines) -> tuple[str, list[str]]:
    """The text of SSE completion chunks and the error messages among them."""
    import json

    text, errors = "", []
    for line in lines:
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"]["message"])
            text += "".join(c["text"] for c in chunk.get("choices", []))
    return text, errors


def test_engine_process_serves_the_same_text_and_a_dead_process_fails_fast(served):
    import os
    import signal

    from starlette.testclient import TestClient

    from mrv2.serve.async_engine import EngineDeadError

    ref = served["refs"]
    with pytest.raises(ValueError, match="max_num_seqs"):  # the process's LLM error, here
        AsyncLLM(engine_process=True, llm_kwargs={"max_num_seqs": 0})
    engine = AsyncLLM(engine_process=True, llm_kwargs={"max_model_len": 256, "max_num_seqs": 8})
    try:
        client = TestClient(create_app(engine, MODEL))
        body = {"model": MODEL, "prompt": PROMPT, **GREEDY}
        full = client.post("/v1/completions", json=body).json()
        assert full["choices"][0]["text"] == ref["greedy"].outputs[0].text
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert _sse_text(r.iter_lines()) == (ref["greedy"].outputs[0].text, [])
        chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                         **GREEDY}).json()
        assert chat["choices"][0]["message"]["content"] == ref["chat"].outputs[0].text
        bad = client.post("/v1/completions", json={**body, "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        assert "mrv2:generation_tokens_total{" in client.get("/metrics").text
        assert engine.stats()["generation_tokens_total"] == 3 * GREEDY["max_tokens"]
        # the process dies mid-stream: the stream ends with an error at once, then 503s
        t0 = time.monotonic()
        with client.stream("POST", "/v1/completions",
                           json={**body, **LONG, "max_tokens": 200, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            os.kill(engine._proc.pid, signal.SIGKILL)
            _, errors = _sse_text([first, *lines])
        assert errors and "engine process died" in errors[0] and time.monotonic() - t0 < 20
        assert client.get("/health").status_code == 503
        dead = client.post("/v1/completions", json=body)
        assert dead.status_code == 503 and "engine process died" in dead.json()["error"]["message"]
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(engine, PROMPT, SamplingParams(), "p0"))
    finally:
        engine.shutdown()
