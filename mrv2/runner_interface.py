"""The runner interface: what the engine and ``LLM`` may call on a model runner.

Both runners implement it: ``mrv2.runner.ModelRunner`` (V2) and
``mrv2.v1.runner.V1ModelRunner`` (the baseline). ``LLM`` and ``Engine`` call nothing
else, so a third runner (a tensor-parallel one, a speculative one) is a subclass with
these members, not a new set of ``hasattr`` probes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from mrv2.async_output import StepOutput


class RunnerOutput(Protocol):
    """A launched step's output: ``get_output()`` waits for it (its event only)."""

    def get_output(self) -> StepOutput: ...


class RunnerInterface(ABC):
    """A model runner: executes scheduled steps on one device.

    Attributes:
        timeline: a ``mrv2.timeline.Timeline`` the runner marks its phases on, or
            ``None`` (set by the engine; a runner may ignore it).
    """

    timeline = None

    @property
    def spec_decode_stats(self):
        """The runner's ``SpecDecodeStats`` when it speculates, else ``None`` (the default)."""
        return None

    @abstractmethod
    def execute_model(self, sched) -> RunnerOutput:
        """Launch one step of a ``SchedulerOutput``; may return before the device is done."""

    @abstractmethod
    def capture_cuda_graphs(self, progress: bool = True) -> None:
        """Capture the runner's CUDA graphs (a no-op without graphs, e.g. on the CPU)."""

    @abstractmethod
    def validate_params(self, sampling_params, num_eos_ids: int = 0) -> None:
        """Raise ``ValueError`` naming the field for a request the runner cannot serve.

        Args:
            sampling_params: the request's ``SamplingParams``.
            num_eos_ids: EOS ids the engine will add to the request's stop ids.
        """
