"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, checked when it is built.

The format is vLLM's: ``{"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"method": "draft_model",
"model": PATH, "num_speculative_tokens": K}`` or ``{"method": "eagle", "model": HEAD_PATH,
"num_speculative_tokens": K}`` (an EAGLE-1 draft head, ``eagle_head.py``). mrv2 adds two keys: ``"verification"``
(``"exact"``, the default: accept a draft while it equals the target's own stateless
Gumbel sample, so seeded output is unchanged by speculation; or ``"probabilistic"``:
Leviathan / Chen rejection sampling) and ``"sync_accepted_counts"`` (off by default: a
V1-style copy of the accepted counts to the CPU each step, only to measure what removing
that sync is worth). See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, fields
from typing import Any

#: Proposers mrv2 knows.
METHODS = ("ngram", "draft_model", "eagle")
#: Methods that read a model folder (``"model"``).
MODEL_METHODS = ("draft_model", "eagle")
#: Verification rules.
VERIFICATIONS = ("exact", "probabilistic")
#: Keys that only one method accepts.
_NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
_DRAFT_KEYS = ("model",)


def _int_field(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"speculative_config[{name!r}] must be an integer >= {low}, "
                         f"got {value!r}")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """How a speculating request proposes and verifies its draft tokens.

    Args:
        method: ``"ngram"`` (prompt lookup in the request's own tokens),
            ``"draft_model"`` (a smaller model with the same vocabulary) or ``"eagle"``
            (an EAGLE-1 head over the target's hidden states; ``eagle.py``).
        num_speculative_tokens: K, the drafts per step (a decode then schedules 1 + K).
        prompt_lookup_max, prompt_lookup_min: the n-gram sizes tried, longest first
            (``ngram`` only). As in vLLM, one given alone sets the other; neither: both 5.
        model: the draft model's or EAGLE head's folder (``draft_model``, ``eagle``); it
            must exist.
        verification: ``"exact"`` (seeded output unchanged by speculation) or
            ``"probabilistic"`` (Leviathan / Chen: other tokens, the same distribution;
            greedy output unchanged).
        sync_accepted_counts: copy the accepted counts to the CPU every step (a
            measurement toggle; the V2 loop never does it otherwise).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    verification: str = "exact"
    sync_accepted_counts: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS}, "
                             f"got {self.method!r}")
        _int_field("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"speculative_config['verification'] must be one of "
                             f"{VERIFICATIONS}, got {self.verification!r}")
        if not isinstance(self.sync_accepted_counts, bool):
            raise TypeError("speculative_config['sync_accepted_counts'] must be a bool, "
                             f"got {self.sync_accepted_counts!r}")
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError("speculative_config['model'] is only for methods 'draft_model' "
                             "and 'eagle', not 'ngram'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        # vLLM's defaults: one bound given alone sets the other, neither gives 5 and 5.
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _int_field("prompt_lookup_min", lo, 1)
        _int_field("prompt_lookup_max", hi, 1)
        if lo > hi:
            raise ValueError(f"speculative_config['prompt_lookup_min']={lo} is larger than "
                             f"prompt_lookup_max={hi}")
        # NOTE: frozen dataclass: the resolved defaults go in through object.__setattr__.
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_draft_model(self) -> None:
        for key in _NGRAM_KEYS:
            if getattr(self, key) is not None:
                raise ValueError(f"speculative_config[{key!r}] is only for method 'ngram', "
                                 f"not {self.method!r}")
        if self.model is None:
            what = "the draft model's" if self.method == "draft_model" else "the EAGLE head's"
            raise ValueError(f"speculative_config['model'] is required for method "
                             f"{self.method!r} ({what} folder)")
        if not isinstance(self.model, (str, pathlib.Path)):
            raise TypeError(f"speculative_config['model'] must be a path, got {self.model!r}")
        path = pathlib.Path(self.model)
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ValueError(f"speculative_config['model']={str(self.model)!r}: no model folder "
                             "with a config.json there")
        object.__setattr__(self, "model", str(self.model))

    @classmethod
    def from_dict(cls, config: dict[str, Any] | SpeculativeConfig | None
                  ) -> SpeculativeConfig | None:
        """Build from vLLM's ``speculative_config`` dict (``None`` stays ``None``).

        Args:
            config: the dict (or an already built ``SpeculativeConfig``, returned as is).

        Returns:
            The checked config, or ``None`` when speculation is off.

        Raises:
            ValueError: naming the unknown, missing or bad key (TypeError for a value
                of the wrong type where no value of that type could be right).
        """
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        for key in config:
            if key not in known:
                raise ValueError(f"unknown speculative_config key {key!r}; expected some of "
                                 f"{sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in config:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**config)


def _get(config: Any, key: str) -> Any:
    """A field of a Hugging Face config object or of its ``config.json`` dict."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def check_draft_compatible(target_hf_config: Any, draft_hf_config: Any,
                           max_model_len: int | None = None) -> None:
    """Refuse a draft model whose token ids do not mean the target's.

    What must match: the vocabulary (``vocab_size``: a draft proposes ids the target
    scores, so another vocabulary is refused outright), the special ids
    (``bos_token_id``, ``eos_token_id``, ``pad_token_id`` where both define one) and,
    not checkable from configs, the tokenizer itself (same tokenizer files: the
    caller's duty). The draft must also reach the run's ``max_model_len``
    (``max_position_embeddings``) since it runs over the same positions.

    Args:
        target_hf_config, draft_hf_config: Hugging Face configs (objects or dicts).
        max_model_len: the run's longest sequence, if known.

    Raises:
        ValueError: naming the field that differs.
    """
    t_vocab, d_vocab = _get(target_hf_config, "vocab_size"), _get(draft_hf_config, "vocab_size")
    if t_vocab is None or d_vocab is None or t_vocab != d_vocab:
        raise ValueError(f"draft model vocab_size={d_vocab} differs from the target's "
                         f"vocab_size={t_vocab}: a draft must share the target's vocabulary")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        t, d = _get(target_hf_config, key), _get(draft_hf_config, key)
        if t is not None and d is not None and t != d:
            raise ValueError(f"draft model {key}={d} differs from the target's {key}={t}")
    d_len = _get(draft_hf_config, "max_position_embeddings")
    if max_model_len is not None and d_len is not None and d_len < max_model_len:
        raise ValueError(f"draft model max_position_embeddings={d_len} is below the run's "
                         f"max_model_len={max_model_len}")


