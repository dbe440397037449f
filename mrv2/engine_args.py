"""The engine flags that ``generate`` and ``serve`` share (vLLM's names; argparse only, so
``--help`` imports neither torch nor the server), and the ``LLM`` keywords they give."""

from __future__ import annotations

import argparse


def add_engine_arguments(group: argparse._ArgumentGroup) -> None:
    """The sizes and modes of the engine: ``--tokenizer``, ``--dtype``, the KV and batch
    limits, ``--enforce-eager`` and ``--cudagraph-mode``."""
    group.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    group.add_argument("--dtype", default="auto")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-gpu-blocks-override", type=int, default=None)
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="bytes for the KV pool (default on the CPU: a small budget)")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--cudagraph-mode", choices=("FULL", "FULL_DECODE_ONLY", "NONE"),
                       default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM`` keywords of the flags ``add_engine_arguments`` defined."""
    return dict(  # noqa: C408 (the LLM keywords, as they read)
        tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, enforce_eager=args.enforce_eager,
        cudagraph_mode=args.cudagraph_mode)
