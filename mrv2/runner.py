"""ModelRunner (V2): the common execution path of one step, and nothing else.

``execute_model`` turns a ``SchedulerOutput`` into sampled tokens:

1. free the state rows of finished/preempted requests, add new ones, append new
   KV block ids — all staged on the CPU and applied in one kernel launch each;
2. send ``idx_mapping`` (batch slot -> state row) and the token counts to the
   device, then build ``input_ids``, ``positions``, ``query_start_loc``,
   ``seq_lens``, the gathered block table and ``slot_mapping`` with Triton kernels;
3. run the model on the flat batch, take the logits of the last token of each
   request, sample, and let the post-update kernel append the sampled tokens to
   the state table on the device.

The sampled ids stay on the device; the returned ``AsyncOutput`` copies them to
pinned host memory on a side stream, and the engine reads them one step later
(``get_output``). The model-specific part (attention metadata, embeddings, CUDA
graphs) goes through a ``ModelState``. Nothing here waits for the GPU. See
notebooks/04_triton_input_prep.ipynb, 07_async_streams.ipynb and
08_model_state_and_cuda_graphs.ipynb.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from mrv2.async_output import AsyncOutput
from mrv2.block_table import BlockTables
from mrv2.config import CacheConfig, SchedulerConfig
from mrv2.cuda_graphs import graph_shape, make_graph_manager
from mrv2.input_batch import InputBatch, InputBuffers, prepare_input_batch
from mrv2.kernels.top_k_top_p import reserve_top_k_top_p_workspace
from mrv2.kv_cache import cdiv
from mrv2.model_state import ModelState
from mrv2.runner_interface import RunnerInterface
from mrv2.sample import Sampler, SamplingStates
from mrv2.sample.prompt_logprobs import PromptLogprobsAccumulator
from mrv2.scheduler import SchedulerOutput
from mrv2.spec_decode.verify_step import SpecDecodeStep
from mrv2.state import RequestStateTable, apply_scheduler_output


class ModelRunner(RunnerInterface):
    """Executes scheduled steps on one device with a stable request-state table.

    Args:
        model: a ``Qwen3ForCausalLM`` (flat tokens, paged KV cache).
        hf_config: its Hugging Face config.
        scheduler_config: step limits (rows of the state table, token budget, length).
        cache_config: the KV block size.
        num_blocks: KV blocks to allocate per layer.
        device, dtype: where and in what precision.
        enforce_eager: no CUDA graphs (there are none on the CPU anyway).
        prefill_graphs: also capture graphs for small prefill / mixed steps
            (``mrv2.cuda_graphs``); off: only uniform decode steps replay a graph.
        logits_processors: ``LogitsProcessor`` instances, or factories called as
            ``factory(max_num_reqs, device)``, applied to every step's logits in order
            (held by the sampler's ``SamplingStates``).
        model_state_cls: the ``ModelState`` class to use (default: ``ModelState``),
            built as ``model_state_cls(model, max_model_len)``.
        speculative_config: a checked speculative config (``mrv2/spec_decode/``), or ``None``.
    """

    def __init__(self, model, hf_config, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, num_blocks: int, device: torch.device,
                 dtype: torch.dtype, enforce_eager: bool = False, logits_processors=(),
                 model_state_cls: type[ModelState] = ModelState, prefill_graphs: bool = True,
                 speculative_config=None):
        self.model_state = model_state_cls(model, scheduler_config.max_model_len)
        self.device = torch.device(device)
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        self.block_size = cache_config.block_size
        self.dims = model_state_cls.model_dims(hf_config)  # layers, heads, head_dim, vocab
        self.vocab_size = self.dims.vocab_size
        # Speculative decoding: K draft slots per state row, and the per-step logic.
        self.spec = (None if speculative_config is None else SpecDecodeStep(
            speculative_config, self.device, vocab_size=self.vocab_size, num_blocks=num_blocks,
            block_size=self.block_size, max_model_len=self.max_model_len, dtype=dtype,
            target=self.model_state, target_hf_config=hf_config))
        self.state = RequestStateTable(
            self.max_num_reqs, scheduler_config.max_model_len, device,
            num_speculative_tokens=0 if self.spec is None else self.spec.k)
        self.block_tables = BlockTables(
            self.max_num_reqs, cdiv(scheduler_config.max_model_len, self.block_size),
            self.block_size, self.max_num_tokens, device)
        self.buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, device)
        self.kv_caches = model_state_cls.make_kv_caches(model, hf_config, num_blocks,
                                                        self.block_size, dtype, self.device)
        # Every per-row sampling setting, rule and history lives in the sampler's states.
        self.sampler = Sampler(SamplingStates(self.max_num_reqs, self.vocab_size, device,
                                              logits_processors))
        # NOTE: the top-k/top-p scratch is sized here, once: no step allocates it.
        reserve_top_k_top_p_workspace(
            self.max_num_reqs * (1 + (0 if self.spec is None else self.spec.k)),
            self.vocab_size, self.device)
        self.prompt_logprobs = PromptLogprobsAccumulator(self.model_state.compute_logits)
        self.timeline = None  # a mrv2.timeline.Timeline, set by the engine when recording
        use_graphs = self.device.type == "cuda" and not enforce_eager
        self.cuda_graphs = make_graph_manager(
            self.max_num_reqs, self.max_num_tokens, use_graphs, prefill_graphs,
            num_speculative_tokens=0 if self.spec is None else self.spec.k)

    @property
    def spec_decode_stats(self):
        """Acceptance counts of speculative decoding (``None`` without it)."""
        return None if self.spec is None else self.spec.stats

    def capture_cuda_graphs(self, progress: bool = True) -> None:
        """Capture the forward pass at every graph key (a no-op without graphs)."""
        if self.cuda_graphs.enabled:
            self.model_state.capture_cuda_graphs(self.cuda_graphs, self._dummy_batch, progress)
            if self.spec is not None:  # the draft model's own graphs (same keys)
                self.spec.capture_cuda_graphs(self, self._dummy_batch, progress)

    def precompile_attention(self, progress: bool = False) -> int:
        """Compile every paged-attention launch variant this runner can pick (a server's
        warm-up: see ``mrv2/kernels/attention_warmup.py``); returns how many."""
        from mrv2.kernels.attention_warmup import launch_variants, precompile

        dims = self.dims
        variants = launch_variants(dims.num_heads, dims.num_kv_heads, dims.head_dim,
                                   self.max_num_reqs, self.max_model_len,
                                   max_query_len=max(32, 1 + (self.spec.k if self.spec else 0)))
        width = self.block_tables.input_block_table.shape[1]
        n = precompile(self.kv_caches[0], dims.num_heads, width, variants, progress=progress)
        from mrv2.kernels import attention, decode_attention
        if attention.may_order(self.max_num_reqs, self.max_model_len):
            # large decode batches read a request order (ModelState.forward, longest_first)
            n += precompile(self.kv_caches[0], dims.num_heads, width, launch_variants(
                dims.num_heads, dims.num_kv_heads, dims.head_dim, self.max_num_reqs,
                self.max_model_len, max_query_len=1, min_num_reqs=attention.ORDER_MIN_REQS),
                ordered=True)
        from mrv2.kernels import decode_heads
        if decode_heads.ENABLED and self.max_num_reqs >= decode_heads.MIN_REQS:
            from mrv2.kernels.attention_warmup import precompile_decode_heads
            n += precompile_decode_heads(
                self.kv_caches[0], dims.num_heads, width,
                ordered=attention.may_order(self.max_num_reqs, self.max_model_len))
        if decode_attention.ENABLED:  # the decode steps' fused RoPE + attention kernel
            from mrv2.kernels.attention_warmup import precompile_decode_rope
            from mrv2.models.qwen3 import rope_inputs
            n += precompile_decode_rope(
                self.kv_caches[0], dims.num_heads, width,
                # NOTE: only decode steps of <= MAX_TOKENS tokens take it (one per request)
                launch_variants(dims.num_heads, dims.num_kv_heads, dims.head_dim,
                                min(self.max_num_reqs, decode_attention.MAX_TOKENS),
                                self.max_model_len, max_query_len=1,
                                pick=decode_attention.pick_config),
                *rope_inputs(self.model_state.model), self.kv_caches[0].dtype)
        return n

    def _dummy_batch(self, size) -> InputBatch:
        """An all-padding batch of a graph key's shape in the static buffers."""
        num_reqs, num_tokens, max_query_len = graph_shape(size)
        return prepare_input_batch(self.buffers, self.state, self.block_tables, [], [], [],
                                   max_query_len=max_query_len, max_seq_len=self.max_model_len,
                                   num_reqs_padded=num_reqs, num_tokens_padded=num_tokens)

    def _phase(self, name: str):
        """Timeline hook: a GPU mark and a CPU span named ``name`` (no-op when off)."""
        if self.timeline is None:
            return contextlib.nullcontext()
        self.timeline.gpu_mark(name)
        return self.timeline.cpu(name)

    # -- state updates (staged, one launch each) ---------------------------------

    def validate_params(self, sampling_params, num_eos_ids: int = 0) -> None:
        """Raise ``ValueError`` naming the field when a request exceeds a per-row capacity."""
        self.sampler.states.validate(sampling_params, num_eos_ids)

    def _update_states(self, sched: SchedulerOutput) -> None:
        apply_scheduler_output(sched, self.state, self.block_tables, self.sampler.states)
        for req_id in sched.finished_req_ids:
            if req_id not in sched.preempted_req_ids:  # a preempted request keeps its results
                self.prompt_logprobs.remove_request(req_id)
        for new in sched.new_reqs:
            if new.request.sampling_params.prompt_logprobs is not None:
                self.prompt_logprobs.add_request(new.req_id, new.prefill_token_ids[:new.prompt_len],
                                                 new.request.sampling_params.prompt_logprobs)

    # -- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> AsyncOutput:
        """Launch one scheduled step; returns before the GPU has finished it."""
        with self._phase("prep"):
            self._update_states(sched)
            if sched.is_empty:
                return AsyncOutput([], None)
            req_ids = list(sched.num_scheduled_tokens)
            rows = self.state.rows_of(req_ids)
            num_scheduled = list(sched.num_scheduled_tokens.values())  # in req_ids' order
            num_reqs = len(rows)
            max_query_len = max(num_scheduled)
            # A uniform decode batch replays the CUDA graph of the next captured size, a
            # speculating one (1 + K tokens each) a speculating decode graph, a small
            # prefill / mixed batch the smallest prefill graph that holds it.
            graph_size = self.cuda_graphs.graph_for(num_reqs, sched.total_num_scheduled_tokens,
                                                    max_query_len)
            reqs_pad, tokens_pad, _ = (graph_shape(graph_size) if graph_size is not None
                                       else (None, None, None))
            batch = prepare_input_batch(self.buffers, self.state, self.block_tables, req_ids, rows,
                                        num_scheduled, max_query_len=max_query_len,
                                        max_seq_len=sched.max_seq_len,
                                        num_reqs_padded=reqs_pad, num_tokens_padded=tokens_pad)
        with self._phase("forward"):
            hidden = self.model_state.run(batch, graph_size)                  # [T_pad, hidden]
        with self._phase("sample"):
            out = self._sample(batch, rows, num_scheduled, hidden, sched.num_spec_tokens,
                               graph_size)
        if self.timeline is not None:
            self.timeline.gpu_mark("end")
        return out

    def _sample(self, batch: InputBatch, rows: list[int], num_scheduled: list[int],
                hidden: torch.Tensor, num_spec_tokens: dict | None = None,
                graph_size=None) -> AsyncOutput:
        """Logits rows -> sampler -> append the samples (or verify the drafts).

        Without speculation each request gives one logits row, its last token's; with it,
        every query token of a speculating request gives one (``N >= B`` rows;
        ``mrv2/spec_decode/verify_step.py``); ``graph_size`` is the step's graph key (the
        draft model replays its own graph of that key)."""
        num_reqs = batch.num_reqs
        idx_mapping, _, _, positions, logits_indices = self.buffers.req_views(num_reqs)  # [B]
        # (positions: the sampled token sits at position seq_len)
        spec_rows = None
        if self.spec is not None:
            spec_rows = self.spec.expand(batch, num_scheduled, num_spec_tokens or {})
            logits_indices, idx_mapping, positions = (
                spec_rows.logits_indices, spec_rows.idx_mapping, spec_rows.positions)
        # NOTE: index_select, not hidden[logits_indices]: the same rows, but advanced
        # indexing's host path is ~5x dearer (65 vs 12 us at 256 x 256 on a CPU).
        logits = self.model_state.compute_logits(
            torch.index_select(hidden, 0, logits_indices))                    # [N, V]
        if spec_rows is not None:  # verify, append the accepted runs, propose the next drafts
            verified, logprobs = self.spec.verify(self, batch, spec_rows, logits, rows)
            prompt_logprobs = self._prompt_logprobs(batch.req_ids, num_scheduled, hidden)
            return self.spec.finish(self, batch, spec_rows, verified, logprobs,
                                    prompt_logprobs, rows, graph_size,
                                    hidden=hidden)  # EAGLE reads it
        # NOTE: the sampler indexes its per-row CPU flags with ``rows`` several times: an
        # array once, not a list converted by every index (~15 us each at batch 256).
        out = self.sampler(logits, idx_mapping, positions, np.asarray(rows, dtype=np.int64),
                           self.state)
        prompt_logprobs = self._prompt_logprobs(batch.req_ids, num_scheduled, hidden)
        self.sampler.states.append_sampled(batch.idx_mapping, self.buffers.num_scheduled_tokens,
                                           out.sampled, num_reqs, self.state)
        return AsyncOutput(batch.req_ids, out.sampled, out.logprobs, prompt_logprobs)

    def _prompt_logprobs(self, req_ids, num_scheduled, hidden) -> dict:
        """Feed this step's hidden states of prompt tokens to the accumulator (chunked)."""
        done = {}
        if not self.prompt_logprobs:
            return done
        start = 0
        for req_id, n in zip(req_ids, num_scheduled):
            if req_id in self.prompt_logprobs:
                self.prompt_logprobs.add_step(req_id, hidden[start:start + n])  # [n, hidden]
                if self.prompt_logprobs.is_complete(req_id):
                    tensors = self.prompt_logprobs.take_tensors(req_id)
                    if tensors is not None:
                        done[req_id] = tensors
            start += n
        return done