def check_eagle_compatible(target_hf_config: Any, head_config: Any,
                           max_model_len: int | None = None) -> None:
    """Refuse an EAGLE head that cannot read this target's hidden states.

    The head's ``fc`` reads ``concat(embedding, target hidden state)`` (``2 * hidden``
    wide) and its output goes through the target's lm_head, so ``hidden_size`` must be the
    target's; its token ids are the target's (``vocab_size``, where the head's config
    names one); its RoPE cache must reach the run's ``max_model_len``. EAGLE-3 heads
    (multi-layer features, their own reduced vocabulary) are refused by name.

    Args:
        target_hf_config: the target's Hugging Face config (object or dict).
        head_config: the head's ``config.json`` (object or dict).
        max_model_len: the run's longest sequence, if known.

    Raises:
        ValueError: naming the field that does not fit.
    """
    archs = _get(head_config, "architectures") or []
    if any("eagle3" in a.lower() for a in archs) or _get(head_config, "draft_vocab_size"):
        raise ValueError(f"EAGLE head architectures={archs}: an EAGLE-3 head (multi-layer "
                         "features, draft vocabulary); mrv2 runs EAGLE-1 heads only")
    t_hidden, h_hidden = _get(target_hf_config, "hidden_size"), _get(head_config, "hidden_size")
    if t_hidden != h_hidden:
        raise ValueError(f"EAGLE head hidden_size={h_hidden} differs from the target's "
                         f"hidden_size={t_hidden}: the head reads the target's hidden states")
    t_vocab, h_vocab = _get(target_hf_config, "vocab_size"), _get(head_config, "vocab_size")
    if h_vocab is not None and h_vocab != t_vocab:
        raise ValueError(f"EAGLE head vocab_size={h_vocab} differs from the target's "
                         f"vocab_size={t_vocab}: the head proposes the target's token ids")
    layers = _get(head_config, "num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"EAGLE head num_hidden_layers={layers!r}: need at least one layer")
    h_len = _get(head_config, "max_position_embeddings")
    if max_model_len is not None and h_len is not None and h_len < max_model_len:
        raise ValueError(f"EAGLE head max_position_embeddings={h_len} is below the run's "
                         f"max_model_len={max_model_len}")
