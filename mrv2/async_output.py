"""AsyncOutput: one step's results, copied to the host on a side stream.

The V1 runner ended each step with ``sampled_ids.tolist()``: the CPU stopped until
the GPU had finished the whole step, and only then prepared the next one. Here
the runner returns as soon as the step is *launched*. At the end of the step's
work on the main stream, a side CUDA stream waits for it (a device-side wait:
the CPU does not block), copies the sampled ids (and logprobs, prompt logprobs)
into pinned host memory with non-blocking copies, and records an event. The
engine calls ``get_output()`` one step later; by then the copy is usually done,
and the only wait in the whole step loop is on that event.

On the CPU there is no stream: the "copy" is the tensors themselves.
See notebooks/07_async_streams.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepOutput:
    """One step's results on the host.

    Attributes:
        req_ids: the scheduled requests, in batch order.
        sampled_token_ids: one sampled id per request.
        logprobs: per request, ``(ids, logprobs, rank)`` of the sampled token (column 0)
            and the top-k, when some request asked for logprobs; else ``None``.
        prompt_logprobs: request id -> ``(ids, logprobs, ranks)`` host tensors for a
            request whose prompt logprobs became complete in this step.
        num_draft_tokens: with speculative decoding, the real drafts each request
            verified; then ``sampled_token_ids`` holds one run of ``a + 1`` tokens per
            request and each logprobs column one entry per token of the run. ``None``:
            one token per request.
        bounds_corrected: the scheduler already used this step's exact accepted counts
            (``sync_accepted_counts``).
    """

    req_ids: list[str]
    sampled_token_ids: list
    logprobs: tuple[list, list, list] | None = None
    prompt_logprobs: dict = field(default_factory=dict)
    num_draft_tokens: list[int] | None = None
    bounds_corrected: bool = False


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream used for device->host output copies on ``device`` (one per device)."""
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device=device)
    return _copy_streams[device]


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # a true async copy: the target is pinned
    return host


class AsyncOutput:
    """The results of a launched step, on their way to the host.

    Args:
        req_ids: the scheduled requests, in batch order.
        sampled_token_ids: ``[num_reqs]`` device tensor (``None`` for an empty step).
        logprobs: ``(ids [B, k+1], logprobs [B, k+1], ranks [B])`` device tensors, or ``None``.
        prompt_logprobs: request id -> ``(ids, logprobs, ranks)`` device tensors.
        num_sampled: speculative decoding: ``[num_reqs]`` run lengths ``a + 1``; then
            ``sampled_token_ids`` is ``[num_reqs, K + 1]`` and the logprobs tensors carry a
            ``K + 1`` axis after the first.
        num_draft_tokens: ``[num_reqs]`` real drafts verified (with ``num_sampled``).

    The constructor enqueues the copies and returns at once. It must be called on
    the stream that produced the tensors, after the work that produces them.
    """

    def __init__(self, req_ids: list[str], sampled_token_ids: torch.Tensor | None,
                 logprobs: tuple[torch.Tensor, ...] | None = None,
                 prompt_logprobs: dict | None = None, num_sampled: torch.Tensor | None = None,
                 num_draft_tokens: torch.Tensor | None = None):
        self.req_ids = req_ids
        # Set by the runner after a deliberate sync (sync_accepted_counts), else None.
        self.synced_num_sampled: list[int] | None = None
        tensors = {"sampled": sampled_token_ids, "logprobs": logprobs,
                   "prompt_logprobs": prompt_logprobs or {}, "num_sampled": num_sampled,
                   "num_draft_tokens": num_draft_tokens}
        device = None if sampled_token_ids is None else sampled_token_ids.device
        self.event = None
        if device is None or device.type != "cuda":
            self._host = tensors
            return
        stream = copy_stream(device)
        # The side stream starts after everything queued so far on the main stream.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._host = _map(tensors, _to_pinned)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        # NOTE: keep the device tensors alive until the copy has read them: the caching
        # allocator would otherwise hand their memory to the next step on the main stream.
        self._device_refs = tensors

    def is_ready(self) -> bool:
        """True when the host copy has finished (never blocks)."""
        return self.event is None or self.event.query()

    def get_output(self) -> StepOutput:
        """Wait for this step's copy (only its event), then return the host results."""
        if self.event is not None:
            self.event.synchronize()
            self._device_refs = None
        host = self._host
        if host["sampled"] is None:
            return StepOutput([], [], None, host["prompt_logprobs"])
        lp = None if host["logprobs"] is None else tuple(t.tolist() for t in host["logprobs"])
        sampled = host["sampled"].tolist()
        if host["num_sampled"] is None:
            return StepOutput(self.req_ids, sampled, lp, host["prompt_logprobs"])
        # Speculative decoding: keep each request's run of a + 1 tokens (and logprobs).
        counts = host["num_sampled"].tolist()
        runs = [row[:n] for row, n in zip(sampled, counts)]
        if lp is not None:
            lp = tuple([row[:n] for row, n in zip(col, counts)] for col in lp)
        return StepOutput(self.req_ids, runs, lp, host["prompt_logprobs"],
                          host["num_draft_tokens"].tolist(),
                          bounds_corrected=self.synced_num_sampled is not None)


def _map(obj, fn):
    """Apply ``fn`` to every tensor in nested dicts/tuples/lists (``None`` kept)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj
