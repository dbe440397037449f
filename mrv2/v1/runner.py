"""V1ModelRunner: the V1-style baseline, same model, same kernels, same API as V2.

One step of ``execute_model``:

1. update the CPU state: drop finished requests, create a ``CachedRequestState`` for
   each new one, append new KV block ids, take requests that are not scheduled this
   step out of the persistent batch and put back the ones that are, ``condense()``
   the holes away and swap rows into the scheduler's order (input_batch.py);
2. build ``input_ids``, ``positions``, ``query_start_loc``, ``seq_lens`` and
   ``slot_mapping`` with numpy on the CPU, then copy them to fixed device buffers
   through pinned memory;
3. run the model, sample (sampler.py), and copy the sampled ids to the host with
   ``.tolist()`` -- the V1 sync point: the next step cannot be prepared before the
   GPU has finished this one, because its inputs are built from these ids on the CPU;
4. append each sampled id to its ``CachedRequestState`` and to ``token_ids_cpu``.

Steps 1, 2 and 4 are Python/numpy work on the host proportional to the batch,
and step 3 leaves the GPU idle while they run: the host overhead that V2 removes
(Triton input prep from a device state table, no backup copies, async outputs).
See notebooks/00_overview.ipynb.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.async_output import StepOutput
from mrv2.config import CacheConfig, SchedulerConfig
from mrv2.cuda_graphs import CudaGraphManager, capture_sizes, graph_shape, prefill_capture_sizes
from mrv2.forward_context import AttentionMetadata, set_forward_context
from mrv2.model_state import ModelState
from mrv2.runner_interface import RunnerInterface
from mrv2.sampling_params import SamplingParams
from mrv2.scheduler import SchedulerOutput
from mrv2.v1.input_batch import InputBatch
from mrv2.v1.request_state import CachedRequestState
from mrv2.v1.sampler import Sampler


class V1ModelRunnerOutput:
    """A step's results, already on the host (V1 synchronised before returning)."""

    def __init__(self, output: StepOutput):
        self._output = output

    def get_output(self) -> StepOutput:
        return self._output


class V1ModelRunner(RunnerInterface):
    """Executes scheduled steps with a persistent batch and CPU-built inputs.

    Args: exactly those of ``mrv2.runner.ModelRunner``.
        model: a ``Qwen3ForCausalLM``; hf_config: its Hugging Face config.
        scheduler_config: step limits; cache_config: the KV block size.
        num_blocks: KV blocks to allocate per layer.
        device, dtype: where and in what precision.
        enforce_eager: no CUDA graphs. Otherwise, on a GPU, uniform decode batches replay
            full CUDA graphs over the fixed input buffers, as V2 does (V1 captured
            piecewise graphs; a full graph is the fairer match for the V2 comparison).
        prefill_graphs: small prefill / mixed steps replay graphs too, as in V2 (vLLM's
            V1 covered them with its piecewise graphs).
        logits_processors: must be empty (``ValueError`` otherwise).
    """

    def __init__(self, model, hf_config, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, num_blocks: int, device: torch.device,
                 dtype: torch.dtype, enforce_eager: bool = False, logits_processors=(),
                 prefill_graphs: bool = True):
        if logits_processors:
            raise ValueError("logits_processors are not supported by the V1 baseline runner; "
                             "use runner='v2'")
        self.model = model
        self.device = torch.device(device)
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.vocab_size = ModelState.model_dims(hf_config).vocab_size
        # One [2, num_blocks, block_size, H_kv, D] cache per layer, as the V2 runner.
        self.kv_caches = ModelState.make_kv_caches(model, hf_config, num_blocks,
                                                   cache_config.block_size, dtype, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_tokens,
                                      cache_config.block_size, self.vocab_size, self.device)
        self.sampler = Sampler()

        # Per-step inputs: pinned CPU staging (numpy views) and device buffers at fixed
        # addresses, sized for the largest step, so a CUDA graph could replay over them.
        def buffers(n, dtype):
            cpu = torch.zeros(n, dtype=dtype, pin_memory=self.device.type == "cuda")
            return cpu, cpu.numpy(), torch.zeros(n, dtype=dtype, device=self.device)

        T, R = self.max_num_tokens, self.max_num_reqs
        self.input_ids_cpu, self.input_ids_np, self.input_ids = buffers(T, torch.int32)
        self.positions_cpu, self.positions_np, self.positions = buffers(T, torch.int64)
        self.query_start_loc_cpu, self.query_start_loc_np, self.query_start_loc = \
            buffers(R + 1, torch.int32)
        self.seq_lens_cpu, self.seq_lens_np, self.seq_lens = buffers(R, torch.int32)
        self.arange_np = np.arange(max(T, R) + 1, dtype=np.int64)
        use_graphs = self.device.type == "cuda" and not enforce_eager
        self.cuda_graphs = CudaGraphManager(
            capture_sizes(R) if use_graphs else [],
            prefill_capture_sizes(R, T) if use_graphs and prefill_graphs else [])

    # -- CUDA graphs (the same manager as V2) ----------------------------------------------

    def _graph_metadata(self, size) -> AttentionMetadata:
        """Attention metadata over the fixed buffers for a padded batch of a graph key."""
        num_reqs, num_tokens, max_query_len = graph_shape(size)
        bt = self.input_batch.block_table
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
            block_table=bt.block_table[:num_reqs], slot_mapping=bt.slot_mapping[:num_tokens],
            max_query_len=max_query_len, max_seq_len=self.max_model_len)

    def capture_cuda_graphs(self, progress: bool = True) -> None:
        """Capture the forward pass at every graph key (a no-op without graphs)."""
        if not self.cuda_graphs.enabled:
            return

        def prepare(size):  # an all-padding batch: empty queries, no slots
            self.query_start_loc.zero_()
            self.seq_lens.zero_()
            self.input_batch.block_table.slot_mapping.fill_(-1)
            return size

        def forward(size, _) -> torch.Tensor:
            num_tokens = graph_shape(size)[1]
            with set_forward_context(self._graph_metadata(size)):
                return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])

        self.cuda_graphs.capture(prepare, forward, progress=progress)

    def validate_params(self, sampling_params: SamplingParams, num_eos_ids: int = 0) -> None:
        """Raise ``ValueError`` naming a sampling feature this baseline does not implement."""
        sp = sampling_params
        unsupported = {
            "presence_penalty": sp.presence_penalty != 0.0,
            "frequency_penalty": sp.frequency_penalty != 0.0,
            "repetition_penalty": sp.repetition_penalty != 1.0,
            "logit_bias": bool(sp.logit_bias),
            "allowed_token_ids": sp.allowed_token_ids is not None,
            "prompt_logprobs": sp.prompt_logprobs is not None,
            "bad_words": bool(sp.bad_words),
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"SamplingParams.{name} is not supported by the V1 baseline "
                                 "runner; use runner='v2'")
        if sp.logprobs is not None and sp.logprobs > self.vocab_size:
            raise ValueError(f"SamplingParams.logprobs={sp.logprobs} exceeds the vocabulary "
                             f"size {self.vocab_size}")

    # -- 1. state updates on the CPU ---------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        """Bring the backups and the persistent batch to this step's plan.

        Afterwards row ``i`` of the batch holds the ``i``-th scheduled request.
        """
        batch = self.input_batch
        for req_id in sched.finished_req_ids:
            batch.remove_request(req_id)
            # NOTE: a preempted request keeps its cached state (as in V1) so that its
            # generator, re-used when it comes back, continues its seeded stream.
            if req_id not in sched.preempted_req_ids:
                self.requests.pop(req_id, None)
        for new in sched.new_reqs:
            old = self.requests.get(new.req_id)
            sp = new.request.sampling_params
            generator = old.generator if old is not None else None
            if generator is None and new.request.user_seeded:
                generator = torch.Generator(self.device).manual_seed(sp.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prefill_token_ids[:new.prompt_len]),
                list(new.prefill_token_ids[new.prompt_len:]), sp, list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, generator=generator)
        for req_id, block_ids in sched.new_block_ids.items():
            self.requests[req_id].block_ids.extend(block_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is not None:
                batch.block_table.append_row(block_ids, row)
        # Requests not scheduled this step leave the batch (their cached state stays);
        # scheduled ones that are not in it (new, or back after a pause) come in.
        scheduled = sched.num_scheduled_tokens
        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove_request(req_id)
        for req_id in scheduled:
            if req_id not in batch.req_id_to_index:
                batch.add_request(self.requests[req_id])
        batch.condense()
        # Put the rows in the scheduler's order (the order the engine expects).
        for i, req_id in enumerate(scheduled):
            j = batch.req_id_to_index[req_id]
            if j != i:
                batch.swap_states(i, j)

    # -- 2. inputs built with numpy, then copied ------------------------------------------

    def _prepare_inputs(self, num_scheduled: np.ndarray) -> tuple[AttentionMetadata, torch.Tensor]:
        """Fill and copy the step's inputs for rows ``0..num_reqs-1``.

        Args:
            num_scheduled: ``[num_reqs]`` tokens of each row this step.

        Returns:
            The attention metadata and ``logits_indices`` ``[num_reqs]`` (device).
        """
        batch = self.input_batch
        n, T = len(num_scheduled), int(num_scheduled.sum())
        req_indices = np.repeat(self.arange_np[:n], num_scheduled)         # [T] row of token
        cu_num_tokens = np.cumsum(num_scheduled)                            # [n]
        # Offset of each token inside its request's chunk: 0, 1, .., 0, 1, ..
        offsets = self.arange_np[:T] - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        positions = self.positions_np[:T]                                   # [T] view
        np.add(batch.num_computed_tokens_cpu[req_indices], offsets, out=positions)
        token_indices = req_indices * batch.token_ids_cpu.shape[1] + positions  # [T]
        np.take(batch.token_ids_cpu.ravel(), token_indices, out=self.input_ids_np[:T])
        self.query_start_loc_np[0] = 0
        self.query_start_loc_np[1:n + 1] = cu_num_tokens
        self.query_start_loc_np[n + 1:] = T  # padding rows: empty queries
        seq_lens = batch.num_computed_tokens_cpu[:n] + num_scheduled        # [n]
        self.seq_lens_np[:n] = seq_lens
        self.seq_lens_np[n:] = 0
        batch.block_table.compute_slot_mapping(req_indices, positions)

        # Host -> device, non-blocking from pinned memory.
        self.input_ids[:T].copy_(self.input_ids_cpu[:T], non_blocking=True)
        self.positions[:T].copy_(self.positions_cpu[:T], non_blocking=True)
        self.query_start_loc.copy_(self.query_start_loc_cpu, non_blocking=True)
        self.seq_lens.copy_(self.seq_lens_cpu, non_blocking=True)
        batch.block_table.commit(n, T)
        md = AttentionMetadata(
            query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
            block_table=batch.block_table.block_table[:n],
            slot_mapping=batch.block_table.slot_mapping[:T],
            max_query_len=int(num_scheduled.max()), max_seq_len=int(seq_lens.max()))
        return md, self.query_start_loc[1:n + 1] - 1

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> V1ModelRunnerOutput:
        """Run one scheduled step; returns after the sampled ids reached the host."""
        self._update_states(sched)
        if sched.is_empty:
            return V1ModelRunnerOutput(StepOutput([], []))
        batch = self.input_batch
        req_ids = batch.req_ids
        num_scheduled = np.array([sched.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        attn_metadata, logits_indices = self._prepare_inputs(num_scheduled)
        T = int(num_scheduled.sum())
        graph_size = self.cuda_graphs.graph_for(len(req_ids), T)
        if graph_size is not None:  # padding: seq_len 0, slot -1 (_prepare_inputs, commit)
            hidden = self.cuda_graphs.replay(graph_size)                    # [size, hidden]
        else:
            with set_forward_context(attn_metadata):
                hidden = self.model(self.input_ids[:T], self.positions[:T])  # [T, hidden]
        logits = self.model.compute_logits(hidden[logits_indices])         # [B, V]

        # A row whose chunk stops short of its known tokens is a partial prefill: its
        # sample is thrown away, so its generator must not move (V1 rewinds it).
        reaches_end = batch.num_computed_tokens_cpu[:len(req_ids)] + num_scheduled \
            >= batch.num_tokens[:len(req_ids)]                             # [B] bool
        rewind = {row: g.get_state() for row, g in batch.generators.items()
                  if not reaches_end[row]}
        sampled, logprobs = self.sampler(logits, batch.make_sampling_metadata())
        for row, state in rewind.items():
            batch.generators[row].set_state(state)

        # The V1 sync: the ids come to the host before the next step can be built.
        sampled_ids = sampled.tolist()
        lp = None if logprobs is None else tuple(t.tolist() for t in logprobs)
        self._update_after_sampling(req_ids, num_scheduled, reaches_end, sampled_ids)
        return V1ModelRunnerOutput(StepOutput(req_ids, sampled_ids, lp, {}))

    def _update_after_sampling(self, req_ids: list[str], num_scheduled: np.ndarray,
                               reaches_end: np.ndarray, sampled_ids: list[int]) -> None:
        """Advance ``num_computed_tokens``; append real samples to the backups."""
        batch = self.input_batch
        batch.num_computed_tokens_cpu[:len(req_ids)] += num_scheduled.astype(np.int32)
        for row, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens += int(num_scheduled[row])
            if not reaches_end[row]:
                continue
            token = sampled_ids[row]
            state.output_token_ids.append(token)
            length = batch.num_tokens[row]
            if length < self.max_model_len:  # the engine ends a request at max_model_len
                batch.token_ids_cpu[row, length] = token
                batch.num_tokens[row] = length + 1
