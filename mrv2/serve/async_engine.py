"""``AsyncLLM``: the online engine: one thread owns and steps ``LLMEngine``, asyncio streams out.

The design, and why it is the simplest correct one:

* **One engine thread.** ``LLMEngine.step()`` is blocking work (scheduling, the launch of
  step N+1, the wait for step N's output event), so it cannot run inside the event loop
  without freezing every HTTP connection. A single daemon thread owns the ``LLMEngine``:
  nothing else ever touches the scheduler, the runner or the KV pool, so no lock guards
  them. While requests exist it steps the engine; when none are left it sleeps on a
  condition variable.
* **Commands in.** The event loop never calls the engine: ``generate`` / ``abort`` /
  ``call`` append a command to a deque and notify the thread, which runs all queued
  commands *between two steps* (an add's ``ValueError``/``TypeError`` travels back to its
  own caller through a ``concurrent.futures.Future``; nobody else sees it).
* **Deltas out.** After each step the thread takes, for every request that got tokens,
  only the *new* tokens (and logprobs, and the finish reason) and hands them to that
  request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. Text is detokenized
  incrementally on the consumer's side (``IncrementalText``), off the engine thread.

``generate`` yields **delta** ``RequestOutput``s (vLLM's ``RequestOutputKind.DELTA``):
each ``CompletionOutput`` holds only what is new since the previous output (``text``,
``token_ids``, ``logprobs``), and only the completions that changed appear (``index``
says which); the last output of a completion carries its ``finish_reason``, and the
last output of the request has ``finished=True``. Closing or cancelling the iterator
(a client disconnect) queues an abort that runs before the next step, freeing the
request's state rows and KV blocks. This is the online counterpart of the runner's
one-step-ahead loop (notebooks/07_async_streams, notebooks/12_serving).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mrv2.outputs import CompletionOutput, RequestOutput
from mrv2.sampling_params import SamplingParams


@dataclass
class _Delta:
    """What one completion got in one step (built on the engine thread)."""

    index: int
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None
    final_text: str | None          # the engine's text once finished (stop strings cut)
    cumulative_logprob: float | None

    def then(self, later: _Delta) -> _Delta:
        """This delta followed by ``later`` (of the same completion), as one."""
        return _Delta(self.index, self.token_ids + later.token_ids,
                      None if self.logprobs is None else self.logprobs + later.logprobs,
                      later.finish_reason, later.stop_reason, later.final_text,
                      later.cumulative_logprob)


#: Tokens an incomplete UTF-8 character may hold back before its text is sent as it is.
_MAX_PENDING = 8


def _deliver(items) -> None:
    """On the event loop: hand each request's step output to its queue."""
    for queue, item in items:
        queue.put_nowait(item)


