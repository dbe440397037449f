"""Tensor-parallel process state: the TP group, this rank, and the model's two collectives.

One process per rank joins one ``torch.distributed`` group: NCCL when the ranks run on
GPUs, gloo on the CPU (so CI runs the same path). The model needs exactly two
collectives: ``tp_all_reduce`` (sum the partial outputs of a row-parallel layer, and of
the vocab-parallel embedding) and ``tp_all_gather`` (join the vocabulary shards of the
logits). Both are no-ops at world size 1, but the TP=1 path never calls them anyway: only
the modules of ``mrv2.distributed.layers`` do, and a TP=1 model has none.
See notebooks/11_tensor_parallel.ipynb.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: Seconds a collective (and the start-up rendezvous) may wait for a peer before it fails;
#: a dead peer is noticed at once on gloo (its socket closes), this bounds the other cases.
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TPState:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


_STATE: TPState | None = None


def timeout_s() -> float:
    """``MRV2_TP_TIMEOUT_S`` (seconds), else :data:`DEFAULT_TIMEOUT_S`."""
    value = os.environ.get("MRV2_TP_TIMEOUT_S", "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(value)
    except ValueError:
        raise ValueError(f"MRV2_TP_TIMEOUT_S must be a number of seconds, got {value!r}") from None
    if t <= 0:
        raise ValueError(f"MRV2_TP_TIMEOUT_S must be > 0, got {value!r}")
    return t


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous address of a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, world_size: int, port: int, device: torch.device,
                         timeout: float | None = None) -> TPState:
    """Join the TP group (blocks until every rank has joined) and warm it up.

    Args:
        rank: this process's rank (0 drives the scheduler).
        world_size: the tensor-parallel size.
        port: the rendezvous port on 127.0.0.1 (one host).
        device: this rank's device (``cuda:rank`` or ``cpu``).
        timeout: seconds for the rendezvous and for each collective (default
            :func:`timeout_s`).

    Returns:
        The new :class:`TPState`.
    """
    global _STATE
    if _STATE is not None or dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: one "
                           "tensor-parallel LLM per process (call shutdown() on the other)")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # NCCL binds one indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    backend = backend_for(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout or timeout_s()), **kwargs)
    _STATE = TPState(rank, world_size, device, backend)
    # NOTE: NCCL connects lazily on the first collective, and a CUDA graph capture cannot
    # connect: run one collective of each kind now, eagerly.
    x = torch.ones(1, device=device)
    tp_all_reduce(x)
    tp_all_gather(x.view(1, 1))
    return _STATE


def destroy_tensor_parallel() -> None:
    """Leave the TP group (a no-op when not in one)."""
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_state() -> TPState | None:
    """The current :class:`TPState`, or ``None`` outside a TP group."""
    return _STATE


def get_tp_world_size() -> int:
    """Ranks in the TP group (1 outside one)."""
    return 1 if _STATE is None else _STATE.world_size


def get_tp_rank() -> int:
    """This process's TP rank (0 outside a group)."""
    return 0 if _STATE is None else _STATE.rank


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks, in place (capturable in a CUDA graph on NCCL).

    Args:
        x: this rank's partial result (any shape).

    Returns:
        ``x``, now holding the sum (identical on every rank).
    """
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x)
    return x


# NOTE: torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name
# warns); the GPU machine's torch 2.11 has only the old one.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x [N, C]`` along the last dim, rank order.

    Args:
        x: this rank's shard ``[N, C]`` (the same shape on every rank).

    Returns:
        ``[N, world_size * C]`` (identical on every rank).
    """
    world = get_tp_world_size()
    if world == 1:
        return x
    n, c = x.shape
    flat = torch.empty(world * n, c, dtype=x.dtype, device=x.device)    # [W * N, C], rank-major
    _all_gather_flat(flat, x.contiguous())
    return flat.view(world, n, c).permute(1, 0, 2).reshape(n, world * c)  # [N, W * C]
