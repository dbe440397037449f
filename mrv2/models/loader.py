"""Build a model from a Hugging Face folder (safetensors only), a hub id, or dummy weights.

mrv2's module names are Hugging Face's, so loading is a name check plus a copy: every
checkpoint tensor must match one parameter by name and shape, and every parameter must be
found. The model is built on the ``meta`` device first (no memory, no init), then
allocated once on the target device in the target dtype. Only ``*.safetensors`` are read:
mrv2 never unpickles a checkpoint. See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from mrv2.models.qwen3 import Qwen3ForCausalLM, Qwen3RMSNorm
from mrv2.platform import DEVICE, resolve_dtype

#: The embedded default model: a tiny Qwen3 trained by this project on Tiny Shakespeare.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen3-shakespeare"

#: Hugging Face architectures mrv2 runs (all three map to ``Qwen3ForCausalLM``).
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")
_ARCH_OF_MODEL_TYPE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                       "qwen2": "Qwen2ForCausalLM"}

#: Files fetched from the hub: configs, weights and tokenizer files, never pickles.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "tokenizer*"]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """Turn ``model`` into a local folder holding ``config.json``.

    Args:
        model: ``None`` (the embedded :data:`DEFAULT_MODEL_DIR`), a local folder, or a
            Hugging Face Hub id such as ``"Qwen/Qwen3-0.6B"`` (downloaded when online).

    Returns:
        The folder's path.

    Raises:
        FileNotFoundError: the folder does not exist, lacks ``config.json``, or the id
            cannot be downloaded (hub unreachable or no such repository).
    """
    if model is None:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise FileNotFoundError(f"the embedded default model {DEFAULT_MODEL_DIR} is missing; "
                                    "pass a model folder or hub id")
        path = DEFAULT_MODEL_DIR
    else:
        path = Path(model).expanduser()
        if not path.is_dir():
            if path.exists():
                raise FileNotFoundError(f"{str(model)!r} is a file, not a model folder")
            if not _HUB_ID.fullmatch(str(model)):
                raise FileNotFoundError(f"model folder {str(model)!r} does not exist (and it is "
                                        "not a hub id of the form 'org/name')")
            path = _download(str(model))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    return path


def _download(repo_id: str) -> Path:
    """``snapshot_download`` of configs, safetensors and tokenizer files, with clear errors."""
    import huggingface_hub
    from huggingface_hub import errors

    not_found = tuple(getattr(errors, n) for n in
                      ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError")
                      if hasattr(errors, n))
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except not_found as e:
        raise FileNotFoundError(f"{repo_id!r} is not a local folder, and the Hugging Face Hub has "
                                f"no repository you can access under that id ({type(e).__name__})"
                                ) from e
    except Exception as e:  # offline, DNS, proxy, timeout, hub offline mode with no cache ...
        raise FileNotFoundError(f"{repo_id!r} is not a local folder, and the Hugging Face Hub is "
                                f"unreachable ({type(e).__name__}: {e}). Pass a local folder "
                                "with config.json and *.safetensors instead.") from e


def architecture_of(hf_config) -> str:
    """The supported architecture named by ``config.architectures`` (or its ``model_type``).

    Raises:
        ValueError: the config names an architecture mrv2 does not implement.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        model_type = getattr(hf_config, "model_type", None)
        if model_type in _ARCH_OF_MODEL_TYPE:
            return _ARCH_OF_MODEL_TYPE[model_type]
        archs = [f"model_type={model_type!r}"]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {', '.join(archs)}; mrv2 supports "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def weight_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` files of a folder (from the shard index when there is one).

    Raises:
        ValueError: the folder holds only pickled checkpoints (``*.bin``, ``*.pt`` ...).
        FileNotFoundError: no weight file at all, or a shard named by the index is absent.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid shard index ({e})") from None
        root = path.resolve()
        files = []
        for s in shards:
            # NOTE: a shard name like "../x" or "/etc/x" would read outside the model folder.
            if (not isinstance(s, str) or Path(s).is_absolute()
                    or not (path / s).resolve().is_relative_to(root)):
                raise ValueError(f"{index.name} names shard {s!r}, outside the model folder {path}")
            files.append(path / s)
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index.name} names shard {f.name}, absent from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"{path} holds only pickled checkpoints ({', '.join(pickles)}); mrv2 "
                         "loads safetensors only and never unpickles a checkpoint. Convert it, "
                         "e.g. save_pretrained(folder, safe_serialization=True).")
    raise FileNotFoundError(f"{path} has no *.safetensors weight file")


def build_model(hf_config, dtype: torch.dtype, device: torch.device,
                prepare=None) -> Qwen3ForCausalLM:
    """An uninitialised model on ``device`` in ``dtype`` (the RoPE cache stays fp32).

    Args:
        prepare: called on the model while it is on the meta device, before allocation
            (tensor parallelism swaps in its parallel modules there); ``None``: nothing.
    """
    architecture_of(hf_config)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(hf_config)
        if prepare is not None:
            prepare(model)
    # meta -> dtype is free; to_empty allocates once. NOTE: to_empty unties shared weights.
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    return model


def _ignored(name: str, tied: bool) -> bool:
    # Buffers some exporters save, and the duplicate of a tied embedding.
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