class IncrementalText:
    """Streamed text of one completion: decode a small window of tokens per step.

    vLLM's incremental detokenizer: the text of ``ids[prefix:]`` minus the text of
    ``ids[prefix:read]`` is new, unless it ends in an incomplete UTF-8 character. With stop
    strings, the last ``len(longest stop) - 1`` characters are held back until the end (a
    stop string is cut from the final text, and what was sent cannot be taken back).
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer, self.params = tokenizer, params
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""     # decoded so far
        self.sent = 0      # characters of self.text handed out
        stops = [] if params.include_stop_str_in_output else params.stop
        self.hold = max((len(s) for s in stops), default=1) - 1

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, d: _Delta) -> str:
        """The new text of ``d`` (everything left once the completion finished)."""
        if self.tokenizer is None or not self.params.detokenize:
            return ""
        if d.final_text is not None:  # the engine's text is the truth at the end
            self.text = d.final_text
            new, self.sent = self.text[self.sent:], len(self.text)
            return new
        self.ids += d.token_ids
        window = self._decode(self.ids[self.prefix:])
        before = self._decode(self.ids[self.prefix:self.read])
        # NOTE: random tokens (dummy weights) may never complete a UTF-8 character: after
        # _MAX_PENDING tokens the window is taken as it is, so it cannot grow without bound.
        pending = len(self.ids) - self.read
        if len(window) > len(before) and (not window.endswith("\ufffd")
                                          or pending > _MAX_PENDING):
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        upto = max(self.sent, len(self.text) - self.hold)
        new, self.sent = self.text[self.sent:upto], upto
        return new


class AsyncLLM:
    """Streams ``RequestOutput`` deltas of an ``LLM`` to asyncio code.

    Args:
        llm: an ``mrv2.LLM``; its ``llm_engine`` is owned by this object's thread from now
            on (do not call ``llm.generate`` while it runs).
        trace: if set, called on the engine thread after every step with
            ``(step_index, running_request_ids, waiting_request_ids)`` (notebook 12).
    """

    def __init__(self, llm, trace: Callable[[int, list[str], list[str]], None] | None = None):
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.tokenizer
        self.trace = trace
        self._cmds: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._sent: dict[str, int] = {}  # child request id -> tokens handed out
        self._stopped = False
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self._thread = threading.Thread(target=self._loop, name="mrv2-engine", daemon=True)
        self._thread.start()

    # -- the asyncio side ----------------------------------------------------------

    def _post(self, *cmd) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the engine loop is stopped")
            self._cmds.append((fut, *cmd))
            self._cv.notify()
        return fut

    async def call(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the engine thread between two steps; its result (or error).

        Everything that touches the engine or encodes with its tokenizer goes through here
        (e.g. rendering a chat template), so one thread does it all.
        """
        return await asyncio.wrap_future(self._post("call", fn, args))

    def call_sync(self, fn: Callable, *args, timeout: float | None = None):
        """``call`` from a plain thread (tests, notebooks): blocks until ``fn`` ran."""
        return self._post("call", fn, args).result(timeout)

    async def add_request(self, request_id: str, prompt,
                          params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Validate and queue one request; its stream of delta ``RequestOutput``s.

        NOTE: a stream that is never iterated does not abort its request: call ``abort``.

        Raises:
            ValueError, TypeError: a bad prompt or bad params (nothing was queued).
        """
        params = SamplingParams() if params is None else params
        queue: asyncio.Queue = asyncio.Queue()
        await asyncio.wrap_future(self._post("add", request_id, prompt, params,
                                             asyncio.get_running_loop(), queue))
        return self._stream(request_id, params, queue)

    async def generate(self, prompt, params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Submit one request and stream its delta ``RequestOutput``s.

        Args:
            prompt: a string, or a dict with ``prompt_token_ids`` (and optionally ``prompt``).
            params: its ``SamplingParams`` (``None``: the defaults).
            request_id: a unique id (its ``n`` completions share it).

        Yields:
            Deltas, the last one with ``finished=True``.

        Raises:
            ValueError, TypeError: a bad prompt or bad params (nothing was queued).
        """
        async for out in await self.add_request(request_id, prompt, params):
            yield out

    async def _stream(self, request_id: str, params: SamplingParams,
                      queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        texts: dict[int, IncrementalText] = {}
        first, finished = True, False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():  # NOTE: a consumer behind by k steps sends one output
                    items.append(queue.get_nowait())
                merged: dict[int, _Delta] = {}
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True  # the engine already dropped it
                        raise item
                    req, deltas, finished = item
                    for d in deltas:
                        merged[d.index] = merged[d.index].then(d) if d.index in merged else d
                outs = []
                for d in merged.values():  # NOTE: one incremental decode per completion
                    text = texts.setdefault(d.index, IncrementalText(self.tokenizer, params))
                    outs.append(CompletionOutput(
                        index=d.index, text=text.add(d), token_ids=d.token_ids,
                        cumulative_logprob=d.cumulative_logprob, logprobs=d.logprobs,
                        finish_reason=d.finish_reason, stop_reason=d.stop_reason))
                yield RequestOutput(request_id=request_id, prompt=req.prompt,
                                    prompt_token_ids=req.prompt_token_ids,
                                    prompt_logprobs=req.prompt_logprobs if first else None,
                                    outputs=outs, finished=finished,
                                    num_cached_tokens=max(req.num_cached_tokens, 0))
                first = False
        finally:
            if not finished:  # closed or cancelled early (client gone): free it now
                self.abort_nowait(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its rows and blocks are free."""
        await asyncio.wrap_future(self._post("abort", request_id))

    def abort_nowait(self, request_id: str) -> None:
        """Queue an abort (it runs before the next step); unknown ids are ignored."""
        with contextlib.suppress(RuntimeError):  # the loop is stopped: nothing to free
            self._post("abort", request_id)

    def stats(self) -> dict:
        """Counters for ``/metrics`` (read without a lock: each value is one atomic read)."""
        sch, kv = self.llm.scheduler, self.llm.kv_manager
        return {"num_requests_running": len(sch.running), "num_requests_waiting": len(sch.waiting),
                "kv_cache_usage": 1.0 - kv.num_free_blocks / kv.num_blocks,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "requests_total": self.requests_total, "steps_total": self.num_steps}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (requests in flight get an error) and join the thread."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._cmds or self._stopped or self.engine.has_unfinished_requests()):
                    self._cv.wait()
                cmds, self._cmds = list(self._cmds), collections.deque()
                stopped = self._stopped
            for cmd in cmds:
                self._run(*cmd)
            if stopped:
                self._fail_all(RuntimeError("the engine loop was shut down"))
                return
            if self.engine.has_unfinished_requests():
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 (the whole step failed: tell everyone)
                    self._fail_all(RuntimeError(f"engine step failed: {exc!r}"))

    def _run(self, fut, kind, *args) -> None:
        try:
            if kind == "add":
                request_id, prompt, params, loop, queue = args
                self.engine.add_request(request_id, prompt, params)
                self._streams[request_id] = (loop, queue)
                group = self.engine._groups[request_id]
                self.prompt_tokens_total += len(group[0].prompt_token_ids)
                self.requests_total += 1
                result = None
            elif kind == "abort":
                request_id, = args
                self._streams.pop(request_id, None)
                for req in self.engine._groups.get(request_id, ()):
                    self._sent.pop(req.request_id, None)
                self.engine.abort_request(request_id)
                result = None
            else:
                fn, fn_args = args
                result = fn(*fn_args)
        except BaseException as exc:  # noqa: BLE001 (the caller's error, handed to the caller)
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _step(self) -> None:
        eng = self.engine
        finished = eng.engine.step()
        self.num_steps += 1
        touched: dict[str, dict] = {}   # request id -> {child id: child}, in step order
        for req in list(eng.engine.updated) + finished:
            rid = eng._owner.get(req.request_id)
            if rid is not None:
                touched.setdefault(rid, {})[req.request_id] = req
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, children in touched.items():
            group = eng._groups[rid]
            deltas = [self._delta(r) for r in children.values()]
            done = all(r.is_finished for r in group)
            stream = self._streams.get(rid)
            if stream is not None:
                loop, queue = stream
                deliveries.setdefault(loop, []).append((queue, (group[0], deltas, done)))
            if done:
                self._streams.pop(rid, None)
                eng.pop(rid)
        for loop, items in deliveries.items():
            # NOTE: one wake-up of each event loop per step, not one per request.
            with contextlib.suppress(RuntimeError):  # that event loop is closed
                loop.call_soon_threadsafe(_deliver, items)
        if self.trace is not None:
            sch = self.llm.scheduler
            self.trace(self.num_steps - 1, [r.request_id for r in sch.running],
                       [r.request_id for r in sch.waiting])

    def _delta(self, r) -> _Delta:
        start = self._sent.get(r.request_id, 0)
        ids = r.output_token_ids[start:]
        self.generation_tokens_total += len(ids)
        if r.is_finished:
            self._sent.pop(r.request_id, None)
        else:
            self._sent[r.request_id] = len(r.output_token_ids)
        return _Delta(index=r.index, token_ids=ids,
                      logprobs=None if r.logprobs is None else r.logprobs[start:],
                      finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                      final_text=r.output_text if r.is_finished else None,
                      cumulative_logprob=r.cumulative_logprob)

    def _fail_all(self, exc: BaseException) -> None:
        ids = list(self._streams)
        for rid in ids:
            loop, queue = self._streams.pop(rid)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, exc)
        self._sent.clear()
        self.engine.abort_request(list(self.engine._groups))
