"""The API process's side of the engine pipe: ``MessageReader`` batches whole messages."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
import threading

import pytest

from mrv2.serve.engine_core import MessageReader


def test_message_reader_returns_every_whole_message_in_order_then_eof():
    a, b = multiprocessing.Pipe()
    small = [("step", i, [("req", None, [(0, [i], None)], False)]) for i in range(50)]
    for m in small:  # all sent before the first read: they come back as one batch
        b.send(m)
    reader = MessageReader(a)
    assert reader.recv_batch() == small
    # a message larger than the socket's buffer arrives in pieces (the sender blocks)
    big, last = list(range(300_000)), ("end",)
    assert len(pickle.dumps(big)) > 1 << 20
    sender = threading.Thread(target=lambda: (b.send(big), b.send(last)))
    sender.start()
    got = []
    while len(got) < 2:
        got += reader.recv_batch()
    sender.join(30)
    assert got == [big, last] and reader.buf == bytearray()
    b.close()
    with pytest.raises(EOFError):
        reader.recv_batch()


def test_message_reader_long_header_and_a_frame_split_at_every_byte():
    a, b = multiprocessing.Pipe()
    body = pickle.dumps({"x": [1, 2, 3]})
    frames = (struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body  # the >2 GiB form
              + struct.pack("!i", len(body)) + body)
    reader = MessageReader(a)
    out = []
    for i in range(len(frames)):  # one byte a read: only whole messages come out
        os.write(b.fileno(), frames[i:i + 1])
        if i == len(frames) - 1 or i == 12 + len(body) - 1:
            out += reader.recv_batch()
        else:
            reader.buf += os.read(a.fileno(), 1)
            assert reader._parse() == []
    assert out == [{"x": [1, 2, 3]}] * 2


def _tokenizer():
    from pathlib import Path

    from mrv2.llm import _load_tokenizer

    return _load_tokenizer(Path(__file__).resolve().parents[1] / "mrv2" / "assets"
                           / "tiny-qwen3-shakespeare")


def test_fast_decode_gives_transformers_text_and_only_where_it_may():
    import random

    from mrv2 import SamplingParams
    from mrv2.serve.async_engine import IncrementalText, _fast_decode

    tok = _tokenizer()
    fast = _fast_decode(tok)
    assert fast is not None  # the embedded model's tokenizer takes the fast path
    rng = random.Random(0)
    seqs = [[], [0]] + [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
                        for _ in range(300)]
    for ids in seqs:
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    # streamed token by token, the text is the whole decode (the default path's answer)
    ids = tok.encode("ROMEO: O, she doth teach the torches to burn bright!")
    inc = IncrementalText(tok, SamplingParams())
    assert inc._fast is not None
    assert "".join(inc.add_ids([t], None) for t in ids) == tok.decode(ids)
    tok.clean_up_tokenization_spaces = True  # transformers would clean up: keep its decode
    try:
        assert _fast_decode(tok) is None and _fast_decode(None) is None
    finally:
        tok.clean_up_tokenization_spaces = False


def _drive(response, disconnect_after: int | None):
    """Run an ASGI response; (messages sent, whether on_close ran)."""
    import asyncio

    sent, gone = [], asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        if disconnect_after is not None and len(bodies) == disconnect_after:
            gone.set()  # the client goes away after this many events
        if not msg.get("more_body", True):
            gone.set()  # uvicorn: receive() returns http.disconnect once complete

    asyncio.run(asyncio.wait_for(response({"type": "http"}, receive, send), 10))
    return sent


def test_sse_response_sends_every_event_last_one_ends_the_body():
    from mrv2.serve.api_server import SSEResponse

    closed = []

    async def events():
        for i in range(3):
            yield b"data: %d\n\n" % i
        yield b"data: [DONE]\n\n"

    async def on_close():
        closed.append(True)

    sent = _drive(SSEResponse(events(), on_close), None)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n",
                                             b"data: [DONE]\n\n"]
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]
    assert closed == [True]


def test_sse_response_a_disconnect_cancels_the_body_then_on_close_runs():
    import asyncio

    from mrv2.serve.api_server import SSEResponse

    state = {"closed": 0, "finally": False, "made": 0}

    async def events():  # an endless stream, as one waiting for the engine's next step
        try:
            while True:
                state["made"] += 1
                yield b"data: x\n\n"
                await asyncio.sleep(0.001)
        finally:
            state["finally"] = True  # where AsyncLLM's stream queues its abort

    async def on_close():
        state["closed"] += 1

    sent = _drive(SSEResponse(events(), on_close), disconnect_after=3)
    assert state == {"closed": 1, "finally": True, "made": state["made"]}
    assert 3 <= len(sent) - 1 <= state["made"] < 10  # stopped within a few events
    assert all(m["more_body"] for m in sent[1:])  # never completed: the client is gone


def test_replies_resolve_their_futures_on_the_loop_and_skip_a_cancelled_waiter():
    import asyncio
    import threading

    from mrv2.serve.async_engine import _resolve_all

    async def main():
        loop = asyncio.get_running_loop()
        ok, bad, gone = loop.create_future(), loop.create_future(), loop.create_future()
        gone.cancel()  # its caller gave up (a client that went away)
        t = threading.Thread(target=_resolve_all, args=(
            {loop: [(ok, None), (bad, ValueError("n: bad")), (gone, None)]},))
        t.start()  # as the reader thread does
        t.join()
        assert await ok is None
        with pytest.raises(ValueError, match="n: bad"):
            await bad
        assert gone.cancelled()

    asyncio.run(main())


# -- moved from test_serve.py (no server needed) ------------------------------------------

def test_serve_help_imports_neither_torch_nor_fastapi():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "mrv2", "serve", "--help"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()}
    assert not {"torch", "fastapi", "uvicorn"} & imported
    assert "--api-key" in proc.stdout and "--max-num-seqs" in proc.stdout


def test_bench_serve_summary_of_known_records():
    from mrv2.bench.serve import summarize

    recs = [{"start": 0.0, "chunks": [1.0, 1.5, 2.5], "end": 2.5, "tokens": 3, "error": None},
            {"start": 0.0, "chunks": [], "end": 0.1, "tokens": 0, "error": "HTTP 400"}]
    s = summarize(recs, duration=5.0, rate=2.0, max_concurrency=4, prompt_tokens=10)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (1, 1, 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(1000.0)
    assert s["itl_ms"]["mean"] == pytest.approx(750.0)  # gaps of 500 and 1000 ms
    assert s["tpot_ms"]["p99"] == pytest.approx(750.0)  # (2.5 - 1.0) s / 2 tokens
    assert s["output_tok_s"] == pytest.approx(0.6) and s["total_tok_s"] == pytest.approx(2.6)
