"""``LLM``: vLLM's offline API over the mrv2 engine.

``LLM(model=...)`` loads a Hugging Face folder (or the embedded tiny Qwen3 when
no model is given), sizes the KV cache, builds the scheduler and the V2 model
runner; ``generate`` tokenizes, submits, runs the step loop under a progress bar
and returns one ``RequestOutput`` per prompt, in input order.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from mrv2 import platform
from mrv2.config import CacheConfig, SchedulerConfig
from mrv2.engine import Engine
from mrv2.engine_api import LLMEngine
from mrv2.inputs import check_unsupported_args, normalize_prompts
from mrv2.kv_cache import KVCacheManager, cdiv
from mrv2.model_state import ModelState
from mrv2.outputs import RequestOutput
from mrv2.sampling_params import ParamLimits, SamplingParams
from mrv2.scheduler import Scheduler

# vLLM engine arguments that mean nothing for a single-device offline runner.
_IGNORED_ARGS = {"pipeline_parallel_size": 1, "trust_remote_code": None,
                 "swap_space": None, "disable_log_stats": None,
                 "tokenizer_mode": None, "revision": None, "download_dir": None,
                 "enable_chunked_prefill": None, "compilation_config": None}
#: ``LLM(cudagraph_mode=...)`` values (vLLM's ``CUDAGraphMode`` names that mrv2 has).
_CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "NONE")


class LLM:
    """An offline LLM engine with vLLM's interface.

    Args:
        model: a Hugging Face folder, a hub id (when online), or ``None`` for the
            embedded tiny Qwen3 trained on Tiny Shakespeare.
        tokenizer: tokenizer folder (default: the model's).
        dtype: ``"auto"`` (bf16 on a GPU, fp32 on the CPU), ``"bfloat16"``, ...
        seed: seeds the random seeds given to unseeded requests (and dummy weights).
        max_num_seqs: most requests in one step (rows of the state table).
        max_num_batched_tokens: token budget of one step (default 8192).
        max_model_len: longest prompt + output (default: the model's).
        block_size: tokens per KV block.
        num_gpu_blocks_override: KV blocks in the pool (default: sized from memory).
        gpu_memory_utilization: fraction of GPU memory to use (model + KV cache).
        enforce_eager: never use CUDA graphs (same as ``cudagraph_mode="NONE"``).
        cudagraph_mode: vLLM's names: ``"FULL"`` (decode steps and small prefill / mixed
            steps replay whole-forward graphs; the default), ``"FULL_DECODE_ONLY"``
            (uniform decode steps only) or ``"NONE"``. See ``mrv2/cuda_graphs.py``.
        load_format: ``"auto"`` (safetensors) or ``"dummy"`` (random weights).
        skip_tokenizer_init: no tokenizer: prompts must be token ids, outputs are ids.
        runner: ``"v2"`` or ``"v1"`` (the V1-style baseline, ``mrv2/v1/``); ``None``
            reads ``MRV2_USE_V2_MODEL_RUNNER`` (``1``, the default: V2; ``0``: V1), as vLLM does.
        async_scheduling: prepare step N+1 while the GPU runs step N and process
            outputs one step behind (``None``: on for the V2 runner on a GPU, off otherwise).
        model_state_cls: a ``mrv2.model_state.ModelState`` subclass holding the
            model-specific logic (V2 runner only; default ``ModelState``).
        logits_processors: batch-level GPU logits processors
            (``mrv2.sample.logits_processors``): instances, or factories called as
            ``factory(max_num_seqs, device)``.
        kv_cache_memory_bytes: bytes for the KV pool (vLLM's name; overrides
            ``gpu_memory_utilization``). On the CPU the default is a small budget
            (``mrv2/cpu_defaults.py``; ``VLLM_CPU_KVCACHE_SPACE`` in GiB also works).
        enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before
            (hash chain over full blocks, ``mrv2/kv_cache.py``); on by default, as in vLLM
            V1. Requests asking for ``prompt_logprobs`` skip the lookup (a cached prefix
            has no hidden states to score) but still fill the cache.
        speculative_config: vLLM's dict, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``
            (V2 runner only; ``mrv2/spec_decode/``). ``None``: no speculative decoding.
        tensor_parallel_size: ranks to shard the model over (``mrv2/distributed/``): one
            process per rank (one GPU each; gloo processes on the CPU), this one is rank 0.
            1 (the default) is the single-device path, unchanged. Call ``shutdown()`` to
            stop the workers (also done at exit). NOTE: workers start with the ``spawn``
            method, so a script creating such an ``LLM`` needs ``if __name__ == "__main__":``.

    Every argument is checked before anything is loaded (the sizes against the model's
    ``config.json`` alone). ``llm.llm_engine`` is the ``LLMEngine`` (``mrv2.engine_api``):
    ``add_request`` / ``step`` / ``abort_request``, which ``generate`` is built on.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None,
                 dtype: str | torch.dtype = "auto", seed: int = 0, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 block_size: int = 16, num_gpu_blocks_override: int | None = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 load_format: str = "auto", skip_tokenizer_init: bool = False,
                 runner: str | None = None, logits_processors=(),
                 async_scheduling: bool | None = None, model_state_cls=None,
                 cudagraph_mode: str | None = None, enable_prefix_caching: bool = True,
                 kv_cache_memory_bytes: int | None = None,
                 speculative_config: dict | None = None, tensor_parallel_size: int = 1,
                 **kwargs):
        for key, value in kwargs.items():
            if key not in _IGNORED_ARGS:
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
            if _IGNORED_ARGS[key] is not None and value != _IGNORED_ARGS[key]:
                raise ValueError(f"{key}={value!r} is not supported (mrv2 runs on one device)")
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
        if kv_cache_memory_bytes is not None and (
                isinstance(kv_cache_memory_bytes, bool) or not isinstance(kv_cache_memory_bytes, int)
                or kv_cache_memory_bytes <= 0):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer, "
                             f"got {kv_cache_memory_bytes!r}")
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        _check_args(seed=seed, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                    num_gpu_blocks_override=num_gpu_blocks_override,
                    gpu_memory_utilization=gpu_memory_utilization)
        runner = _pick_runner(runner)
        if model_state_cls is not None and runner != "v2":
            raise ValueError("model_state_cls needs the V2 runner (runner='v2')")
        spec_config = _spec_config(speculative_config, runner, logits_processors)
        from mrv2.distributed.executor import TPExecutor, check_tp_args

        check_tp_args(tensor_parallel_size, runner, spec_config, logits_processors)
        self.tensor_parallel_size, self._tp = tensor_parallel_size, None
        if async_scheduling is None:
            async_scheduling = platform.HAS_CUDA and runner == "v2"
        if cudagraph_mode is None:
            cudagraph_mode = "FULL"
        if cudagraph_mode not in _CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(_CUDAGRAPH_MODES)}, "
                             f"got {cudagraph_mode!r}")
        enforce_eager = enforce_eager or cudagraph_mode == "NONE"
        # NOTE: what the runner will really do: on the CPU there are no graphs at all.
        self.cudagraph_mode = "NONE" if enforce_eager or not platform.HAS_CUDA else cudagraph_mode
        self.runner_name, self.async_scheduling = runner, bool(async_scheduling)
        from transformers import AutoConfig

        from mrv2.models.loader import load_model, resolve_model_path

        self.dtype = platform.resolve_dtype(dtype)
        self.device = platform.DEVICE
        self.model_path = resolve_model_path(model)
        # Every size check runs on the config alone, before any weight is read.
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        if tensor_parallel_size > 1:
            from mrv2.distributed.layers import check_tp_size

            check_tp_size(self.hf_config, tensor_parallel_size)
        max_pos = getattr(self.hf_config, "max_position_embeddings", 4096)
        max_model_len = max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens or max(8192, max_num_seqs))
        self.cache_config = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks_override,
                                        gpu_memory_utilization=gpu_memory_utilization)
        self._check_pool(self.cache_config.num_gpu_blocks or self._auto_num_blocks())
        torch.manual_seed(seed)
        if tensor_parallel_size > 1:  # spawns the workers; rank 0's shard is self.model
            self._tp = TPExecutor.for_llm(self, load_format, seed, enforce_eager,
                                          model_state_cls, cudagraph_mode == "FULL")
            self.model = self._tp.model
        else:
            self.model, self.hf_config = load_model(self.model_path, self.dtype, self.device,
                                                    load_format=load_format, seed=seed,
                                                    hf_config=self.hf_config)
        self.tokenizer = None if skip_tokenizer_init else _load_tokenizer(tokenizer or self.model_path)
        if not platform.HAS_CUDA:
            from mrv2.cpu_defaults import apply_cpu_threads

            apply_cpu_threads(self.model)  # tiny ops: fewer threads are faster
        # NOTE: on a GPU the weights now use memory: size the pool again, exactly.
        num_blocks = self.cache_config.num_gpu_blocks or self._auto_num_blocks()
        self._check_pool(num_blocks)

        if runner == "v2":
            from mrv2.runner import ModelRunner
        else:
            from mrv2.v1.runner import V1ModelRunner as ModelRunner

        extra = {} if model_state_cls is None else {"model_state_cls": model_state_cls}
        extra["prefill_graphs"] = cudagraph_mode == "FULL"
        if spec_config is not None:
            extra["speculative_config"] = spec_config
        if self._tp is not None:
            self._tp.start_runners(num_blocks)
            self.runner = self._tp
        else:
            self.runner = ModelRunner(self.model, self.hf_config, self.scheduler_config,
                                      self.cache_config, num_blocks, self.device, self.dtype,
                                      enforce_eager=enforce_eager,
                                      logits_processors=logits_processors, **extra)
        self.runner.capture_cuda_graphs()  # a no-op on the CPU or with enforce_eager
        self.kv_manager = KVCacheManager(num_blocks, block_size,
                                         enable_caching=bool(enable_prefix_caching))
        self.scheduler = Scheduler(
            self.scheduler_config, self.kv_manager,
            num_speculative_tokens=0 if spec_config is None else spec_config.num_speculative_tokens,
            num_lookahead_tokens=spec_config.num_speculative_tokens
            if spec_config is not None and spec_config.method in ("draft_model", "eagle")
            else 0)
        self.engine = Engine(self.scheduler, self.runner, self.tokenizer, max_model_len,
                             async_scheduling=self.async_scheduling)
        self._eos_token_ids = _eos_ids(self.model_path, self.hf_config, self.tokenizer)
        self.llm_engine = LLMEngine(self.engine, self._param_limits(), max_model_len,
                                    self.tokenizer, self._validate_params, seed=seed)
        self._counter = 0

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a request unless ``ignore_eos`` (settable: the limits follow)."""
        return set(self._eos_token_ids)

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self._eos_token_ids = set(ids)
        self.llm_engine.limits = self._param_limits()

    def _check_pool(self, num_blocks: int) -> None:
        block_size, max_model_len = self.cache_config.block_size, self.scheduler_config.max_model_len
        if num_blocks * block_size < max_model_len:
            # NOTE: a pool smaller than one full sequence would preempt that sequence forever.
            raise ValueError(f"the KV pool holds {num_blocks} blocks x {block_size} = "
                             f"{num_blocks * block_size} tokens, fewer than max_model_len="
                             f"{max_model_len}: raise num_gpu_blocks_override (or "
                             "gpu_memory_utilization) or lower max_model_len")

    def _param_limits(self) -> ParamLimits:
        """What requests may ask for (model-level limits; the runner's own capacities are
        checked by its ``validate_params``, see ``_validate_params``)."""
        vocab = self.hf_config.vocab_size
        return ParamLimits(vocab_size=vocab, max_logprobs=vocab, max_logit_bias=None,
                           max_stop_ids=None, eos_token_ids=frozenset(self._eos_token_ids),
                           has_tokenizer=self.tokenizer is not None)

    def _validate_params(self, sp: SamplingParams) -> None:
        """The runner's per-row capacities and unsupported features (the V1 baseline has
        fewer); bad_words are tokenized here, once."""
        if sp.bad_words:
            from mrv2.sample.bad_words import bad_words_token_ids

            sp.bad_words_token_ids = bad_words_token_ids(self.tokenizer, sp.bad_words,
                                                         self.hf_config.vocab_size)
        self.runner.validate_params(sp, 0 if sp.ignore_eos else len(self._eos_token_ids))

    # -- set-up -----------------------------------------------------------------

    def _kv_bytes_per_block(self) -> int:
        # Tensor parallel: a rank's pool holds its KV heads only (its local config's).
        config = self.hf_config if self._tp is None else self._tp.local_config
        return ModelState.kv_bytes_per_block(config, self.cache_config.block_size, self.dtype)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave their group (a no-op at TP=1)."""
        if self._tp is not None:
            self._tp.shutdown()

    def _auto_num_blocks(self) -> int:
        """Blocks for the KV pool: what the memory budget allows, at most what the limits need."""
        cfg = self.scheduler_config
        enough = cfg.max_num_seqs * cdiv(cfg.max_model_len, self.cache_config.block_size)
        per_block = self._kv_bytes_per_block()
        if self.kv_cache_memory_bytes is not None:
            budget = self.kv_cache_memory_bytes
        elif platform.HAS_CUDA:
            free, total = torch.cuda.mem_get_info()
            used = total - free
            # NOTE: leave room for activations and logits of a full token budget.
            reserve = cfg.max_num_batched_tokens * self.hf_config.vocab_size * 4 + (1 << 30)
            budget = int(total * self.cache_config.gpu_memory_utilization) - used - reserve
        else:
            from mrv2.cpu_defaults import cpu_kv_budget_bytes

            budget = cpu_kv_budget_bytes(None, per_block // self.cache_config.block_size,
                                         cfg.max_model_len)
        return max(1, min(enough, budget // per_block))

    # -- generation ---------------------------------------------------------------

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's ``generation_config.json`` defaults (as vLLM)."""
        from mrv2.generation_config import diff_sampling_params

        return SamplingParams(**diff_sampling_params(self.model_path))

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, lora_request=None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools=None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with the chat template (``mrv2.chat``).

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts) or a list
                of conversations.
            sampling_params: as in ``generate``.
            chat_template: a Jinja template overriding the tokenizer's.
            add_generation_prompt: end with the assistant turn's header.
            continue_final_message: leave the last message open to be continued.
            tools: tool schemas handed to the template.
            chat_template_kwargs: extra template variables (e.g. ``enable_thinking``).

        Returns:
            One ``RequestOutput`` per conversation.
        """
        from mrv2.chat import render_conversations

        prompts = render_conversations(
            self.tokenizer, messages, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def generate(self, prompts=None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None,
                 prompt_token_ids=None) -> list[RequestOutput]:
        """Generate completions for ``prompts``.

        Every prompt and ``SamplingParams`` is validated before anything is submitted. On
        any exception (``KeyboardInterrupt`` included) the call aborts its own requests,
        which frees their blocks and rows, so the ``LLM`` stays usable.

        Args:
            prompts: a string, a ``TextPrompt`` / ``TokensPrompt`` dict (``mrv2.inputs``),
                or a list of them.
            sampling_params: one ``SamplingParams`` for all prompts, or one per prompt
                (``None``: ``get_default_sampling_params()``).
            use_tqdm: show a progress bar.
            lora_request: only ``None`` (no LoRA).
            priority: ``None`` or zeros (first-come-first-served).

        Returns:
            One ``RequestOutput`` per prompt, in input order (a completion whose step
            failed has ``finish_reason="error"`` and the message in ``stop_reason``).
        """
        prompts = normalize_prompts(prompts, prompt_token_ids)
        check_unsupported_args(len(prompts), lora_request, priority)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        # Validate everything before submitting anything: a bad prompt loses no other request.
        eng = self.llm_engine
        # NOTE: once per distinct object (verify is idempotent): one SamplingParams for
        # 1024 prompts is checked once, not 1024 times (~20 us each).
        for sp in {id(sp): sp for sp in params}.values():
            eng.check_params(sp)
        parsed = [eng.parse_prompt(p, sp.truncate_prompt_tokens) for p, sp in zip(prompts, params)]
        ids = []
        try:
            for p, sp in zip(parsed, params):
                ids.append(str(self._counter))
                self._counter += 1
                eng._submit(ids[-1], p, sp)
            self._run(ids, use_tqdm)
            return [eng.get_output(rid) for rid in ids]
        except BaseException:
            eng.abort_request(ids)  # NOTE: incl. KeyboardInterrupt: no stale request remains
            raise
        finally:
            for rid in ids:
                eng.pop(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> None:
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        eng = self.llm_engine
        left = set(ids)
        out_tokens = 0
        try:
            while left and eng.engine.has_unfinished():
                for rid in eng._step_finished():
                    if rid in left:
                        left.discard(rid)
                        if use_tqdm:  # NOTE: a disabled bar still costs ~5 us a request
                            out_tokens += sum(len(c.output_token_ids)
                                              for c in eng._groups[rid])
                            bar.update(1)
                            elapsed = bar.format_dict.get("elapsed") or 1e-9
                            bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} tok/s",
                                                refresh=False)
            if left:
                raise RuntimeError(f"the engine stopped with {len(left)} request(s) unfinished")
        finally:
            bar.close()


def _spec_config(speculative_config, runner: str, logits_processors):
    """Check ``LLM(speculative_config=...)`` before any work; ``None`` when off."""
    if speculative_config is None:
        return None
    from mrv2.spec_decode.config import SpeculativeConfig

    config = SpeculativeConfig.from_dict(speculative_config)
    if runner != "v2":
        raise ValueError("speculative_config needs the V2 runner (runner='v2')")
    if logits_processors:
        # NOTE: a batch-level processor sees one row per request, not per draft position.
        raise ValueError("speculative_config cannot be combined with logits_processors")
    return config



def _pick_runner(runner: str | None) -> str:
    """``"v1"`` or ``"v2"``: the argument, else the ``MRV2_USE_V2_MODEL_RUNNER`` variable."""
    import os

    if runner is None:
        env = os.environ.get("MRV2_USE_V2_MODEL_RUNNER", "1").strip()
        if env not in ("0", "1"):
            raise ValueError(f"MRV2_USE_V2_MODEL_RUNNER must be 0 or 1, got {env!r}")
        runner = "v2" if env == "1" else "v1"
    if runner not in ("v1", "v2"):
        raise ValueError(f"runner must be 'v1' or 'v2', got {runner!r}")
    return runner


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"could not load a tokenizer from {path} ({exc}); pass tokenizer=... or "
                         "skip_tokenizer_init=True and token-id prompts") from exc


def _eos_ids(model_path, hf_config, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    import json
    import pathlib

    ids = None
    gen = pathlib.Path(model_path) / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        warnings.warn("no EOS token id found: requests stop only on length or stop ids")
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


def _check_args(**args) -> None:
    """``LLM``'s own numeric arguments, checked before anything is loaded."""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(args["seed"]):
        raise TypeError(f"LLM seed must be an integer, got {args['seed']!r}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "num_gpu_blocks_override"):
        v = args[name]
        if (v is not None or name == "max_num_seqs") and not (is_int(v) and v > 0):
            raise ValueError(f"LLM {name} must be a positive integer"
                             f"{'' if name == 'max_num_seqs' else ' or None'}, got {v!r}")
    util = args["gpu_memory_utilization"]
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0:
        raise ValueError(f"LLM gpu_memory_utilization must be in (0, 1], got {util!r}")
