"""One engine step: schedule -> runner.execute_model -> process the sampled tokens.

The engine owns the CPU-side requests: it appends each sampled token, checks the
stop conditions (EOS, ``stop_token_ids``, ``stop`` strings, ``max_tokens``, the
model's length) and finishes requests, which frees their KV blocks at once and
their state rows at the next step.

With ``async_scheduling`` the engine runs one step ahead of its outputs:

    schedule N+1 -> launch N+1 -> wait for N's output event -> process N -> ...

so the CPU plans and launches step N+1 while the GPU still runs step N. The
scheduler plans N+1 with *placeholders* for N's tokens (the runner reads the real
ones on the device). A request that stopped at step N was already scheduled in
N+1: that sample is simply dropped (the request is gone), and its blocks and row
are freed as usual. Without it, each step is processed right after its launch.

Faults: an error inside a step ends only the request that caused it
(``finish_reason="error"``), through the containment boundaries of ``mrv2.fault``;
``abort_requests`` ends requests in any state and frees their blocks and rows at once.
When nothing is left to run, the rows of the last finished requests are freed too.
"""

from __future__ import annotations

import contextlib
from collections import deque

from mrv2.fault import FaultContainment
from mrv2.metrics import now
from mrv2.request import Request
from mrv2.runner_interface import RunnerInterface
from mrv2.sample.logprobs import make_logprob_dict
from mrv2.sample.prompt_logprobs import prompt_logprobs_to_output
from mrv2.scheduler import Scheduler, SchedulerOutput
from mrv2.spec_decode.scheduling import correct_bounds_now, observe_spec_output


class StepCallback:
    """Hooks the engine calls around every step (override the ones you need).

    ``on_launch`` runs right after ``runner.execute_model`` returned, ``on_output`` when
    that step's output has arrived, before it is applied to the requests (with async
    scheduling, one call of ``Engine.step`` later). ``step`` counts launches from 0.
    """

    def on_launch(self, step: int, sched: SchedulerOutput) -> None:
        """A step was launched (its output is not ready yet)."""

    def on_output(self, step: int, sched: SchedulerOutput, output) -> None:
        """The ``StepOutput`` of launch ``step`` arrived; the requests are not updated yet."""


