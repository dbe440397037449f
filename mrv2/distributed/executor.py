"""TPExecutor: rank 0's runner when ``LLM(tensor_parallel_size=N > 1)``.

It implements ``RunnerInterface``, so the engine cannot tell it from a ``ModelRunner``:
``execute_model(sched)`` sends the ``SchedulerOutput`` to every worker, then runs rank
0's own ``ModelRunner`` on it and returns rank 0's output (every rank sampled the same
tokens; see ``mrv2/distributed/worker.py``).

Transport: one ``multiprocessing`` pipe per worker, the ``SchedulerOutput`` pickled once
per step and written to each. Not ``broadcast_object_list`` on a gloo group: that is a
collective (rank 0 waits for the size, then the payload, to reach every rank), needs a
second process group beside NCCL, and a dead worker turns it into a hang or a timeout;
a pipe write returns at once (the OS buffers it), a dead worker's pipe fails it with
``BrokenPipeError`` right away, and the same pipe carries the start-up handshake and a
worker's traceback back.

Failures: a worker that dies between steps fails the next write; one that dies inside a
step fails rank 0's next collective (gloo notices the closed socket at once; NCCL only
after ``MRV2_TP_TIMEOUT_S``, when torch's watchdog takes over). Either way the executor
raises :class:`TPWorkerError` naming the rank, its exit code and its traceback, and shuts
the group down: after a failed step the ranks may be in different collectives, so unlike
the single-device engine (``mrv2/fault.py``) no request-level containment is possible.
See notebooks/11_tensor_parallel.ipynb.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import pickle
import time
import weakref

import torch
import torch.multiprocessing as mp

from mrv2 import platform
from mrv2.async_output import AsyncOutput
from mrv2.distributed import parallel_state as ps
from mrv2.distributed.worker import (
    CAPTURE,
    RankSpec,
    build_runner,
    load_rank_model,
    worker_main,
)
from mrv2.runner_interface import RunnerInterface


class TPWorkerError(RuntimeError):
    """The tensor-parallel group failed (a worker died, or a step failed on a rank).

    ``fatal``: the engine re-raises it instead of containing it per request.
    """

    fatal = True


def _stop_workers(procs, conns, grace: float = 10.0) -> None:
    """Ask every worker to exit, reap it (no zombie), kill it if it does not; leave the group.

    Module-level (not a method) so the ``weakref.finalize`` of an executor can call it.
    """
    stop = pickle.dumps(None)
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except (OSError, ValueError):
            pass  # dead already, or closed
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()
    ps.destroy_tensor_parallel()


class TPExecutor(RunnerInterface):
    """Spawns the workers, builds rank 0's shard, and drives all ranks step by step.

    Construction spawns ranks ``1 .. N-1`` (torch multiprocessing, spawn context), loads
    rank 0's shard meanwhile, waits until every worker has loaded its own, and joins the
    group; ``start_runners(num_blocks)`` then builds every rank's ``ModelRunner``.

    Args:
        spec: the :class:`RankSpec` shared by every rank.
        device: rank 0's device.

    Attributes:
        model: rank 0's model shard; ``local_config``: its (narrower) config.
    """

    def __init__(self, spec: RankSpec, device: torch.device):
        self.spec, self.device = spec, torch.device(device)
        self.runner = None
        self._error: str | None = None
        self._procs: list = []
        self._conns: list = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        self._tracebacks: dict[int, str] = {}
        ctx = mp.get_context("spawn")
        for rank in range(1, spec.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, child), daemon=True,
                               name=f"mrv2-tp-rank{rank}")
            proc.start()
            child.close()  # NOTE: only the worker holds its end: its death breaks the pipe
            self._procs.append(proc)
            self._conns.append(parent)
        try:
            self.model, self.local_config = load_rank_model(spec, 0, self.device)
            self._wait_all("loaded", spec.timeout)
            ps.init_tensor_parallel(0, spec.tp_size, spec.port, self.device, spec.timeout)
        except BaseException:
            self.shutdown(wait=False)
            raise

    @classmethod
    def for_llm(cls, llm, load_format: str, seed: int, enforce_eager: bool, model_state_cls,
                prefill_graphs: bool) -> TPExecutor:
        """The executor of an ``LLM`` being built (its configs are set, no weight loaded).

        Args:
            llm: the ``mrv2.LLM`` (``model_path``, ``hf_config``, ``tensor_parallel_size``,
                ``dtype``, ``device``, ``scheduler_config``, ``cache_config``).
            load_format, seed, enforce_eager, model_state_cls: ``LLM``'s arguments.
            prefill_graphs: capture prefill graphs too (``cudagraph_mode="FULL"``).
        """
        kwargs = {"enforce_eager": enforce_eager, "prefill_graphs": prefill_graphs}
        if model_state_cls is not None:
            kwargs["model_state_cls"] = model_state_cls
        spec = RankSpec(str(llm.model_path), llm.hf_config, llm.tensor_parallel_size,
                        ps.free_port(), llm.dtype, load_format, seed, llm.scheduler_config,
                        llm.cache_config, kwargs, ps.timeout_s())
        return cls(spec, llm.device)

    # -- start-up ---------------------------------------------------------------------

    def start_runners(self, num_blocks: int) -> None:
        """Build every rank's ``ModelRunner`` with ``num_blocks`` KV blocks (rank 0 sized
        the pool: block ids mean the same on every rank)."""
        try:
            for conn in self._conns:
                conn.send(num_blocks)
            self.runner = build_runner(self.spec, self.model, self.local_config, num_blocks,
                                       self.device)
            self._wait_all("ready", self.spec.timeout)
        except BaseException:
            self.shutdown(wait=False)
            raise

    def _wait_all(self, tag: str, timeout: float) -> None:
        """Wait until every worker sent ``(tag, None)``; a death, an error or the timeout
        raises ``TPWorkerError``."""
        waiting = dict(zip(self._conns, range(1, len(self._conns) + 1)))
        deadline = time.monotonic() + timeout
        while waiting:
            sentinels = {self._procs[r - 1].sentinel: r for r in waiting.values()}
            left = deadline - time.monotonic()
            ready = mpc.wait([*waiting, *sentinels], timeout=max(0.0, left))
            if not ready:
                raise TPWorkerError(f"tensor-parallel rank(s) {sorted(waiting.values())} did "
                                    f"not report {tag!r} within {timeout:.0f} s "
                                    "(MRV2_TP_TIMEOUT_S)")
            for obj in ready:
                if obj in waiting:
                    try:
                        kind, text = obj.recv()
                    except EOFError:
                        kind, text = "died", None
                    if kind == tag:
                        del waiting[obj]
                        continue
                    if kind == "error":
                        self._tracebacks[waiting[obj]] = text
                raise TPWorkerError(self._describe_failure(f"while starting ({tag})", grace=5.0))

    # -- the RunnerInterface ------------------------------------------------------------

    @property
    def timeline(self):
        return None if self.runner is None else self.runner.timeline

    @timeline.setter
    def timeline(self, tl) -> None:
        if self.runner is not None:
            self.runner.timeline = tl

    def validate_params(self, sampling_params, num_eos_ids: int = 0) -> None:
        self.runner.validate_params(sampling_params, num_eos_ids)

    def capture_cuda_graphs(self, progress: bool = True) -> None:
        """Every rank captures the same sizes in the same order (their NCCL all-reduces
        are captured inside the graphs and must pair up at replay)."""
        if not self.runner.cuda_graphs.enabled:
            return
        self._send(CAPTURE)
        self._local(self.runner.capture_cuda_graphs, progress)

    def execute_model(self, sched):
        """Send the step to every worker, then run it on rank 0; rank 0's output."""
        if self._error is not None:
            if sched.is_empty:
                return AsyncOutput([], None)  # only frees rows of a dead group: nothing to do
            raise TPWorkerError(self._error)
        self._send(sched)
        return self._local(self.runner.execute_model, sched)

    def _send(self, msg) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)  # once, for all workers
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except (OSError, ValueError) as exc:  # BrokenPipeError: the worker is gone
            raise self._fail("before a step") from exc

    def _local(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            raise self._fail(f"during a step ({exc!r} on rank 0)") from exc
        except BaseException:  # KeyboardInterrupt mid-step: the ranks are out of step now
            self._fail("interrupted during a step")
            raise

    # -- failure and shutdown --------------------------------------------------------------

    def _fail(self, when: str) -> TPWorkerError:
        """Describe what broke, shut the group down, and return the error to raise."""
        self._error = self._describe_failure(when, grace=2.0)
        self.shutdown(wait=False)  # the others may wait inside a collective: no clean exit
        return TPWorkerError(self._error)

    def _describe_failure(self, when: str, grace: float = 0.0) -> str:
        """Which ranks died (exit codes) and the tracebacks they sent."""
        deadline = time.monotonic() + grace
        for p in self._procs:  # a collective failed because a peer died: let the OS tell us
            # NOTE: join, not the sentinel alone: a killed process closes its pipes (and
            # sockets) before it can be reaped, and exitcode reads None until then.
            p.join(max(0.0, deadline - time.monotonic()))
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                for r, p in enumerate(self._procs, 1) if p.exitcode is not None]
        for r, conn in enumerate(self._conns, 1):
            try:
                while conn.poll():
                    kind, text = conn.recv()
                    if kind == "error":
                        self._tracebacks[r] = text
            except (EOFError, OSError):
                pass
        tracebacks = [f"--- rank {r} ---\n{t}" for r, t in sorted(self._tracebacks.items())]
        who = "; ".join(dead) if dead else "no worker exited"
        msg = (f"tensor-parallel group failed {when}: {who}. The group is shut down (its ranks "
               "may be stopped inside different collectives); create a new LLM.")
        return msg + ("\n" + "\n".join(tracebacks) if tracebacks else "")

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers (no zombie left) and leave the group; idempotent.

        Args:
            wait: let each worker finish and exit on its own (up to 10 s); ``False``
                terminates them at once (a failed start-up: they are not listening).
        """
        if not wait:
            for p in self._procs:
                p.terminate()
        self._finalizer()  # runs _stop_workers once (also at exit, or when collected)
        if self._error is None:
            self._error = "this tensor-parallel LLM was shut down"

    @property
    def worker_pids(self) -> list[int]:
        """The live worker processes' ids (tests kill one to check the failure path)."""
        return [p.pid for p in self._procs if p.is_alive()]


def check_tp_args(tp_size, runner: str, spec_config, logits_processors) -> None:
    """``LLM(tensor_parallel_size=...)`` and what it cannot be combined with, before any work.

    Raises:
        ValueError: naming the argument (the model's sizes are checked by
            ``mrv2.distributed.layers.check_tp_size``).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    if tp_size == 1:
        return
    if runner != "v2":
        raise ValueError("tensor_parallel_size > 1 needs the V2 runner (runner='v2')")
    if spec_config is not None:
        raise ValueError("tensor_parallel_size > 1 cannot be combined with speculative_config")
    if logits_processors:
        # NOTE: every rank must apply identical processors to sample identical tokens.
        raise ValueError("tensor_parallel_size > 1 cannot be combined with logits_processors")
    if platform.HAS_CUDA and tp_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs, this machine "
                         f"has {torch.cuda.device_count()}")
