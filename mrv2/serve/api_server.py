"""The OpenAI-compatible HTTP server (FastAPI) on ``AsyncLLM``.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (JSON, or
``stream=true``: server-sent events in OpenAI's chunk format ending with
``data: [DONE]``), ``/health`` and ``/metrics`` (Prometheus text). Every bad input is an
OpenAI-style JSON error, never a 500: a body of the wrong shape or type (pydantic) and a
value ``SamplingParams`` refuses are 400 with the field named, an unknown model is 404, a
missing or wrong key (``--api-key``) 401. A streaming client that disconnects cancels its
generator, which aborts the request before the next engine step (``async_engine.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mrv2.serve.async_engine import AsyncLLM, EngineDeadError
from mrv2.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body


class APIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _bad_input(exc: Exception) -> APIError:
    """A ``ValueError``/``TypeError`` of validation as a 400 naming its field."""
    msg = str(exc)
    m = re.search(r"SamplingParams\.(\w+)", msg) or re.match(r"(\w+)[ :]", msg)
    return APIError(400, msg, m.group(1) if m else None)


def _logprob_entries(lp_dict: dict) -> list[tuple[str, float, int | None]]:
    """``(token text, logprob, rank)`` of one position's dict, sampled token first."""
    return [(lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}",
             float(lp.logprob), lp.rank) for tid, lp in lp_dict.items()]


def _top(entries, k: int) -> list:
    return sorted(entries, key=lambda e: -e[1])[:k]


class _Choices:
    """Per choice state of one response: text, logprobs, offsets, finish reasons."""

    def __init__(self, chat: bool, num_logprobs: int | None):
        self.chat, self.k = chat, num_logprobs
        self.text: dict[int, str] = {}
        self.logprobs: dict[int, list] = {}
        self.offset: dict[int, int] = {}
        self.finish: dict[int, tuple] = {}
        self.completion_tokens = 0

    def logprobs_of(self, idx: int, comp) -> dict | None:
        """The OpenAI logprobs object of one delta (``None`` when not asked for)."""
        if comp.logprobs is None or self.k is None:
            return None
        entries = [_logprob_entries(d) for d in comp.logprobs]
        if self.chat:
            return {"content": [{
                "token": e[0][0], "logprob": e[0][1], "bytes": list(e[0][0].encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                 for t, lp, _ in _top(e, self.k)]} for e in entries]}
        offsets, off = [], self.offset.get(idx, 0)
        for e in entries:
            offsets.append(off)
            off += len(e[0][0])
        self.offset[idx] = off
        return {"tokens": [e[0][0] for e in entries], "token_logprobs": [e[0][1] for e in entries],
                "top_logprobs": [{t: lp for t, lp, _ in _top(e, self.k)} for e in entries],
                "text_offset": offsets}

    def add(self, idx: int, comp) -> dict | None:
        """Record a delta; its logprobs object."""
        self.text[idx] = self.text.get(idx, "") + comp.text
        self.completion_tokens += len(comp.token_ids)
        lp = self.logprobs_of(idx, comp)
        if lp is not None:
            key = "content" if self.chat else None
            acc = self.logprobs.setdefault(idx, {"content": []} if self.chat else
                                           {"tokens": [], "token_logprobs": [],
                                            "top_logprobs": [], "text_offset": []})
            for name in ([key] if key else acc):
                acc[name] += lp[name]
        if comp.finish_reason is not None:
            self.finish[idx] = (comp.finish_reason, comp.stop_reason)
        return lp


async def _merge(streams: list, done: set[int]):
    """``(prompt index, output)`` of several streams as they come (one stream: no tasks);
    the index of each finished stream goes into ``done``."""
    if len(streams) == 1:
        async for out in streams[0]:
            if out.finished:
                done.add(0)
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 (handed to the consumer)
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                if item.finished:
                    done.add(i)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # NOTE: cancels each stream's await: its request is aborted


