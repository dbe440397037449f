"""Fault containment: an error inside a step ends the request that caused it, and only it.

Every value a request carries is validated when it is submitted (``SamplingParams.verify``,
the prompt checks of ``mrv2.engine_api``), so a step should never fail. If one still does,
the engine contains it at three boundaries, without any special case per field:

1. **Output of one request** (detokenizing, stop checks, logprob dicts): each request's
   output is processed inside ``_contained``; an error there finishes that request with
   ``finish_reason="error"`` (the message in ``stop_reason``) and the loop goes on.
2. **A whole step** (``runner.execute_model`` or ``get_output`` raises): the requests of
   the step are *reset*: sent back to waiting as if preempted (blocks and rows freed, to be
   recomputed from their tokens so far, which gives the same tokens), their placeholders
   undone. With one request in the step it is the culprit. With several, each becomes a
   *suspect*.
3. **Isolation**: before the next step, each suspect runs *solo* (the other requests are
   preempted or held back) until it has sampled a token; a suspect whose solo step fails
   is the culprit. A request in three failed steps whose solo runs all passed (a fault of
   the combination) is finished with an error too, so a fault cannot loop forever.

A ``KeyboardInterrupt`` (any ``BaseException`` that is not an ``Exception``) gets the
reset of 2, so the engine stays consistent, and is re-raised; ``LLM.generate`` then
aborts its own requests. Faults cost recomputation only when they happen.
"""

from __future__ import annotations

import contextlib

from mrv2.request import Request, RequestStatus

#: Failed steps a request may be part of (with solo runs that pass) before it is ended.
MAX_FAULTS = 3


class FaultContainment:
    """Mixin of ``mrv2.engine.Engine``: the containment boundaries around a step."""

    def _fail(self, req: Request, why: str) -> None:
        """Finish ``req`` with ``finish_reason="error"`` and ``stop_reason=why``; free it."""
        if self.scheduler.requests.get(req.request_id) is req:
            self.scheduler.finish_request(req.request_id, "error", why)
        else:
            req.status = RequestStatus.FINISHED
            req.finish_reason, req.stop_reason = "error", why
        self._failed.append(req)

    @contextlib.contextmanager
    def _contained(self, req: Request, what: str):
        """Boundary 1: an ``Exception`` in the body finishes ``req`` with an error."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 (the boundary: any error of this request)
            self._fail(req, f"request {req.request_id!r} failed while {what}: {exc!r}")

    def _reset(self, sched, unapplied) -> list[Request]:
        """Send the live requests of ``sched`` back to waiting (recompute); undo placeholders.

        Args:
            sched: the failed step's ``SchedulerOutput``.
            unapplied: ids whose token placeholder of this step will never be filled.
        """
        # NOTE: prefix caching registers a block's hash when its step is scheduled; the
        # failed step may never have written that KV, so no cached block can be trusted.
        # Forgetting them all is heavy-handed but faults are rare.
        self.scheduler.kv.reset_prefix_cache()
        requests = self.scheduler.requests
        for req_id in unapplied:
            req = requests.get(req_id)
            if req is not None and req.num_output_placeholders > 0:
                # 1 + K_b placeholders for a speculating step (mrv2/spec_decode/scheduling.py)
                k = sched.num_spec_tokens.get(req_id, 0)
                req.num_output_placeholders = max(0, req.num_output_placeholders - 1 - k)
                req.num_spec_placeholders = max(0, req.num_spec_placeholders - k)
        reqs = [requests[r] for r in sched.num_scheduled_tokens if r in requests]
        for req in reversed(reqs):  # reversed: preempt() puts each at the queue's front
            if req.status == RequestStatus.RUNNING:
                self.scheduler.preempt(req)
        return reqs

    def _launch(self, sched):
        """Boundary 2 around ``execute_model``: ``(launch index, sched, output)``, or ``None``
        if it failed."""
        try:
            output = self.runner.execute_model(sched)
            self._num_launches += 1
            return self._num_launches - 1, sched, output
        except BaseException as exc:
            self.scheduler.requeue_freed(sched.finished_req_ids)  # maybe never freed
            reqs = self._reset(sched, sched.sampling_req_ids)
            # NOTE: a `fatal` error (a tensor-parallel group that broke) ends the call.
            if not isinstance(exc, Exception) or getattr(exc, "fatal", False):
                raise
            self._blame(reqs, exc)
            return None

    def _process_safe(self, launch: int, sched, output) -> list[Request]:
        """Boundary 2 around ``get_output`` + applying it (per-request errors: boundary 1)."""
        try:
            return self._process(launch, sched, output)
        except BaseException as exc:
            reqs = self._reset(sched, self._unapplied)
            if self._pending is not None:
                # NOTE: the step in flight read this step's tokens on the device: redo it too.
                pending, self._pending = self._pending, None
                reqs += [r for r in self._reset(pending[1], pending[1].sampling_req_ids)
                         if r not in reqs]
            if not isinstance(exc, Exception):
                raise
            self._blame(reqs, exc)
            return []

    def _blame(self, reqs: list[Request], exc: Exception) -> None:
        """One request in the failed step: it is the culprit; several: suspects."""
        if not reqs:
            raise RuntimeError(f"a step with no live request failed: {exc!r}") from exc
        if len(reqs) == 1:
            self._fail(reqs[0], f"request {reqs[0].request_id!r} failed in its step: {exc!r}")
            return
        for req in reqs:
            req.num_faults += 1
            if req.num_faults >= MAX_FAULTS:
                self._fail(req, f"request {req.request_id!r} was in {MAX_FAULTS} failed "
                           f"steps (its solo runs passed): {exc!r}")
            elif req.request_id not in self._suspects:
                self._suspects.append(req.request_id)

    def _isolate_suspects(self) -> list[Request]:
        """Boundary 3: run each suspect solo (synchronously) until it sampled a token."""
        finished = []
        if self._pending is not None:
            pending, self._pending = self._pending, None
            finished += self._process_safe(*pending)
        while self._suspects:
            req = self.scheduler.requests.get(self._suspects.popleft())
            if req is not None:
                finished += self._run_solo(req)
        return finished

    def _run_solo(self, req: Request) -> list[Request]:
        sch = self.scheduler
        for other in reversed(list(sch.running)):
            if other is not req:
                sch.preempt(other)
        held = [r for r in sch.waiting if r is not req]
        for r in held:
            sch.waiting.remove(r)
        finished = []
        try:
            while sch.requests.get(req.request_id) is req:
                sched = sch.schedule()
                if sched.is_empty:
                    break
                launched = self._launch(sched)  # a failure here blames req alone
                if launched is None:
                    break
                finished += self._process_safe(*launched)
                if req.request_id in sched.sampling_req_ids:
                    break
        finally:
            sch.waiting.extend(held)
        return finished
