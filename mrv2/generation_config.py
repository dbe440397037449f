"""The model's own sampling defaults, from ``generation_config.json`` (as vLLM reads them).

vLLM's ``generation_config="auto"`` takes the sampling fields a checkpoint's
``generation_config.json`` sets (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``max_new_tokens`` as ``max_tokens``) and uses them as the
defaults of ``LLM.get_default_sampling_params()`` and of ``generate`` without
``sampling_params``. Fields it does not set keep ``SamplingParams``' defaults.
"""

from __future__ import annotations

import json
import pathlib

#: generation_config.json key -> SamplingParams field.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "min_p": "min_p", "repetition_penalty": "repetition_penalty",
           "max_new_tokens": "max_tokens"}


def diff_sampling_params(model_path) -> dict:
    """The sampling fields ``model_path/generation_config.json`` sets.

    Args:
        model_path: a model folder.

    Returns:
        ``SamplingParams`` keyword arguments (empty when there is no such file).
    """
    path = pathlib.Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    return {field: cfg[key] for key, field in _FIELDS.items() if cfg.get(key) is not None}