def create_app(engine: AsyncLLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``.

    Args:
        engine: the running ``AsyncLLM``.
        model_name: the name clients pass as ``model`` (also ``/v1/models``).
        api_key: if set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.

    Returns:
        The app (``app.state.engine`` is ``engine``).
    """
    async def check_key(request: Request) -> None:
        # NOTE: a dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware would pass
        # every streamed chunk through one more task and memory stream.
        if api_key is not None and request.headers.get("Authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key")

    app = FastAPI(title="mrv2 OpenAI-compatible server")
    v1 = [Depends(check_key)]  # every /v1 route
    app.state.engine = engine
    from mrv2.generation_config import diff_sampling_params

    llm = engine.llm
    created = int(time.time())
    # NOTE: as vLLM's server: unset sampling fields take generation_config.json's values.
    defaults = {k: v for k, v in diff_sampling_params(llm.model_path).items()
                if k != "max_tokens"}

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errs = exc.errors()

        def where(e) -> str:  # e.g. "temperature", "messages.0.role"; "body" for bad JSON
            return ".".join(str(x) for x in e["loc"] if x != "body") if any(
                isinstance(x, str) and x != "body" for x in e["loc"]) else "body"

        msg = "; ".join(f"{where(e)}: {e['msg']}" for e in errs)
        return JSONResponse(error_body(400, msg or "invalid request body",
                                       where(errs[0]).split(".")[0] if errs else None),
                            status_code=400)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, exc: EngineDeadError):
        return JSONResponse(error_body(503, str(exc)), status_code=503)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.dead is None else 503)

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "mrv2",
            "root": str(llm.model_path), "max_model_len": llm.scheduler_config.max_model_len,
            "vocab_size": llm.hf_config.vocab_size}]}

    @app.get("/metrics")
    async def metrics():
        s, label = engine.stats(), f'{{model_name="{model_name}"}}'
        rows = [("num_requests_running", "gauge", "Requests in the running set."),
                ("num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
                ("kv_cache_usage", "gauge", "Fraction of KV cache blocks in use (0-1)."),
                ("prompt_tokens_total", "counter", "Prompt tokens of admitted requests."),
                ("generation_tokens_total", "counter", "Generated tokens."),
                ("requests_total", "counter", "Requests admitted."),
                ("steps_total", "counter", "Engine steps run.")]
        lines = []
        for name, kind, doc in rows:
            lines += [f"# HELP mrv2:{name} {doc}", f"# TYPE mrv2:{name} {kind}",
                      f"mrv2:{name}{label} {s[name]}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    async def submit(prompts: list, body) -> tuple[str, list]:
        try:
            sp = body.to_sampling_params(defaults)
        except (ValueError, TypeError) as exc:
            raise _bad_input(exc) from None
        base = uuid.uuid4().hex
        streams = []
        try:
            for i, p in enumerate(prompts):
                streams.append(await engine.add_request(f"{base}-{i}", p, sp))
        except (ValueError, TypeError) as exc:
            for j in range(len(streams)):
                await engine.abort(f"{base}-{j}")
            raise _bad_input(exc) from None
        return base, streams

    async def respond(body, prompts: list, chat: bool):
        base, streams = await submit(prompts, body)
        done: set[int] = set()  # prompts whose request finished

        async def abort_unfinished():
            # NOTE: a stream cancelled before it ever started has no finally of its own.
            # Async: Starlette runs a plain function in its thread pool, one hop a request.
            for i in range(len(streams)):
                if i not in done:
                    engine.abort_nowait(f"{base}-{i}")

        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + base
        head = {"id": rid, "object": kind + (".chunk" if body.stream else ""),
                "created": int(time.time()), "model": model_name}
        k = (body.top_logprobs or 0) if chat and body.logprobs else (None if chat else body.logprobs)
        choices, n = _Choices(chat, k), body.n
        prompt_tokens = {}
        if body.stream:
            return SSEResponse(
                _sse(head, _merge(streams, done), choices, n, chat, prompt_tokens, body),
                abort_unfinished)
        try:
            async for i, out in _merge(streams, done):
                prompt_tokens[i] = len(out.prompt_token_ids)
                for comp in out.outputs:
                    choices.add(i * n + comp.index, comp)
        finally:
            await abort_unfinished()
        result = []
        for idx in sorted(choices.text):
            reason, stop_reason = choices.finish.get(idx, (None, None))
            c = {"index": idx, "logprobs": choices.logprobs.get(idx), "finish_reason": reason,
                 "stop_reason": stop_reason}
            if chat:
                c["message"] = {"role": "assistant", "content": choices.text[idx]}
            else:
                c["text"] = choices.text[idx]
            result.append(c)
        return {**head, "choices": result, "usage": _usage(prompt_tokens, choices)}

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest):
        check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as exc:
            raise _bad_input(exc) from None
        return await respond(body, prompts, chat=False)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body.model)
        from mrv2.chat import render_conversations

        try:  # NOTE: on the engine thread: it encodes with the engine's tokenizer
            prompts = await engine.call(
                render_conversations, llm.tokenizer, body.conversation(), None,
                body.add_generation_prompt, body.continue_final_message, None,
                body.chat_template_kwargs)
        except (ValueError, TypeError) as exc:
            raise _bad_input(exc) from None
        except Exception as exc:  # noqa: BLE001 (a template error is the request's fault)
            raise APIError(400, f"chat template: {exc}", "messages") from None
        return await respond(body, [dict(prompts[0])], chat=True)

    return app


class SSEResponse(Response):
    """A server-sent events response: raw ASGI, each event one ``http.response.body``.

    NOTE: why not Starlette's ``StreamingResponse``: it runs the body and a disconnect
    listener in an anyio task group and sends an extra empty body at the end; this is the
    same behaviour with one plain asyncio task. The body runs in a task while this
    coroutine waits on ``receive()``: a client that disconnects cancels the body (its
    streams' ``finally`` aborts their requests), then ``on_close`` runs in any case.

    Every event is sent the moment it exists. NOTE: an earlier version held each event
    back until the next one came (so that the last one could end the body): every token
    then reached the client one engine step late, the first one too (TTFT + one step).
    The ``last`` event (``data: [DONE]``) ends the body itself; an iterator that stops
    without it ends the body with an empty one.

    Args:
        events: an async iterator of ``bytes``, one event each.
        on_close: awaited once the body ended or was cancelled.
        last: the event that ends a stream.
    """

    _HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"))

    def __init__(self, events, on_close, last: bytes = b"data: [DONE]\n\n"):
        # NOTE: a Response: FastAPI passes it through as is
        self.events, self.on_close, self.last = events, on_close, last
        self.background = None

    async def _body(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._HEADERS})
        ended = False
        async for event in self.events:
            ended = event == self.last
            await send({"type": "http.response.body", "body": event, "more_body": not ended})
            if ended:
                break
        if ended:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()  # NOTE: its finally blocks run now, not at garbage collection
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        body = asyncio.ensure_future(self._body(send))
        try:
            while not body.done():
                # NOTE: uvicorn's receive() returns http.disconnect once the client is gone
                # or the response is complete (its last send wakes it).
                listen = asyncio.ensure_future(receive())
                await asyncio.wait((body, listen), return_when=asyncio.FIRST_COMPLETED)
                if not listen.done():
                    listen.cancel()
                elif listen.result()["type"] == "http.disconnect":
                    break
            if not body.done():
                body.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await body
        finally:
            await self.on_close()


def _usage(prompt_tokens: dict, choices: _Choices) -> dict:
    p = sum(prompt_tokens.values())
    return {"prompt_tokens": p, "completion_tokens": choices.completion_tokens,
            "total_tokens": p + choices.completion_tokens}


async def _sse(head, merged, choices: _Choices, n: int, chat: bool, prompt_tokens, body):
    """The server-sent events of one streamed response (bytes), ``data: [DONE]`` last.

    NOTE: the chunk's fixed part (id, object, created, model; ``usage: null``) is encoded
    once: per chunk only its choice goes through ``json.dumps`` (the same bytes as dumping
    the whole chunk). A chunk carries every token that arrived since the previous one
    (``AsyncLLM`` coalesces a behind stream's steps), its logprobs one entry per token.
    """
    dumps = json.dumps
    pre = ("data: " + dumps({**head, "choices": []})[:-2]).encode()  # up to "[" of choices
    post = (', "usage": null}\n\n' if body.include_usage else "}\n\n").encode()
    started = set()
    try:
        async for i, out in merged:
            prompt_tokens[i] = len(out.prompt_token_ids)
            for comp in out.outputs:
                idx = i * n + comp.index
                lp = choices.add(idx, comp)
                if not comp.text and not comp.token_ids and comp.finish_reason is None:
                    continue
                if chat:
                    delta = {"content": comp.text}
                    if idx not in started:
                        delta["role"] = "assistant"
                    c = {"index": idx, "delta": delta}
                else:
                    c = {"index": idx, "text": comp.text}
                started.add(idx)
                c["logprobs"], c["finish_reason"], c["stop_reason"] = (
                    lp, comp.finish_reason, comp.stop_reason)
                yield pre + dumps(c).encode() + b"]" + post
        if body.include_usage:
            yield f"data: {dumps({**head, 'choices': [], 'usage': _usage(prompt_tokens, choices)})}" \
                  "\n\n".encode()
    except Exception as exc:  # noqa: BLE001 (the engine failed mid-stream: say so, then end)
        yield f"data: {dumps(error_body(500, str(exc)))}\n\n".encode()
    yield b"data: [DONE]\n\n"
