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
* **Or a process** (``engine_process=True``, what ``python -m mrv2 serve`` uses on CUDA):
  the same stepping (``engine_core.EngineCore``) runs in a spawned process, commands go
  down a pipe and each step comes back as one message, read by a reader thread here. The
  HTTP layer's per-chunk Python then no longer takes the GIL from the engine loop. A
  dead process fails every request with ``EngineDeadError`` (the server: 503) at once.

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

from mrv2.outputs import CompletionOutput, RequestOutput
from mrv2.sampling_params import SamplingParams
from mrv2.serve.detokenizer import IncrementalText, _fast_decode  # noqa: F401 (re-exported)
from mrv2.serve.engine_core import EngineCore, _Delta  # noqa: F401 (re-exported)


def _deliver(items) -> None:
    """On the event loop: hand each request's step output to its queue."""
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(replies) -> None:
    """On the event loop: each ``(asyncio future, exception or None)``; a cancelled
    waiter (its caller gave up) is skipped."""
    for fut, exc in replies:
        if not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)


def _resolve_all(results: dict) -> None:
    """``_resolve`` each event loop's replies there: one wake-up of each loop."""
    for loop, replies in results.items():
        with contextlib.suppress(RuntimeError):  # that event loop is closed
            loop.call_soon_threadsafe(_resolve, replies)


def _then(a: tuple, b: tuple) -> tuple:
    """Delta tuple ``a`` (``_Delta``'s fields) followed by ``b`` of the same completion."""
    return (a[0], a[1] + b[1], None if a[2] is None else a[2] + b[2], *b[3:])


class EngineDeadError(RuntimeError):
    """The engine loop (thread or process) is gone: requests fail with this (HTTP 503)."""


