"""Acceptance figures of speculative decoding, counted from the host outputs the engine reads.

Nothing here touches the device: the engine already receives, one step late, each
request's run length (``a + 1``) and how many real drafts it verified; ``observe`` adds
them up. The runner owns one ``SpecDecodeStats`` for the whole run; each request keeps its
own, returned as ``RequestOutput.metrics["spec_decode"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counts over request-steps that verified drafts.

    Attributes:
        num_speculative_tokens: K.
        num_spec_steps: request-steps with at least one draft slot (K_b >= 1).
        num_draft_slots: draft slots verified (sum of K_b).
        num_draft_tokens: real proposals among them (the proposer found a match).
        num_accepted_tokens: drafts accepted (sum of a).
        accepted_per_position: ``[K]``, how often the draft at position j was accepted.
    """

    num_speculative_tokens: int
    num_spec_steps: int = 0
    num_draft_slots: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_spec: int, num_drafts: int, num_accepted: int) -> None:
        """One request-step: K_b slots, ``num_drafts`` real drafts, ``a`` accepted."""
        if num_spec <= 0:
            return
        self.num_spec_steps += 1
        self.num_draft_slots += num_spec
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        """Add ``other``'s counts (the same K) to these."""
        self.num_spec_steps += other.num_spec_steps
        self.num_draft_slots += other.num_draft_slots
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, c in enumerate(other.accepted_per_position):
            self.accepted_per_position[j] += c

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculating request-step: 1 + accepted drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / max(self.num_spec_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over real drafts proposed."""
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    def as_dict(self) -> dict:
        return {"num_spec_steps": self.num_spec_steps, "num_draft_slots": self.num_draft_slots,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_rate": self.acceptance_rate}
