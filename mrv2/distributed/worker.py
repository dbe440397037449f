"""One tensor-parallel rank: its slice of the model, its own V2 runner, and the step loop.

Every rank, rank 0 included, builds the same things from a :class:`RankSpec`: its model
shard (``mrv2.distributed.layers``; only its slice of each safetensors tensor is read)
and a plain ``ModelRunner`` over it, with its own state table, block tables, input
buffers, KV cache (its KV heads only) and sampler. The scheduler exists only in rank 0;
each ``SchedulerOutput`` it makes reaches every worker unchanged, so every rank applies
the same state updates, runs the same prep kernels on its own device, the same forward
(meeting the others in its all-reduces) and samples the same tokens from the same
gathered logits. Nothing but the scheduler output (and the collectives) crosses between
ranks, and a rank's step loop is the single-device one: no CPU-GPU sync.

A worker process runs :func:`worker_main`: build, report ``"loaded"``, join the group,
receive the KV pool size, report ``"ready"``, then loop on messages from rank 0 until
told to stop (``None``) or rank 0's end of the pipe closes. Any error is sent back as a
traceback, and the worker exits (its closed sockets fail rank 0's next collective).
"""

from __future__ import annotations

import functools
import pickle
import signal
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch

from mrv2 import platform
from mrv2.distributed.layers import local_config, shard_model, shard_spec, tp_layout
from mrv2.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

#: Message telling workers to capture their CUDA graphs (with rank 0, in the same order).
CAPTURE = "capture"
#: A worker keeps this many step outputs alive (their device tensors are read by a side
#: stream copy that nobody waits for on a worker), then drops the oldest.
_KEEP_OUTPUTS = 3


@dataclass
class RankSpec:
    """What every rank needs to build its shard and runner (pickled to the workers).

    Attributes:
        model_path: the Hugging Face folder (``None`` only with dummy weights).
        hf_config: the FULL model's config.
        tp_size: ranks in the group.
        port: the rendezvous port on 127.0.0.1.
        dtype, load_format, seed: as ``LLM``'s.
        scheduler_config, cache_config: the engine's (identical on every rank).
        runner_kwargs: extra ``ModelRunner`` arguments (``enforce_eager``,
            ``prefill_graphs``, ``model_state_cls``).
        timeout: seconds for the rendezvous and each collective.
    """

    model_path: str | None
    hf_config: object
    tp_size: int
    port: int
    dtype: torch.dtype
    load_format: str
    seed: int
    scheduler_config: object
    cache_config: object
    runner_kwargs: dict = field(default_factory=dict)
    timeout: float = 300.0


def rank_device(rank: int) -> torch.device:
    """``cuda:rank`` on a GPU machine (one GPU per rank), else the CPU."""
    return torch.device("cuda", rank) if platform.HAS_CUDA else torch.device("cpu")


def load_rank_model(spec: RankSpec, rank: int, device: torch.device):
    """Build rank ``rank``'s model shard and read its slice of the weights.

    Returns:
        ``(model, local_config)``: the shard in eval mode and its narrower config (what
        the rank's ``ModelRunner`` and KV cache are sized from).
    """
    from mrv2.models.loader import load_model

    layout = tp_layout(spec.hf_config, spec.tp_size, rank)
    cfg = local_config(spec.hf_config, layout)
    model, cfg = load_model(spec.model_path, spec.dtype, device, load_format=spec.load_format,
                            hf_config=cfg, seed=spec.seed,
                            prepare=functools.partial(shard_model, layout=layout),
                            shard=functools.partial(shard_spec, layout=layout))
    if not platform.HAS_CUDA:
        from mrv2.cpu_defaults import apply_cpu_threads

        apply_cpu_threads(model)
    return model, cfg


def build_runner(spec: RankSpec, model, cfg, num_blocks: int, device: torch.device):
    """The rank's ``ModelRunner`` over its shard (the same arguments on every rank)."""
    from mrv2.runner import ModelRunner

    return ModelRunner(model, cfg, spec.scheduler_config, spec.cache_config, num_blocks,
                       device, spec.dtype, **spec.runner_kwargs)


def serve(conn, runner) -> None:
    """Run every step rank 0 sends until it sends ``None``.

    Args:
        conn: this worker's end of the pipe to rank 0.
        runner: the rank's ``ModelRunner``.
    """
    outputs: deque = deque()
    while True:
        msg = pickle.loads(conn.recv_bytes())
        if msg is None:
            return
        if msg == CAPTURE:
            runner.capture_cuda_graphs(progress=False)
            continue
        outputs.append(runner.execute_model(msg))
        if len(outputs) > _KEEP_OUTPUTS:
            outputs.popleft().get_output()  # long done: releases its tensors, never waits


def worker_main(rank: int, spec: RankSpec, conn) -> None:
    """The entry point of worker process ``rank`` (``1 <= rank < tp_size``)."""
    # NOTE: Ctrl-C reaches every process of the terminal's group: rank 0 alone decides
    # (and shuts the group down if it lands inside a step).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = rank_device(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.manual_seed(spec.seed)
        model, cfg = load_rank_model(spec, rank, device)
        conn.send(("loaded", None))
        init_tensor_parallel(rank, spec.tp_size, spec.port, device, spec.timeout)
        num_blocks = conn.recv()
        runner = build_runner(spec, model, cfg, num_blocks, device)
        conn.send(("ready", None))
        serve(conn, runner)
    except EOFError:
        pass  # rank 0's end closed: it is gone, leave quietly
    except BaseException:  # noqa: BLE001 (report anything, then exit non-zero)
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        destroy_tensor_parallel()