class Engine(FaultContainment):
    """Drives the scheduler and a runner (V2 by default).

    Args:
        scheduler: plans each step.
        runner: a ``RunnerInterface`` (``execute_model(SchedulerOutput)`` returns an
            output whose ``get_output()`` gives a ``StepOutput``).
        tokenizer: for stop strings and output text (``None``: token ids only).
        max_model_len: a request ends with ``"length"`` when it reaches it.
        async_scheduling: launch step N+1 before processing step N's output.
    """

    def __init__(self, scheduler: Scheduler, runner: RunnerInterface, tokenizer=None,
                 max_model_len: int = 4096, async_scheduling: bool = False):
        self.async_scheduling = async_scheduling
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.num_steps = 0
        self._num_launches = 0
        # (launch index, sched, output) launched, not yet processed.
        self._pending: tuple[int, SchedulerOutput, object] | None = None
        #: ``StepCallback`` objects called around every step, in order.
        self.callbacks: list[StepCallback] = []
        # Acceptance counts of speculative decoding (``None`` without it).
        self.spec_stats = runner.spec_decode_stats
        self.updated: list[Request] = []    # requests that got a token in the last step
        self._failed: list[Request] = []    # requests finished with "error" in the last step
        self._unapplied: set[str] = set()   # sampling requests of the output being applied
        self._suspects: deque[str] = deque()  # requests to run solo after a failed step
        self._timeline = None

    @property
    def timeline(self):
        """A ``mrv2.timeline.Timeline`` recording every step, or ``None`` (default)."""
        return self._timeline

    @timeline.setter
    def timeline(self, tl) -> None:
        self._timeline = tl
        self.runner.timeline = tl

    def _cpu(self, name: str):
        return self._timeline.cpu(name) if self._timeline is not None else contextlib.nullcontext()

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def abort_requests(self, req_ids) -> list[Request]:
        """Finish ``req_ids`` with ``"abort"`` in any state; blocks and rows are freed now.

        Unknown (or already finished) ids are ignored, as in vLLM.

        Returns:
            The requests aborted.
        """
        aborted = []
        for req_id in req_ids:
            req = self.scheduler.requests.get(req_id)
            if req is not None:
                self.scheduler.finish_request(req_id, "abort")
                aborted.append(req)
        if self._pending is not None and not self.scheduler.has_unfinished():
            # Only aborted requests are in flight: wait for that step and drop its tokens.
            pending, self._pending = self._pending, None
            self._process_safe(*pending)
        self._free_rows_now()  # NOTE: at once, also while other requests are in flight
        return aborted

    def drain(self) -> None:
        """When no request is left: wait for a step still in flight and free every row.

        Such a step holds only finished or aborted requests (async scheduling can launch
        one step too many, e.g. when a speculating step's accepted count was not known
        yet); its tokens are dropped.
        """
        if self._pending is not None and not self.scheduler.has_unfinished():
            pending, self._pending = self._pending, None
            self._process_safe(*pending)
        if not self.has_unfinished():
            self._free_rows_now()

    def _free_rows_now(self) -> None:
        """Free the state rows of finished requests now, with a finished-only runner call.

        NOTE: safe with a step in flight: the rows' device contents are only overwritten
        by a later owner's staged write, queued after that step on the same stream.
        """
        ids = self.scheduler.take_freed_ids()
        if ids:
            self.runner.execute_model(SchedulerOutput(finished_req_ids=ids))

    def step(self) -> list[Request]:
        """Run one step: launch the next one, process the oldest unprocessed one.

        Returns:
            The requests that finished in this call (``finish_reason`` ``"error"`` for a
            request whose step failed; see ``mrv2.fault``). ``self.updated`` lists every
            request that got a token.
        """
        self.updated, self._failed = [], []
        finished = self._isolate_suspects() if self._suspects else []
        with self._cpu("schedule"):
            sched = self.scheduler.schedule()
        if (sched.is_empty and not sched.finished_req_ids and self._pending is None
                and self.scheduler.has_unfinished()):
            raise RuntimeError("scheduler made no progress: a request cannot fit the KV pool")
        launched = None
        if not sched.is_empty or sched.finished_req_ids:
            launched = self._launch(sched)  # (launch, sched, output); None: it failed
            self.num_steps += launched is not None and not sched.is_empty
            if launched is not None:
                for cb in self.callbacks:
                    cb.on_launch(*launched[:2])
                # sync_accepted_counts (benchmark only): the runner synced; use exact counts.
                correct_bounds_now(self.scheduler, sched, launched[2])
        if not self.async_scheduling:
            to_process = [launched]
        elif launched is not None and launched[1].is_empty:
            # NOTE: a step that only freed rows has no output to wait for: keep none pending.
            to_process, self._pending = [self._pending, launched], None
        else:
            to_process, self._pending = [self._pending], launched
        for item in to_process:
            if item is not None:
                finished += self._process_safe(*item)
        self.drain()  # nothing left to run: no step stays in flight, no row stays held
        if self._timeline is not None:
            # NOTE: one timeline step = one call; with async scheduling its wait/output
            # spans process the launch of the call before.
            self._timeline.next_step()
        return finished + [r for r in self._failed if r not in finished]

    def _process(self, launch: int, sched: SchedulerOutput, output) -> list[Request]:
        """Wait for one step's output (its event only) and apply it to the requests."""
        # NOTE: nothing of this step is applied yet: a fault in get_output (an error that
        # surfaces at the device sync) resets all of its sampling requests, not the set
        # the previous step's _apply left behind.
        self._unapplied = sched.sampling_req_ids
        with self._cpu("wait"):
            out = output.get_output()
        for cb in self.callbacks:
            cb.on_output(launch, sched, out)
        with self._cpu("output"):
            return self._apply(sched, out)

    def _apply(self, sched: SchedulerOutput, out) -> list[Request]:
        finished = []
        detok = self._detok_token if self.tokenizer is not None else None
        t = now()
        # NOTE: self._unapplied (set by _process: the whole step) is not a copy shrunk per
        # request (a set method call per request per step): the ids not applied yet are
        # worked out only when this loop stops (see below).
        sampling = sched.sampling_req_ids
        for req_id, tensors in out.prompt_logprobs.items():
            req = self.scheduler.requests.get(req_id)
            if req is not None:
                with self._contained(req, "building its prompt logprobs"):
                    req.prompt_logprobs = prompt_logprobs_to_output(
                        *tensors, req.sampling_params.prompt_logprobs, detok)
        spec = out.num_draft_tokens is not None  # speculative decoding: a run per request
        # NOTE: this loop runs for every request of every step: locals, not attributes.
        requests, updated = self.scheduler.requests, self.updated
        req_ids = out.req_ids
        i = -1
        try:
            for i, (req_id, run) in enumerate(zip(req_ids, out.sampled_token_ids)):
                if req_id not in sampling:
                    continue  # a prefill chunk that did not reach the end: sample discarded
                req = requests.get(req_id)
                if req is None:
                    continue  # it finished while this step was in flight: drop the sample
                if spec:  # the rejected drafts: correct the scheduler's bounds, count them
                    observe_spec_output(req, sched.num_spec_tokens.get(req_id, 0), len(run),
                                        out.num_draft_tokens[i], self.spec_stats,
                                        corrected=out.bounds_corrected)
                    req.num_output_placeholders -= len(run)
                else:
                    req.num_output_placeholders -= 1
                req.last_token_time = t
                if req.first_token_time is None:
                    req.first_token_time = t
                # NOTE: boundary 1 of mrv2/fault.py as a plain try: a context manager per
                # request per step cost ~1.3 us each (0.3 ms a step at batch 256).
                try:
                    if spec or req.allowed_set is not None or req.logprobs is not None:
                        if self._append_run(req, run if spec else (run,), i, spec, out, detok):
                            finished.append(req)
                    else:
                        # The plain decode, inlined: append, then the quick stop check
                        # (``_stop_limits``); only a request it cannot clear is checked in full.
                        output = req.output_token_ids
                        output.append(run)
                        limits = req.stop_limits or self._stop_limits(req)
                        if ((len(output) >= limits[0] or run in limits[1])
                                and self._check_stop(req, run)):
                            finished.append(req)
                    updated.append(req)
                except Exception as exc:  # noqa: BLE001 (the boundary: any error of this request)
                    self._fail(req, f"request {req.request_id!r} failed while processing its "
                               f"output: {exc!r}")
        except BaseException:
            # The ids in batch order up to the failing one were applied (or dropped).
            self._unapplied = sampling.difference(req_ids[:i + 1])
            raise
        self._unapplied = sampling.difference(req_ids)
        return finished

    def _append_run(self, req: Request, tokens, i: int, spec: bool, out, detok) -> bool:
        """Append a request's sampled tokens (with their logprobs), each checked for a stop.

        Tokens in order, stop conditions after each: a finish inside an accepted run
        returns nothing after it. Returns whether ``req`` finished.
        """
        for j, token in enumerate(tokens):
            if req.allowed_set is not None and token not in req.allowed_set:
                # NOTE: every allowed token was masked (e.g. by a logits processor).
                raise ValueError(f"sampled token {token} is outside "
                                 "allowed_token_ids: every allowed token was masked")
            req.output_token_ids.append(token)
            if req.logprobs is not None:
                # sampled id first, then top-k
                ids, lps, rank = (col[i][j] if spec else col[i] for col in out.logprobs)
                k = req.sampling_params.logprobs
                req.logprobs.append(make_logprob_dict(
                    ids, lps, rank, len(ids) - 1 if k == -1 else k, detok))
                req.cumulative_logprob += lps[0]
            if self._check_stop(req, token):
                return True
        return False

    def _stop_limits(self, req: Request) -> tuple[int, frozenset | set]:
        """``(limit, stop ids)`` of ``req``'s quick stop check, worked out once per request.

        After a token outside ``stop ids`` that leaves it under ``limit`` output tokens,
        none of ``_check_stop``'s conditions holds (it would return ``False`` and change
        nothing): ``limit`` is where ``max_tokens`` or the model's length ends it, 0 with
        stop strings (they need the text: always checked in full).
        """
        sp = req.sampling_params
        limit = self.max_model_len - len(req.prompt_token_ids)
        if sp.max_tokens is not None and sp.max_tokens < limit:
            limit = sp.max_tokens
        req.stop_limits = (0 if sp.stop else limit, sp.all_stop_token_ids)
        return req.stop_limits

    def _detok_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _check_stop(self, req: Request, token: int) -> bool:
        """Apply the stop conditions to ``req`` after it sampled ``token``."""
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        # The common case first, with no side effect: none of the conditions below holds.
        if ((n_out < sp.min_tokens or token not in sp.all_stop_token_ids) and not sp.stop
                and (sp.max_tokens is None or n_out < sp.max_tokens)
                and len(req.prompt_token_ids) + n_out < self.max_model_len):
            return False
        reason = stop_reason = None
        if n_out >= sp.min_tokens and token in sp.all_stop_token_ids:
            reason = "stop"
            stop_reason = None if token not in sp.stop_token_ids else token
        elif sp.stop and self.tokenizer is not None and n_out >= sp.min_tokens:
            text = self.detokenize(req)
            # Only a stop string that ends inside the newest token's text can be new.
            for s in sp.stop:
                idx = text.find(s, max(0, len(req.output_text) - len(s) + 1))
                if idx >= 0:
                    req.output_text = text[: idx + (len(s) if sp.include_stop_str_in_output else 0)]
                    reason, stop_reason = "stop", s
                    break
            else:
                req.output_text = text
        if reason is None and sp.max_tokens is not None and n_out >= sp.max_tokens:
            reason = "length"
        if reason is None and req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        if stop_reason is None or isinstance(stop_reason, int):
            # As vLLM's detokenizer: a stop token (EOS or stop_token_ids) stays in token_ids
            # but its text leaves `text` unless include_stop_str_in_output.
            drop = reason == "stop" and not sp.include_stop_str_in_output
            req.output_text = self.detokenize(req, drop_last=drop)
        self.scheduler.finish_request(req.request_id, reason, stop_reason)
        return True

    def detokenize(self, req: Request, drop_last: bool = False) -> str:
        if self.tokenizer is None or not req.sampling_params.detokenize:
            return ""
        ids = req.output_token_ids[:-1] if drop_last else req.output_token_ids
        return self.tokenizer.decode(ids,
                                     skip_special_tokens=req.sampling_params.skip_special_tokens)