class AsyncLLM:
    """Streams ``RequestOutput`` deltas of an ``LLM`` to asyncio code.

    Args:
        llm: an ``mrv2.LLM`` stepped by a thread of this process; its ``llm_engine`` is owned
            by that thread from now on (do not call ``llm.generate`` while it runs).
            ``None`` with ``engine_process=True``.
        trace: if set, called on the engine thread after every step with
            ``(step_index, running_request_ids, waiting_request_ids)`` (notebook 12; thread
            mode only).
        engine_process: build the ``LLM`` in a spawned process (``engine_core.py``) from
            ``llm_kwargs``, so the engine loop does not share this process's GIL with the
            HTTP layer; ``self.llm`` is then a light description of the model (path,
            tokenizer, sizes).
        llm_kwargs: ``LLM`` arguments (process mode).
        factory: what the process calls with ``llm_kwargs`` (default ``mrv2.LLM``; a
            module-level callable: it is pickled by reference).
        startup_timeout: seconds the process may take to load the model.

    Raises:
        ValueError, TypeError: from ``LLM(**llm_kwargs)`` in the process (process mode).
        EngineDeadError: the process died or timed out while starting.
    """

    def __init__(self, llm=None, trace: Callable[[int, list[str], list[str]], None] | None = None,
                 *, engine_process: bool = False, llm_kwargs: dict | None = None,
                 factory: Callable | None = None, startup_timeout: float = 900.0):
        from mrv2.serve.trace import RequestTrace

        self.trace = trace
        self._times = RequestTrace.from_env()  # MRV2_SERVE_TRACE: per-request stamps
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: str | None = None   # why the engine is gone (None: it runs)
        self._lock = threading.Lock()
        self.engine_process = engine_process
        if engine_process:
            if llm is not None or trace is not None:
                raise ValueError("engine_process=True builds its own LLM from llm_kwargs: pass "
                                 "neither llm nor trace")
            self._start_process(factory, dict(llm_kwargs or {}), startup_timeout)
            return
        if llm is None:
            raise ValueError("llm: an mrv2.LLM is needed (or engine_process=True)")
        self.llm, self.engine, self.tokenizer = llm, llm.llm_engine, llm.tokenizer
        self.core = EngineCore(llm, trace=self._times is not None)
        self._cmds: collections.deque = collections.deque()
        self._cv = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name="mrv2-engine", daemon=True)
        self._thread.start()

    @property
    def num_steps(self) -> int:
        return self.stats()["steps_total"]

    @property
    def dead(self) -> str | None:
        """Why the engine is gone (``None`` while it runs)."""
        return self._dead

    # -- the asyncio side ----------------------------------------------------------

    def _post(self, *cmd, wait: bool = True):
        """Queue a command for the engine; what to wait on for its result.

        Returns:
            Thread mode: a ``concurrent.futures.Future``. Process mode: an asyncio future
            of the running loop (``None`` with ``wait=False``: nobody waits, the reply is
            dropped). NOTE: not a ``concurrent.futures.Future`` there: the reader thread
            resolves a wake's replies with one ``call_soon_threadsafe`` per loop, and no
            cross-thread future lock is taken per request.
        """
        if self.engine_process:
            loop = asyncio.get_running_loop() if wait else None
            fut = loop.create_future() if wait else None
            with self._lock:
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                cid = next(self._cids)
                if wait:
                    self._futs[cid] = (loop, fut)
                self._conn.send((cmd[0], cid, *cmd[1:]))
            return fut
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._cmds.append((fut, *cmd))
            self._cv.notify()
        return fut

    async def _ask(self, *cmd):
        """Post a command and wait for its result (either mode)."""
        fut = self._post(*cmd)
        return await (fut if self.engine_process else asyncio.wrap_future(fut))

    async def call(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the engine thread between two steps; its result (or error).

        Everything that touches the engine or encodes with its tokenizer goes through here
        (e.g. rendering a chat template), so one thread does it all. NOTE: with
        ``engine_process`` it runs here, at once (``self.llm.tokenizer`` is this process's).
        """
        if self.engine_process:
            return fn(*args)
        return await asyncio.wrap_future(self._post("call", fn, args))

    def call_sync(self, fn: Callable, *args, timeout: float | None = None):
        """``call`` from a plain thread (tests, notebooks): blocks until ``fn`` ran."""
        if self.engine_process:
            return fn(*args)
        return self._post("call", fn, args).result(timeout)

    async def add_request(self, request_id: str, prompt,
                          params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Validate and queue one request; its stream of delta ``RequestOutput``s.

        NOTE: a stream that is never iterated does not abort its request: call ``abort``.

        Raises:
            ValueError, TypeError: a bad prompt or bad params (nothing was queued).
            EngineDeadError: the engine is gone.
        """
        params = SamplingParams() if params is None else params
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        # NOTE: registered before the add: its first tokens may come with the add's reply.
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        times = self._times
        if times is not None:
            times.mark(request_id, "submit")
        try:
            fut = self._post("add", request_id, prompt, params)
            if times is not None:
                times.mark(request_id, "sent")
            await (fut if self.engine_process else asyncio.wrap_future(fut))
        except BaseException:
            self._streams.pop(request_id, None)
            if times is not None:
                times.times.pop(request_id, None)
            raise
        if times is not None:
            times.mark(request_id, "reply")
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
        head, first, finished = None, True, False
        times = self._times
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():  # NOTE: a consumer behind by k steps sends one output
                    items.append(queue.get_nowait())
                if len(items) == 1 and not isinstance(items[0], BaseException):
                    head_, deltas, finished = items[0]  # NOTE: the usual case: one step
                    head = head_ if head_ is not None else head
                else:
                    merged: dict[int, tuple] = {}
                    for item in items:
                        if isinstance(item, BaseException):
                            finished = True  # the engine already dropped it
                            raise item
                        h, its, finished = item
                        head = h if h is not None else head
                        for t in its:  # NOTE: one step has each completion once at most
                            merged[t[0]] = _then(merged[t[0]], t) if t[0] in merged else t
                    deltas = merged.values()
                outs = []
                for index, ids, lps, reason, stop_reason, final_text, cum in deltas:
                    text = texts.get(index)  # NOTE: one incremental decode per completion
                    if text is None:  # NOTE: not setdefault: it would build one every chunk
                        text = texts[index] = IncrementalText(self.tokenizer, params)
                    outs.append(CompletionOutput(
                        index=index, text=text.add_ids(ids, final_text), token_ids=ids,
                        cumulative_logprob=cum, logprobs=lps, finish_reason=reason,
                        stop_reason=stop_reason))
                if first and times is not None:
                    times.mark(request_id, "first_out")
                    if head.times is not None:
                        times.mark(request_id, "engine_add", head.times[0])
                        times.mark(request_id, "engine_first", head.times[1])
                yield RequestOutput(request_id=request_id, prompt=head.prompt,
                                    prompt_token_ids=head.prompt_token_ids,
                                    prompt_logprobs=head.prompt_logprobs if first else None,
                                    outputs=outs, finished=finished,
                                    num_cached_tokens=head.num_cached_tokens)
                first = False
        finally:
            if times is not None:
                times.finish(request_id)
            if not finished:  # closed or cancelled early (client gone): free it now
                self.abort_nowait(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its rows and blocks are free."""
        self._streams.pop(request_id, None)
        await self._ask("abort", request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Queue an abort (it runs before the next step); unknown ids are ignored."""
        self._streams.pop(request_id, None)
        with contextlib.suppress(RuntimeError):  # the engine is gone: nothing to free
            self._post("abort", request_id, wait=False)

    def stats(self) -> dict:
        """Counters for ``/metrics`` (process mode: as of the engine's last message)."""
        return dict(self._stats) if self.engine_process else self.core.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (requests in flight get an error) and join the thread / process."""
        if self.engine_process:
            with self._lock, contextlib.suppress(OSError, ValueError):
                if self._dead is None:
                    self._conn.send(("stop",))
                self._dead = self._dead or "the engine loop was shut down"
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout)
            self._reader.join(timeout)
            return
        with self._cv:
            self._dead = self._dead or "the engine loop was shut down"
            self._cv.notify()
        self._thread.join(timeout)

    def _dispatch(self, items: list) -> None:
        """Hand a step's items to their streams: one wake-up of each event loop per step."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        if self._times is not None:
            for rid, head, _, _ in items:
                if head is not None:
                    self._times.mark(rid, "first_item")
        for rid, head, deltas, done in items:
            stream = self._streams.pop(rid, None) if done else self._streams.get(rid)
            if stream is not None:
                loop, queue = stream
                item = deltas if isinstance(deltas, BaseException) else (head, deltas, done)
                deliveries.setdefault(loop, []).append((queue, item))
        for loop, its in deliveries.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed
                loop.call_soon_threadsafe(_deliver, its)

    def _fail_streams(self, message: str) -> None:
        self._dispatch([(rid, None, EngineDeadError(message), True) for rid in list(self._streams)])

    # -- the engine thread ---------------------------------------------------------

    def _loop(self) -> None:
        core = self.core
        while True:
            with self._cv:
                while not (self._cmds or self._dead or core.has_work()):
                    self._cv.wait()
                cmds, self._cmds = list(self._cmds), collections.deque()
                dead = self._dead
            for cmd in cmds:
                self._run(*cmd)
            if dead:
                self._fail_streams(dead)
                core.fail_all(dead)
                return
            if core.has_work():
                try:
                    self._dispatch(core.step())
                except Exception as exc:  # noqa: BLE001 (the whole step failed: tell everyone)
                    self._dispatch(core.fail_all(f"engine step failed: {exc!r}"))
                if self.trace is not None:
                    sch = self.llm.scheduler
                    self.trace(core.num_steps - 1, [r.request_id for r in sch.running],
                               [r.request_id for r in sch.waiting])

    def _run(self, fut, kind, *args) -> None:
        try:
            if kind == "add":
                result = self.core.add(*args)
            elif kind == "abort":
                result = self.core.abort(*args)
            else:
                fn, fn_args = args
                result = fn(*fn_args)
        except BaseException as exc:  # noqa: BLE001 (the caller's error, handed to the caller)
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    # -- the engine process (engine_core.py) ----------------------------------------

    def _start_process(self, factory, kwargs: dict, timeout: float) -> None:
        import itertools
        import multiprocessing
        import time
        from pathlib import Path
        from types import SimpleNamespace

        from mrv2.serve.engine_core import run_engine_core

        if factory is None:
            from mrv2 import LLM as factory
        ctx = multiprocessing.get_context("spawn")  # NOTE: fork would copy CUDA / threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=run_engine_core, args=(child, factory, kwargs),
                                 name="mrv2-engine-core", daemon=True)
        self._proc.start()
        child.close()  # NOTE: else a dead process's pipe never reads EOF here
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self._proc.terminate()
                raise EngineDeadError(f"the engine process exited (code {self._proc.exitcode}) "
                                      "before it was ready" if self._proc.exitcode is not None
                                      else f"the engine process was not ready in {timeout} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineDeadError(f"the engine process exited (code {self._proc.exitcode}) "
                                  "before it was ready") from None
        if kind == "error":
            self._proc.join(5)
            raise value
        tok = None
        if value["tokenizer"] is not None:
            from mrv2.llm import _load_tokenizer
            tok = _load_tokenizer(value["tokenizer"])
        self.tokenizer = tok
        self.llm = SimpleNamespace(
            model_path=Path(value["model_path"]), tokenizer=tok, device=value["device"],
            dtype=value["dtype"], hf_config=SimpleNamespace(vocab_size=value["vocab_size"]),
            scheduler_config=SimpleNamespace(max_model_len=value["max_model_len"]))
        self._stats = {k: 0 for k in ("num_requests_running", "num_requests_waiting",
                                      "kv_cache_usage", "prompt_tokens_total",
                                      "generation_tokens_total", "requests_total",
                                      "steps_total")}
        self._cids = itertools.count()
        self._futs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._reader = threading.Thread(target=self._read, name="mrv2-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """The reader thread: the engine's messages to futures and streams, until EOF."""
        from mrv2.serve.engine_core import MessageReader

        reader = MessageReader(self._conn)
        while True:
            try:
                msgs = reader.recv_batch()  # every step that came since the last wake
            except (EOFError, OSError):
                break
            items, results = [], {}
            for replies, its, stats in msgs:
                self._stats = stats
                for cid, exc in replies:
                    waiter = self._futs.pop(cid, None)
                    if waiter is not None:
                        results.setdefault(waiter[0], []).append((waiter[1], exc))
                items += its
            _resolve_all(results)
            self._dispatch(items)
        self._proc.join(5)
        with self._lock:
            self._dead = self._dead or (f"the engine process died (exit code "
                                        f"{self._proc.exitcode})")
            futs, self._futs = self._futs, {}
        results = {}
        for loop, fut in futs.values():
            results.setdefault(loop, []).append((fut, EngineDeadError(self._dead)))
        _resolve_all(results)
        self._fail_streams(self._dead)
