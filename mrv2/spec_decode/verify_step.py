"""The runner's side of speculative decoding: logits rows per draft, verify, append, propose.

A speculating request ``b`` scheduled ``1 + K_b`` tokens ``[last sampled, d1 .. dK_b]``;
each of them gives a logits row, the others (prefill chunks, plain decodes) give one. The
step then runs, all on the device and in stream order:

1. ``expand``: per logits row, the hidden-state index, its state row (an expanded
   ``idx_mapping``) and the absolute position of the token it samples
   (``seq_len - K_b + j``), from CPU-known counts (one small host->device copy);
2. the unchanged logit rules and sampler over those rows: the target's own Gumbel-max
   sample at every position, with the stateless (seed, position) noise, so a seeded
   request samples exactly the tokens it samples without speculation;
3. ``verify``: ``exact`` acceptance against the drafts in ``state.draft_token_ids``
   (``a_b`` leading matches, output = the first ``a_b + 1`` targets); or, in
   ``probabilistic`` mode, the rules only (no target sample), the rows gathered into the
   uniform ``[B * (K + 1), V]`` layout and ``probabilistic_verify`` (Leviathan / Chen;
   q = a point mass for n-gram drafts, the draft model's kept filtered probabilities);
4. ``finish``: ``spec_post_update``
   (``num_computed_tokens``, ``token_ids``, ``total_len``, ``last_sampled_token``), then the
   proposer writes the next drafts into the draft slots.

The ``[B, K + 1]`` output tokens and the ``[B]`` run lengths reach the host on the side
stream, one step late; nothing here waits for the device (except ``sync_accepted_counts``,
a deliberate V1-style sync kept for the benchmark). See notebooks/09_speculative_decoding.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from mrv2.async_output import AsyncOutput
from mrv2.kernels.logprobs import compute_topk_logprobs
from mrv2.sample import SamplingMetadata
from mrv2.spec_decode.accept_rows import exact_accept_rows
from mrv2.spec_decode.config import SpeculativeConfig
from mrv2.spec_decode.draft_slots import spec_post_update, write_draft_slots
from mrv2.spec_decode.metrics import SpecDecodeStats
from mrv2.spec_decode.ngram import ngram_propose
from mrv2.spec_decode.verify import VerifyOutput, probabilistic_verify
from mrv2.state import to_device_async

#: ``expand``'s cache: the number of (num_scheduled, K_b) batch shapes kept on the device.
EXPAND_CACHE_SIZE = 32


@dataclass
class SpecRows:
    """One step's logits rows (device tensors; ``N`` rows, ``B`` requests).

    Attributes:
        logits_indices: int64 ``[N]`` hidden-state row of each logits row.
        idx_mapping: int32 ``[N]`` its state row.
        positions: int64 ``[N]`` absolute position of the token it samples.
        gather: int64 ``[B, K + 1]`` logits row of request b's j-th candidate (clamped to
            its last row past K_b).
        num_spec_tokens: int32 ``[B]`` K_b.
        num_draft_tokens: ``[B]`` drafts proposed among the first K_b (set by ``verify``).
    """

    logits_indices: torch.Tensor
    idx_mapping: torch.Tensor
    positions: torch.Tensor
    gather: torch.Tensor
    num_spec_tokens: torch.Tensor
    num_draft_tokens: torch.Tensor | None = None


def expand_rows_np(num_scheduled, num_spec, k: int) -> dict[str, np.ndarray]:
    """The CPU half of ``expand``: index arrays from the scheduled counts (numpy).

    Args:
        num_scheduled: ``[B]`` tokens per request (``1 + K_b`` for a speculating one).
        num_spec: ``[B]`` K_b (0: one logits row, its last token).
        k: K of the config.

    Returns:
        ``logits_indices``, ``slot`` (request of each row), ``back`` (``K_b - j``): ``[N]``;
        ``gather`` ``[B, K + 1]``; all int64.
    """
    n = np.asarray(num_scheduled, dtype=np.int64)
    ks = np.asarray(num_spec, dtype=np.int64)
    width = 1 + ks                                                          # [B]
    query_start = np.cumsum(n) - n                                          # [B]
    row_start = np.cumsum(width) - width                                    # [B]
    slot = np.repeat(np.arange(n.size), width)                              # [N]
    j = np.arange(slot.size) - row_start[slot]                              # [N]
    logits_indices = query_start[slot] + n[slot] - 1 - ks[slot] + j         # [N]
    gather = row_start[:, None] + np.minimum(np.arange(k + 1)[None, :], ks[:, None])
    return {"logits_indices": logits_indices, "slot": slot, "back": ks[slot] - j,
            "gather": gather}


class SpecDecodeStep:
    """Per-step speculative decoding for the V2 runner (both proposers, both verifications).

    Args:
        config: the speculative config (``num_speculative_tokens``, n-gram sizes, sync).
        device: where the state table lives.
        draft_args: for ``method="draft_model"``: the target's ``vocab_size``,
            ``num_blocks``, ``block_size``, ``max_model_len``, ``dtype``; ``"eagle"`` also
            ``target`` (its ``ModelState``) and ``target_hf_config``.
    """

    def __init__(self, config: SpeculativeConfig, device: torch.device, **draft_args):
        self.config = config
        self.k = config.num_speculative_tokens
        self.device = torch.device(device)
        self.stats = SpecDecodeStats(self.k)
        self.draft = None
        self.probabilistic = config.verification == "probabilistic"
        # ``expand``'s device index tensors by (num_scheduled, K_b) of the batch: a run of
        # uniform decode steps repeats its key, so it pays one copy, not one per step.
        # NOTE: the cached tensors are only ever read (indices), never written.
        self._expand_cache: OrderedDict[tuple, tuple[torch.Tensor, ...]] = OrderedDict()
        if config.method == "draft_model":
            from mrv2.spec_decode.draft_model import DraftModelProposer

            self.draft = DraftModelProposer(
                config.model, draft_args["vocab_size"], draft_args["num_blocks"],
                draft_args["block_size"], draft_args["max_model_len"], draft_args["dtype"],
                self.device, keep_probs=self.probabilistic)
        elif config.method == "eagle":
            from mrv2.spec_decode.eagle import EagleProposer

            self.draft = EagleProposer(
                config.model, draft_args["target"], draft_args["target_hf_config"],
                draft_args["num_blocks"], draft_args["block_size"],
                draft_args["max_model_len"], draft_args["dtype"], self.device,
                keep_probs=self.probabilistic)

    def expand(self, batch, num_scheduled: list[int], num_spec_tokens: dict[str, int]
               ) -> SpecRows:
        """The step's logits rows (CPU-known indices, copied once per batch shape; no sync).

        Args:
            batch: the step's ``InputBatch``.
            num_scheduled: ``[B]`` tokens per request, in batch order.
            num_spec_tokens: ``SchedulerOutput.num_spec_tokens`` (request -> K_b).
        """
        num_reqs = batch.num_reqs
        ks = [num_spec_tokens.get(r, 0) for r in batch.req_ids]
        key = (tuple(num_scheduled), tuple(ks))
        cached = self._expand_cache.get(key)
        if cached is None:
            cached = self._expand_indices(num_scheduled, ks, num_reqs)
            if len(self._expand_cache) >= EXPAND_CACHE_SIZE:
                self._expand_cache.pop(next(iter(self._expand_cache)))  # the oldest
            self._expand_cache[key] = cached
        else:
            self._expand_cache.move_to_end(key)
        logits_indices, slot, back, gather, num_spec = cached
        return SpecRows(
            logits_indices=logits_indices,
            idx_mapping=batch.idx_mapping[slot],                            # [N]
            positions=batch.seq_lens[slot].to(torch.int64) - back,          # [N]
            gather=gather, num_spec_tokens=num_spec)

    def _expand_indices(self, num_scheduled: list[int], ks: list[int], num_reqs: int
                        ) -> tuple[torch.Tensor, ...]:
        """``expand``'s index tensors on the device (one host->device copy)."""
        idx = expand_rows_np(num_scheduled, ks, self.k)
        n = idx["slot"].size
        packed = np.concatenate([idx["logits_indices"], idx["slot"], idx["back"],
                                 idx["gather"].ravel(), np.asarray(ks, dtype=np.int64)])
        dev = to_device_async(packed, self.device)                         # [3N + B(K+2)]
        gather = dev[3 * n:3 * n + num_reqs * (self.k + 1)].view(num_reqs, self.k + 1)
        num_spec = dev[3 * n + num_reqs * (self.k + 1):].to(torch.int32)   # [B]
        return dev[:n], dev[n:2 * n], dev[2 * n:3 * n], gather, num_spec

    def verify(self, runner, batch, rows: SpecRows, logits: torch.Tensor, req_rows: list[int]
               ) -> tuple[VerifyOutput, tuple | None]:
        """The target's side: rules (and samples), then acceptance of the drafts (no sync).

        Args:
            runner: the ``ModelRunner`` (its sampler and state table).
            batch: the step's ``InputBatch``.
            rows: from ``expand``.
            logits: ``[N, V]`` the model's logits of the expanded rows.
            req_rows: the batch's state rows (CPU ints: the sampling flags).

        Returns:
            ``(VerifyOutput, logprobs)``; logprobs ``(ids [B, K+1, k+1], logprobs
            [B, K+1, k+1], ranks [B, K+1])`` of the raw logits of the returned tokens, or
            ``None`` when no row asked for them.
        """
        state, num_reqs = runner.state, batch.num_reqs
        idx_mapping = batch.idx_mapping[:num_reqs]                          # [B]
        if not self.probabilistic:
            out = runner.sampler(logits, rows.idx_mapping, rows.positions, req_rows, state)
            # One launch: drafts through idx_mapping, samples through gather, draft count.
            acc = exact_accept_rows(state.draft_token_ids, idx_mapping, out.sampled,
                                    rows.gather, rows.num_spec_tokens)
            verified = VerifyOutput(acc.output_token_ids, acc.num_output_tokens,
                                    acc.num_accepted, None)
            rows.num_draft_tokens = acc.num_draft_tokens
            logprobs = None
            if out.logprobs is not None:
                ids, lps, ranks = out.logprobs
                logprobs = (ids[rows.gather], lps[rows.gather], ranks[rows.gather])
            return verified, logprobs
        drafts = state.draft_token_ids[idx_mapping.long()]                  # [B, K]
        ruled, raw, max_logprobs, meta = runner.sampler.apply_rules(
            logits, rows.idx_mapping, req_rows, state, force_float=True)
        flat = rows.gather.view(-1)                                         # [B * (K + 1)]
        j = torch.arange(self.k, device=drafts.device)
        # Drafts past K_b are not verified: -1, "no draft" (the row samples from p).
        drafts = torch.where(j[None, :] < rows.num_spec_tokens[:, None], drafts, -1)
        rows.num_draft_tokens = (drafts >= 0).sum(1)                        # [B]
        # Row j of request b samples position seq_len - K_b + j: base = seq_len - K_b - 1.
        base = batch.seq_lens[:num_reqs].to(torch.int64) - rows.num_spec_tokens - 1  # [B]
        q = None if self.draft is None else self.draft.kept_probs(idx_mapping, state)
        verified = probabilistic_verify(ruled[flat], drafts, idx_mapping, base, state, q,
                                        needs_top_k_top_p=meta.needs_top_k_top_p)
        logprobs = None
        if raw is not None:
            # NOTE: the returned tokens are not the sampler's: score them on the raw rows.
            tokens = verified.output_token_ids.view(-1).clamp(min=0).long()  # [B * (K + 1)]
            ids, lps, ranks = compute_topk_logprobs(raw[flat], max_logprobs, tokens)
            shape = (num_reqs, self.k + 1)
            logprobs = (ids.view(*shape, -1), lps.view(*shape, -1), ranks.view(shape))
        return verified, logprobs

    def capture_cuda_graphs(self, runner, make_dummy_batch, progress: bool = False) -> None:
        """The proposer's CUDA graphs (the draft model's; n-gram needs none).

        A model proposer may define ``capture_cuda_graphs(runner, make_dummy_batch, k,
        progress)``; without it, it runs eagerly (its ``propose`` gets ``graph_size`` all
        the same).

        Args:
            runner: the ``ModelRunner`` (its graph keys, buffers and state table).
            make_dummy_batch: writes an all-padding batch of a graph key's shape.
            progress: show a progress bar.
        """
        capture = getattr(self.draft, "capture_cuda_graphs", None)
        if capture is not None:
            capture(runner, make_dummy_batch, self.k, progress)

    def finish(self, runner, batch, rows: SpecRows, verified: VerifyOutput, logprobs,
               prompt_logprobs: dict, req_rows: list[int], graph_size=None,
               hidden=None) -> AsyncOutput:
        """Append the accepted runs, propose the next drafts; the step's output.

        Args:
            runner: the ``ModelRunner`` (its state table, buffers and penalties).
            batch: the step's ``InputBatch``.
            rows: from ``expand``.
            verified: from ``verify``.
            logprobs: from ``verify``.
            prompt_logprobs: as for ``AsyncOutput``.
            req_rows: the batch's state rows (CPU ints: the sampling flags are read from them).
            graph_size: the graph key the target step replayed (``None``: eager).
            hidden: ``[T_pad, H]`` the target's hidden states of the step (EAGLE reads them).
        """
        state, num_reqs = runner.state, batch.num_reqs
        idx_mapping = batch.idx_mapping                                     # [B_pad]
        output_tokens, num_sampled = verified.output_token_ids, verified.num_output_tokens
        num_drafts = rows.num_draft_tokens  # [B], counted by verify
        penalties = runner.sampler.states.penalties
        if penalties is not None:
            # NOTE: a penalized request never speculates: its one token is column 0.
            penalties.update(idx_mapping, runner.buffers.num_scheduled_tokens,
                                    output_tokens[:, 0], num_reqs, state)
        spec_post_update(idx_mapping, runner.buffers.num_scheduled_tokens,
                         rows.num_spec_tokens, output_tokens, num_sampled, num_reqs, state)
        # The next drafts, read from the updated rows, into the draft slots.
        cfg = self.config
        if self.draft is not None:
            states = runner.sampler.states
            meta = SamplingMetadata(all_greedy=states.all_greedy(req_rows),
                                    needs_top_k_top_p=states.needs_top_k_top_p(req_rows))
            extra = {"hidden": hidden} if cfg.method == "eagle" else {}
            next_drafts = self.draft.propose(batch, runner, self.k, meta,
                                             graph_size=graph_size, **extra)
        else:
            next_drafts, _ = ngram_propose(idx_mapping[:num_reqs], state.token_ids,
                                           state.total_len, self.k, cfg.prompt_lookup_min,
                                           cfg.prompt_lookup_max)
        write_draft_slots(next_drafts, idx_mapping, num_reqs, state)
        out = AsyncOutput(batch.req_ids, output_tokens, logprobs, prompt_logprobs,
                          num_sampled=num_sampled, num_draft_tokens=num_drafts)
        if cfg.sync_accepted_counts:
            # NOTE: the deliberate V1-style sync this option exists to measure.
            out.synced_num_sampled = num_sampled.tolist()
        return out
