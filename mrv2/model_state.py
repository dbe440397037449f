"""ModelState: the model-specific part of a step, behind a small interface.

V1's runner grew to thousands of lines because every model's quirks (multimodal
embeddings, M-RoPE positions, attention backends, graph capture) lived in it.
MRV2 moves them into a ``ModelState`` that the runner calls at fixed points:

1. ``prepare_attn(batch, graph_size)`` -> the ``AttentionMetadata`` of the step;
2. ``get_inputs_embeds(input_ids)`` -> input embeddings, or ``None`` to let the
   model embed the ids (the hook where a multimodal model splices in image
   features);
3. ``forward(input_ids, positions, attn_metadata)`` -> hidden states;
4. ``compute_logits(hidden)`` -> logits;
5. ``capture_cuda_graphs(graphs, make_dummy_batch)`` and ``run(batch, graph_size)``:
   warm-up and capture on dummy batches, then replay or run eagerly.

6. ``make_kv_caches`` / ``kv_bytes_per_block`` / ``model_dims``: the model's KV-cache
   layout (one tensor per layer) and its binding to the attention layers.

The runner never touches the model directly, so a new model family is a new
``ModelState``, not a new branch in the runner. ``ModelState`` itself serves
decoder-only text models (Qwen3, Llama). See
notebooks/08_model_state_and_cuda_graphs.ipynb.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from mrv2.cuda_graphs import CudaGraphManager, GraphKey, graph_shape
from mrv2.forward_context import AttentionMetadata, set_forward_context
from mrv2.input_batch import InputBatch
from mrv2.kernels import attention
from mrv2.models.qwen3 import ModelDims, bind_kv_cache, kv_cache_shape
from mrv2.models.qwen3 import model_dims as _model_dims


class ModelState:
    """Model-specific logic for decoder-only text models (the default).

    Args:
        model: a module with ``forward(input_ids, positions, inputs_embeds=None)``
            and ``compute_logits(hidden)`` (``Qwen3ForCausalLM``).
        max_model_len: the bound used for ``max_seq_len`` in captured graphs.
    """

    def __init__(self, model: torch.nn.Module, max_model_len: int):
        self.model = model
        self.max_model_len = max_model_len
        self.graphs: CudaGraphManager | None = None

    # -- the KV-cache layout (class-level: the engine sizes the pool before any runner) ---

    @classmethod
    def model_dims(cls, hf_config) -> ModelDims:
        """Layer / head / vocabulary sizes read from a Hugging Face config."""
        return _model_dims(hf_config)

    @classmethod
    def kv_bytes_per_block(cls, hf_config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one KV block takes over all layers (sizes the pool)."""
        shape = kv_cache_shape(hf_config, 1, block_size)
        elem = torch.empty((), dtype=dtype).element_size()
        return cls.model_dims(hf_config).num_layers * math.prod(shape) * elem

    @classmethod
    def make_kv_caches(cls, model: torch.nn.Module, hf_config, num_blocks: int,
                       block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
        """Allocate one zeroed KV cache per layer and bind it to the model's attention.

        Returns:
            The caches, each ``[2, num_blocks, block_size, H_kv, D]``.
        """
        shape = kv_cache_shape(hf_config, num_blocks, block_size)
        kv_caches = [torch.zeros(shape, dtype=dtype, device=device)  # [2, blocks, bs, H_kv, D]
                     for _ in range(cls.model_dims(hf_config).num_layers)]
        bind_kv_cache(model, kv_caches)
        return kv_caches

    # -- the per-step interface --------------------------------------------------

    def prepare_attn(self, batch: InputBatch, graph_size: GraphKey | None = None
                     ) -> AttentionMetadata:
        """The step's attention metadata.

        Args:
            batch: the prepared inputs (its ``attn_metadata`` holds the exact bounds).
            graph_size: the key of the graph the step replays (a decode batch size, or
                ``(num_reqs, num_tokens)`` of a prefill graph): then the host-side bounds
                must be the ones the graph was captured with.
        """
        if graph_size is None:
            return batch.attn_metadata
        # NOTE: a graph bakes host ints into its launches: use bounds valid for any step
        # it serves (max_query_len 1 for a decode graph, its token count for a prefill one).
        return dataclasses.replace(batch.attn_metadata, max_query_len=graph_shape(graph_size)[2],
                                   max_seq_len=self.max_model_len)

    def get_inputs_embeds(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """``[T, hidden]`` input embeddings, or ``None``: the model embeds ``input_ids``."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """One eager forward pass over the flat batch; returns ``[T, hidden]``."""
        embeds = self.get_inputs_embeds(input_ids)
        # Large decode batches: attention starts the longest requests first (graph-safe).
        attn_metadata = attention.longest_first(attn_metadata)
        with set_forward_context(attn_metadata):
            return self.model(input_ids, positions, inputs_embeds=embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` logits."""
        return self.model.compute_logits(hidden)

    # -- CUDA graphs ------------------------------------------------------------------

    def capture_cuda_graphs(self, graphs: CudaGraphManager,
                            make_dummy_batch: Callable[[int], InputBatch],
                            progress: bool = False) -> None:
        """Warm up and capture the forward pass at every size of ``graphs``.

        Args:
            graphs: the manager holding the sizes (and, after this, the graphs).
            make_dummy_batch: writes an all-padding decode batch of a given size into
                the static buffers and returns its ``InputBatch`` view.
        """
        def forward(batch: InputBatch, size: int) -> torch.Tensor:
            return self.forward(batch.input_ids, batch.positions, self.prepare_attn(batch, size))

        graphs.capture(make_dummy_batch, forward, progress=progress)
        self.graphs = graphs

    def run(self, batch: InputBatch, graph_size: GraphKey | None = None) -> torch.Tensor:
        """The step's hidden states ``[T_pad, hidden]``: graph replay or eager forward.

        A padded batch (``graph_size`` given) whose graph was not captured runs eagerly with
        the graph's bounds: the computation the graph would replay (``emulate`` on the CPU).
        """
        def eager() -> torch.Tensor:
            return self.forward(batch.input_ids, batch.positions,
                                self.prepare_attn(batch, graph_size))

        if graph_size is None or self.graphs is None:
            return eager()
        return self.graphs.run(graph_size, eager)
