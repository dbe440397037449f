"""``EngineCore``: the stepping side of ``AsyncLLM``, in a thread or in its own process.

``EngineCore`` owns one ``LLM``'s ``LLMEngine``: ``add`` / ``abort`` between steps, and
``step()``, which returns one item per request that got tokens: ``(request_id, head,
deltas, done)``, where ``deltas`` are only the *new* tokens (and logprobs, finish reason)
of each completion and ``head`` (prompt, prompt ids, prompt logprobs, cached tokens) comes
with a request's first item only (``None`` after it); a delta is a tuple of ``_Delta``'s
fields.

Why a process (vLLM's ``EngineCore`` design): the HTTP layer costs tens of microseconds of
Python per streamed chunk, one chunk per request per step; in one interpreter that work
and the engine's own host work (scheduling, output processing) share the GIL, and the
one-step-ahead loop starves. ``run_engine_core`` is the main of a spawned process: it
builds the ``LLM`` itself, then loops

    take every queued command (add / abort / stop) -> step -> send one message

where the message of one iteration is ``(replies, items, stats)``: the result (or the
``ValueError``/``TypeError``) of each command by its id, the step's items, the counters
for ``/metrics``. Text is detokenized in the API process (``IncrementalText``).

Commands are read off the pipe by a thread (``Inbox``) the moment they arrive, not only
between two steps: a burst of requests (a few KB each) fills the pipe's buffer in a few
dozen requests, and the API process's event loop, which writes them, would block in its
``send`` for the rest of the step, streaming nothing meanwhile (issue 16).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import pickle
import struct
import threading
import time
from dataclasses import dataclass


@dataclass
class _Delta:
    """What one completion got in one step (built on the engine side)."""

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


@dataclass
class Head:
    """What a stream needs of its request once (sent with its first item)."""

    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    num_cached_tokens: int
    times: tuple[float, float] | None = None  # (engine_add, engine_first): MRV2_SERVE_TRACE


class EngineCore:
    """Steps one ``LLM``'s ``LLMEngine`` and turns each step into per-request deltas.

    Args:
        llm: an ``mrv2.LLM`` (or an object of the same shape: ``llm_engine``,
            ``scheduler``, ``kv_manager``); only this object's owner may call it.
        trace: stamp when each request was added and got its first token (``Head.times``;
            ``mrv2/serve/trace.py``).
    """

    def __init__(self, llm, trace: bool = False):
        self.llm = llm
        self._t_add: dict[str, float] | None = {} if trace else None
        self.engine = llm.llm_engine
        self._sent: dict[str, int] = {}   # child request id -> tokens handed out
        self._new: set[str] = set()       # request ids whose head was not sent yet
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0

    def add(self, request_id: str, prompt, params) -> None:
        """Validate and queue one request (``ValueError``/``TypeError``: nothing queued)."""
        self.engine.add_request(request_id, prompt, params)
        self._new.add(request_id)
        if self._t_add is not None:
            self._t_add[request_id] = time.perf_counter()
        self.prompt_tokens_total += len(self.engine._groups[request_id][0].prompt_token_ids)
        self.requests_total += 1

    def abort(self, request_id: str) -> None:
        """End a request in any state and free its rows and blocks; unknown ids are ignored."""
        self._new.discard(request_id)
        if self._t_add is not None:
            self._t_add.pop(request_id, None)
        for req in self.engine._groups.get(request_id, ()):
            self._sent.pop(req.request_id, None)
        self.engine.abort_request(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[tuple]:
        """One engine step; ``(request_id, head or None, deltas, done)`` per request touched."""
        eng = self.engine
        finished = eng.engine.step()
        self.num_steps += 1
        # NOTE: one child may be in both lists (a finished request also got a token). This
        # loop runs for every running request every step, in the engine process, where it
        # delays the next launch: keep it lean (n=1 groups take the short path).
        owner, groups, new, sent = eng._owner, eng._groups, self._new, self._sent
        touched: dict[str, list] = {}   # request id -> its children that changed, in order
        for cid, req in {r.request_id: r for r in (*eng.engine.updated, *finished)}.items():
            rid = owner.get(cid)
            if rid is not None:
                kids = touched.get(rid)
                if kids is None:
                    touched[rid] = [req]
                else:
                    kids.append(req)
        items = []
        num_tokens = 0
        for rid, kids in touched.items():
            group = groups[rid]
            head = None
            if rid in new:
                new.discard(rid)
                g = group[0]
                head = Head(g.prompt, g.prompt_token_ids, g.prompt_logprobs,
                            max(g.num_cached_tokens, 0))
                if self._t_add is not None:
                    head.times = (self._t_add.pop(rid, 0.0), time.perf_counter())
            deltas = []
            for r in kids:
                # NOTE: a plain tuple of _Delta's fields: it pickles ~6x faster than the
                # dataclass (one per request per step goes down the pipe).
                start, out, fin = sent.get(r.request_id, 0), r.output_token_ids, r.is_finished
                if fin:
                    sent.pop(r.request_id, None)
                else:
                    sent[r.request_id] = len(out)
                ids = out[start:]
                num_tokens += len(ids)
                deltas.append((r.index, ids, None if r.logprobs is None else r.logprobs[start:],
                               r.finish_reason, r.stop_reason, r.output_text if fin else None,
                               r.cumulative_logprob))
            done = fin if len(group) == 1 else all(r.is_finished for r in group)
            items.append((rid, head, deltas, done))
            if done:
                eng.pop(rid)
        self.generation_tokens_total += num_tokens
        return items

    def fail_all(self, message: str) -> list[tuple]:
        """Abort every request; an error item for each (the step itself failed)."""
        ids = list(self.engine._groups)
        self._sent.clear()
        self._new.clear()
        self.engine.abort_request(ids)
        return [(rid, None, RuntimeError(message), True) for rid in ids]

    def stats(self) -> dict:
        """Counters for ``/metrics``."""
        sch, kv = self.llm.scheduler, self.llm.kv_manager
        return {"num_requests_running": len(sch.running), "num_requests_waiting": len(sch.waiting),
                "kv_cache_usage": 1.0 - kv.num_free_blocks / kv.num_blocks,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "requests_total": self.requests_total, "steps_total": self.num_steps}

    def info(self, tokenizer_path) -> dict:
        """What the API process needs to know of the model (sent once, at start)."""
        llm = self.llm
        return {"model_path": str(llm.model_path), "tokenizer": tokenizer_path,
                "max_model_len": llm.scheduler_config.max_model_len,
                "vocab_size": llm.hf_config.vocab_size, "device": str(llm.device),
                "dtype": str(llm.dtype)}


class MessageReader:
    """Reads a ``multiprocessing`` connection's messages in batches: all that arrived, per wake.

    NOTE: why not ``conn.recv()`` in the API process's reader thread: it makes two or three
    blocking reads per message and each gives the GIL away; while the event loop thread is
    busy streaming, taking it back waits up to the switch interval (5 ms), so the reader
    managed ~100 messages/s, the socket filled and the engine process blocked in its
    ``send``: the HTTP layer throttled the engine. One ``os.read`` of everything buffered
    costs one wait per wake, however many steps' messages came meanwhile.

    Args:
        conn: the reading end (a ``multiprocessing.connection.Connection``); its frames are
            ``!i`` length (``-1``: a ``!Q`` length follows) then a pickle.
    """

    def __init__(self, conn):
        self.fd = conn.fileno()
        self.buf = bytearray()

    def _parse(self) -> list:
        msgs, pos, buf = [], 0, self.buf
        while len(buf) - pos >= 4:
            (size,), start = struct.unpack_from("!i", buf, pos), pos + 4
            if size == -1:
                if len(buf) - start < 8:
                    break
                (size,), start = struct.unpack_from("!Q", buf, start), start + 8
            if len(buf) - start < size:
                break
            msgs.append(pickle.loads(memoryview(buf)[start:start + size]))
            pos = start + size
        del buf[:pos]
        return msgs

    def recv_batch(self) -> list:
        """Every whole message that has arrived, in order; blocks until there is one.

        Raises:
            EOFError: the other end is closed.
        """
        while True:
            data = os.read(self.fd, 1 << 20)  # NOTE: blocks without the GIL
            if not data:
                raise EOFError
            self.buf += data
            msgs = self._parse()
            if msgs:
                return msgs


class Inbox:
    """The engine process's commands, read off ``conn`` by a daemon thread as they come.

    Args:
        conn: the engine's end of the pipe (its writes stay with the engine loop: a socket
            is read and written by two threads at once safely).
    """

    def __init__(self, conn):
        self._reader = MessageReader(conn)
        self._cmds: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mrv2-engine-inbox",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                msgs = self._reader.recv_batch()  # NOTE: waits without the GIL
            except (EOFError, OSError):
                msgs = None
            with self._cv:
                if msgs is None:
                    self._closed = True
                else:
                    self._cmds.extend(msgs)
                self._cv.notify()
            if msgs is None:
                return

    def take(self, block: bool) -> list | None:
        """Every command queued so far (``block``: wait for one); ``None``: the pipe closed
        and nothing is left."""
        with self._cv:
            while block and not self._cmds and not self._closed:
                self._cv.wait()
            if not self._cmds and self._closed:
                return None
            cmds = list(self._cmds)
            self._cmds.clear()
            return cmds


def freeze_heap(on: bool = True) -> None:
    """Move every object alive now out of the garbage collector's reach (``gc.freeze``).

    NOTE: called once a process has started (the model, torch, the tokenizer loaded):
    else each full collection walks those hundreds of thousands of objects, a pause of
    ~0.3 s on this CPU (345k objects in the engine process) that stalls every stream at
    once; vLLM freezes its startup heap the same way.

    Args:
        on: ``False``: unfreeze (at shutdown: else extension modules such as Triton's
            report their frozen objects as leaks when the interpreter exits).
    """
    if on:
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def warm_up(llm) -> None:
    """Meet a burst's shapes before the first client, on the GPU (a few seconds at start).

    A burst of clients makes steps that a trickle never does: prompts split across steps
    (chunked prefill: a prefill with cached context), prefill chunks beside decodes, and a
    decode batch that shrinks through every size as requests finish. Each Triton kernel
    variant first met there compiles inside that step, and every stream waits behind it.
    So this first compiles every paged-attention launch variant the runner can pick
    (``Runner.precompile_attention``), then runs one such burst for the rest: ``n`` prompts
    of spread lengths summing to about three steps' token budgets, with output lengths
    staggered from 1 to 16 tokens.

    NOTE: job T (H200): with a warm-up of one budget-filling step (prompts that divided the
    budget exactly, so nothing chunked) the first rate-inf burst still had a 1.3 s step
    after its first ~40 adds and TTFT p50 2.9 s; the second burst, 0.35 s. In job U, with
    the burst but not the precompile, the engine named the culprit: each rate-inf burst
    compiled one or two new ``_paged_attention_kernel`` variants, 1.4-1.6 s each.
    """
    from mrv2 import platform
    from mrv2.llm import LLM
    from mrv2.sampling_params import SamplingParams

    if not platform.HAS_CUDA or not isinstance(llm, LLM):
        return                     # the interpreter compiles nothing; the fake has no kernels
    import sys

    t0 = time.perf_counter()
    n_compiled = llm.runner.precompile_attention()
    print(f"[serve] warm-up: {n_compiled} attention launch variants ready in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    sched = llm.scheduler_config
    longest = max(1, min(1024, sched.max_model_len - 17))
    n = max(1, min(sched.max_num_seqs, 96))
    # Lengths spread over [longest / 8, longest], scaled so the total is ~3 budgets.
    spread = [longest // 8 + (i * 7919) % max(1, longest - longest // 8) for i in range(n)]
    scale = min(1.0, 3 * sched.max_num_batched_tokens / max(1, sum(spread)))
    lens = [max(1, min(longest, int(x * scale))) for x in spread]
    vocab = llm.hf_config.vocab_size
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % vocab for j in range(plen)]}
               for i, plen in enumerate(lens)]
    params = [SamplingParams(temperature=0.6, max_tokens=1 + i % 16, ignore_eos=True, seed=i)
              for i in range(n)]
    llm.generate(prompts, params, use_tqdm=False)


def _report_compiles(core: EngineCore, compiled: list[str], start: int, step_s: float,
                     steps_path: str | None) -> None:
    """Say so when a serving step compiled Triton kernels (the warm-up missed a shape)."""
    import json
    import sys

    names = sorted(set(compiled[start:]))
    print(f"[serve] engine step {core.num_steps}: {len(compiled) - start} Triton kernel "
          f"variant(s) compiled inside it ({step_s * 1e3:.0f} ms; {', '.join(names)})",
          file=sys.stderr, flush=True)
    if steps_path:
        with open(steps_path, "a") as f:
            f.write(json.dumps({"step": core.num_steps, "end": time.perf_counter(),
                                "ms": step_s * 1e3, "compiled": names}) + "\n")


def run_engine_core(conn, factory, kwargs: dict) -> None:
    """Main of the engine process: build ``factory(**kwargs)`` (an ``LLM``), serve ``conn``.

    Commands (tuples) on ``conn``: ``("add", cid, request_id, prompt, params)``,
    ``("abort", cid, request_id)``, ``("stop",)``. A closed ``conn`` (the API process is
    gone) ends the loop too.
    """
    import signal

    # NOTE: Ctrl-C in a terminal reaches the whole process group: the API process shuts
    # down and stops this one ("stop", or EOF); a KeyboardInterrupt mid-step would not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = factory(**kwargs)
        if os.environ.get("MRV2_SERVE_WARMUP", "1") != "0":
            warm_up(llm)
        core = EngineCore(llm, trace=bool(os.environ.get("MRV2_SERVE_TRACE")))
        tok = None if getattr(llm, "tokenizer", None) is None else (
            kwargs.get("tokenizer") or str(llm.model_path))
        freeze_heap()
        conn.send(("ready", core.info(tok)))
    except BaseException as exc:  # noqa: BLE001 (the API process raises it)
        with contextlib.suppress(Exception):
            conn.send(("error", _picklable(exc)))
        return
    try:
        _serve(conn, core)
    finally:
        freeze_heap(False)


def _serve(conn, core: EngineCore) -> None:
    """The engine process's loop (``run_engine_core``), until "stop" or EOF."""
    from mrv2.bench.timing import count_triton_compiles

    trace = os.environ.get("MRV2_SERVE_TRACE")
    steps_path = trace + ".steps.jsonl" if trace else None  # steps that compiled
    with count_triton_compiles() as compiled:
        _loop(conn, core, compiled, steps_path)


def _loop(conn, core: EngineCore, compiled: list[str], steps_path: str | None) -> None:
    inbox = Inbox(conn)
    while True:
        cmds = inbox.take(block=not core.has_work())  # NOTE: idle: wait for a command
        if cmds is None:
            return  # the API process is gone
        replies = []
        for cmd in cmds:
            if cmd[0] == "stop":
                return
            kind, cid, *args = cmd
            try:
                (core.add if kind == "add" else core.abort)(*args)
                replies.append((cid, None))
            except BaseException as exc:  # noqa: BLE001 (the caller's error, to the caller)
                replies.append((cid, _picklable(exc)))
        items = []
        if core.has_work():
            start, t0 = len(compiled), time.perf_counter()
            try:
                items = core.step()
            except Exception as exc:  # noqa: BLE001 (the whole step failed: tell everyone)
                items = core.fail_all(f"engine step failed: {exc!r}")
            if len(compiled) > start:
                _report_compiles(core, compiled, start, time.perf_counter() - t0, steps_path)
        try:
            conn.send((replies, items, core.stats()))
        except (EOFError, OSError):
            return