@contextlib.contextmanager
def _open_safetensors(f: Path):
    """``safe_open(f)``, with any error of a corrupt, truncated or empty file naming ``f``."""
    from safetensors import safe_open

    try:
        sf = safe_open(f, framework="pt")
    except Exception as e:  # noqa: BLE001 (SafetensorError, OSError): the header cannot be read
        raise ValueError(f"cannot read safetensors file {f} (corrupt, truncated or empty?): "
                         f"{e}") from None
    with sf:
        try:
            yield sf
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 (a tensor's bytes cannot be read)
            raise ValueError(f"cannot read a tensor from safetensors file {f} (corrupt or "
                             f"truncated?): {e}") from None


def _expected_shape(param: torch.Tensor, spec) -> tuple[int, ...]:
    """The checkpoint shape of a parameter that holds the slice ``spec`` of it."""
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.full
    return tuple(shape)


def _copy_shard(param: torch.Tensor, sf_slice, spec) -> None:
    """Copy rows ``[start, stop)`` of ``spec.dim`` (read alone from the file) into ``param``;
    rows past the tensor's end (vocabulary padding) are zeroed."""
    n = min(spec.stop, spec.full) - spec.start
    index = (slice(None),) * spec.dim + (slice(spec.start, spec.start + n),)
    param.narrow(spec.dim, 0, n).copy_(sf_slice[index])
    if n < param.shape[spec.dim]:
        param.narrow(spec.dim, n, param.shape[spec.dim] - n).zero_()


def load_weights(model: nn.Module, files: list[Path], tied: bool, shard=None) -> None:
    """Check every tensor's name and shape first (headers only), then copy them in.

    Args:
        shard: tensor parallelism: ``shard(name)`` gives the slice of tensor ``name`` this
            rank holds (a ``mrv2.distributed.layers.Shard``: ``dim, start, stop, full``) or
            ``None`` (the whole tensor); only that slice is read from the file.

    Raises:
        ValueError: a missing tensor, an unexpected tensor or a shape mismatch, named.
    """
    specs = {}
    params = dict(model.named_parameters())  # a tied lm_head.weight is listed once, as embed
    where: dict[str, Path] = {}
    for f in files:
        with _open_safetensors(f) as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _ignored(name, tied):
                    continue
                if name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {f.name}: the model has "
                                     "no such parameter")
                if name in where:
                    raise ValueError(f"tensor {name!r} appears in both {where[name].name} "
                                     f"and {f.name}")
                spec = specs[name] = None if shard is None else shard(name)
                shape, expected = (tuple(sf.get_slice(name).get_shape()),
                                   _expected_shape(params[name], spec))
                if shape != expected:
                    raise ValueError(f"tensor {name!r} has shape {shape} in {f.name}, expected "
                                     f"{expected}")
                where[name] = f
    missing = sorted(set(params) - set(where))
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing tensor(s) {', '.join(missing[:8])}{more}")
    with torch.no_grad():
        for f in files:
            with _open_safetensors(f) as sf:
                for name in sf.keys():  # noqa: SIM118
                    if name in where and specs[name] is not None:
                        _copy_shard(params[name], sf.get_slice(name), specs[name])
                    elif name in where:
                        params[name].copy_(sf.get_tensor(name))  # casts to dtype/device


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights with the real shapes: normal(0, std) matrices, zero biases, unit norms."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if isinstance(module, Qwen3RMSNorm):
                    p.fill_(1.0)
                elif name == "bias":
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)


def load_model(model: str | os.PathLike | None = None, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device | None = None, load_format: str = "auto",
               hf_config=None, seed: int = 0, prepare=None,
               shard=None) -> tuple[nn.Module, object]:
    """Build the model and load its weights.

    Args:
        model: a local folder, a hub id, or ``None`` for the embedded default model.
        dtype: ``"auto"`` (bf16 on a GPU, fp32 on the CPU), a name or a torch dtype.
        device: where the weights go (default: ``mrv2.platform.DEVICE``).
        load_format: ``"auto"``/``"safetensors"`` (read the weights) or ``"dummy"``
            (random weights, std ``config.initializer_range``; only the config is needed).
        hf_config: a config object to use instead of the folder's ``config.json``
            (with ``load_format="dummy"``, ``model`` may then be ``None``).
        seed: seeds the dummy weights.
        prepare, shard: tensor parallelism (``mrv2.distributed``): ``prepare`` of
            :func:`build_model`, ``shard`` of :func:`load_weights`; ``hf_config`` is then
            the rank's (narrower) config.

    Returns:
        ``(model in eval mode, hf_config)``.
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    dtype = resolve_dtype(dtype)
    device = DEVICE if device is None else torch.device(device)
    path = None
    if hf_config is None or load_format != "dummy":
        path = resolve_model_path(model)
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
    architecture_of(hf_config)
    files = weight_files(path) if load_format != "dummy" else []  # fail before allocating
    net = build_model(hf_config, dtype, device, prepare=prepare)
    if load_format == "dummy":
        init_dummy_weights(net, seed, std=getattr(hf_config, "initializer_range", 0.02))
    else:
        load_weights(net, files, tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
                     shard=shard)
    return net.eval(), hf_config


def find_qwen3_0_6b() -> Path | None:
    """A local Qwen3-0.6B folder (``config.json`` and ``*.safetensors``), or ``None``.

    Looks at ``$MRV2_QWEN3_PATH``, then the Hugging Face cache; never downloads.

    Returns:
        The folder, or ``None`` when no complete copy is found.
    """
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import try_to_load_from_cache

    candidates = []
    if os.environ.get("MRV2_QWEN3_PATH"):
        candidates.append(Path(os.environ["MRV2_QWEN3_PATH"]).expanduser())
    cached = try_to_load_from_cache("Qwen/Qwen3-0.6B", "config.json")
    if isinstance(cached, str):  # else None or the "known absent" marker
        candidates.append(Path(cached).parent)
    hub = Path(hf_constants.HF_HUB_CACHE)  # ~/.cache/huggingface/hub by default
    candidates += [f.parent for f in
                   sorted(hub.glob("models--Qwen--Qwen3-0.6B/snapshots/*/model.safetensors"))]
    return next((c for c in candidates
                 if (c / "config.json").is_file() and any(c.glob("*.safetensors"))), None)
