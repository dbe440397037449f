"""Interim pieces of speculative decoding, until the wt20 modules land (plain torch, sync-free).

Three small stand-ins, each replaced at merge by its real counterpart:

* ``SpecConfig`` -> ``mrv2/spec_decode/config.py`` (``SpeculativeConfig.from_dict``);
* ``propose_ngram`` -> the Triton n-gram proposer of ``mrv2/spec_decode/ngram.py``;
* ``exact_accept`` -> the Triton ``exact`` verification of ``mrv2/spec_decode/rejection_sample.py``.

The integration (``scheduling.py``, ``verify_step.py``, ``draft_slots.py``) calls them through
these signatures only, so re-pointing three imports is the whole merge. Each function runs
on the device with whole-tensor ops: no ``.item()``, no boolean-mask indexing, no sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_METHODS = ("ngram", "draft_model")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "sync_accepted_counts", "verification", "model")


@dataclass(slots=True, frozen=True)
class SpecConfig:
    """vLLM's ``speculative_config`` dict, checked (interim; replaced by ``SpeculativeConfig``).

    Args:
        method: ``"ngram"`` (prompt lookup) or ``"draft_model"`` (``model``: a folder).
        num_speculative_tokens: K >= 1, drafts per speculating step.
        prompt_lookup_max, prompt_lookup_min: the n-gram sizes tried, longest first.
        sync_accepted_counts: copy the accepted counts to the CPU every step and let the
            scheduler use them (a V1-style sync, for the benchmark only).
        verification: ``"exact"`` (the only mode here).
        model: the draft model's folder (``method="draft_model"`` only).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    sync_accepted_counts: bool = False
    verification: str = "exact"
    model: str | None = None

    def __post_init__(self):
        if self.method not in _METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {_METHODS}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config[{name!r}] must be an integer >= 1, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config['prompt_lookup_min'] ({self.prompt_lookup_min})"
                             f" must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.sync_accepted_counts, bool):
            raise TypeError("speculative_config['sync_accepted_counts'] must be a bool, "
                             f"got {self.sync_accepted_counts!r}")
        if self.method == "draft_model":
            import pathlib

            if not isinstance(self.model, str) or not (pathlib.Path(self.model)
                                                       / "config.json").is_file():
                raise ValueError("speculative_config['model'] must be a model folder with a "
                                 f"config.json for method 'draft_model', got {self.model!r}")
        elif self.model is not None:
            raise ValueError("speculative_config['model'] is only for method 'draft_model'")
        if self.verification != "exact":
            raise ValueError("speculative_config['verification'] must be 'exact' "
                             f"(probabilistic is not wired in yet), got {self.verification!r}")

    @classmethod
    def from_dict(cls, d: dict) -> SpecConfig:
        """Parse vLLM's dict format; an unknown key is a ``ValueError`` naming it."""
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; "
                             f"expected some of {list(_KEYS)}")
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**d)


def propose_ngram(token_ids: torch.Tensor, total_len: torch.Tensor, idx_mapping: torch.Tensor,
                  num_reqs: int, num_speculative_tokens: int, prompt_lookup_min: int,
                  prompt_lookup_max: int) -> torch.Tensor:
    """Prompt-lookup drafts per batch slot (interim torch; replaced by the wt20 kernel).

    For slot ``b`` (row ``r = idx_mapping[b]``, ``L = total_len[r]``), for ``n`` from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``: find the latest ``i < L - n`` with
    ``token_ids[r, i:i+n] == token_ids[r, L-n:L]`` and propose ``token_ids[r, i+n : i+n+K]``
    (only tokens before ``L``); the longest ``n`` with a match wins.

    Args:
        token_ids: int32 ``[R, max_model_len]`` the state table's tokens.
        total_len: int32 ``[R]``.
        idx_mapping: int32 ``[>= num_reqs]`` batch slot -> row.
        num_reqs: real slots (a CPU int).
        num_speculative_tokens: K.
        prompt_lookup_min, prompt_lookup_max: n-gram sizes.

    Returns:
        int32 ``[num_reqs, K]`` drafts, -1 where there is none.
    """
    k = num_speculative_tokens
    rows = idx_mapping[:num_reqs].long()
    tok = token_ids[rows]                                                  # [B, Lmax]
    total = total_len[rows].long()                                         # [B]
    max_len = tok.shape[1]
    drafts = torch.full((num_reqs, k), -1, dtype=torch.int32, device=tok.device)
    found = torch.zeros(num_reqs, dtype=torch.bool, device=tok.device)
    for n in range(prompt_lookup_max, prompt_lookup_min - 1, -1):
        if n >= max_len:
            continue
        offs = torch.arange(n, device=tok.device)
        suffix = tok.gather(1, (total[:, None] - n + offs).clamp(min=0))    # [B, n]
        win = tok.unfold(1, n, 1)                                          # [B, Lmax-n+1, n]
        start = torch.arange(win.shape[1], device=tok.device)              # [W]
        match = (win == suffix[:, None, :]).all(-1) & (start[None, :] < (total - n)[:, None])
        latest = torch.where(match, start[None, :], -1).amax(dim=1)        # [B], -1: none
        hit = (latest >= 0) & ~found
        nxt = latest[:, None] + n + torch.arange(k, device=tok.device)     # [B, K]
        cand = tok.gather(1, nxt.clamp(0, max_len - 1))                    # [B, K]
        cand = torch.where(nxt < total[:, None], cand, -1)
        drafts = torch.where(hit[:, None], cand, drafts)
        found |= hit
    return drafts


def exact_accept(draft_token_ids: torch.Tensor, target_token_ids: torch.Tensor,
                 num_spec_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exact`` verification (interim torch; replaced by the wt20 kernel).

    A draft is accepted while it equals the target's own sample at that position; the
    first mismatch takes the target's sample, and all accepted earns the bonus token.

    Args:
        draft_token_ids: int ``[B, K]`` drafts (-1 never matches).
        target_token_ids: int ``[B, K + 1]`` the target's sample at each position.
        num_spec_tokens: int ``[B]`` K_b <= K, the drafts slot ``b`` really verified.

    Returns:
        ``(output_token_ids [B, K + 1] int32, -1 past the run; num_sampled [B] int32)``:
        the first ``a_b + 1`` targets, ``a_b`` the accepted drafts.
    """
    k = draft_token_ids.shape[1]
    j = torch.arange(k, device=draft_token_ids.device)                     # [K]
    target = target_token_ids.to(torch.int32)
    match = ((draft_token_ids.to(torch.int32) == target[:, :k])
             & (j[None, :] < num_spec_tokens[:, None]))                    # [B, K]
    accepted = match.to(torch.int32).cumprod(dim=1).sum(dim=1)             # [B]
    jj = torch.arange(k + 1, device=target.device)
    out = torch.where(jj[None, :] <= accepted[:, None], target, -1)        # [B, K + 1]
    return out, (accepted + 1).to(torch.int32)
