"""``LLM``: vLLM's offline API over the mrv2 engine.

``LLM(model=...)`` loads a Hugging Face folder (or the embedded tiny Qwen3 when
no model is given), sizes the KV cache, builds the scheduler and the V2 model
runner; ``generate`` tokenizes, submits, runs the step loop under a progress bar
and returns one ``RequestOutput`` per prompt, in input order.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from mrv2 import platform
from mrv2.config import CacheConfig, SchedulerConfig
from mrv2.engine import Engine
from mrv2.inputs import check_unsupported_args, normalize_prompts, truncate_prompt
from mrv2.kv_cache import KVCacheManager, cdiv
from mrv2.model_state import ModelState
from mrv2.metrics import group_metrics, now
from mrv2.outputs import CompletionOutput, RequestOutput
from mrv2.request import Request
from mrv2.sampling_params import SamplingParams
from mrv2.scheduler import Scheduler

# vLLM engine arguments that mean nothing for a single-device offline runner.
_IGNORED_ARGS = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "trust_remote_code": None,
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
        kv_cache_memory_bytes: bytes for the KV pool (vLLM's name; overrides
            ``gpu_memory_utilization``). On the CPU the default is a small budget
            (``mrv2/cpu_defaults.py``; ``VLLM_CPU_KVCACHE_SPACE`` in GiB also works).
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
        enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before
            (hash chain over full blocks, ``mrv2/kv_cache.py``); on by default, as in vLLM
            V1. Requests asking for ``prompt_logprobs`` skip the lookup (a cached prefix
            has no hidden states to score) but still fill the cache.
        logits_processors: batch-level GPU logits processors
            (``mrv2.sample.logits_processors``): instances, or factories called as
            ``factory(max_num_seqs, device)``.
        speculative_config: vLLM's dict, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``
            (V2 runner only; ``mrv2/spec_decode/``). ``None``: no speculative decoding.
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
                 speculative_config: dict | None = None,
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
        runner = _pick_runner(runner)
        if model_state_cls is not None and runner != "v2":
            raise ValueError("model_state_cls needs the V2 runner (runner='v2')")
        spec_config = _spec_config(speculative_config, runner, logits_processors)
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
        from mrv2.models.loader import load_model, resolve_model_path

        self.dtype = platform.resolve_dtype(dtype)
        self.device = platform.DEVICE
        self.model_path = resolve_model_path(model)
        torch.manual_seed(seed)
        self.model, self.hf_config = load_model(self.model_path, self.dtype, self.device,
                                                load_format=load_format, seed=seed)
        self.tokenizer = None if skip_tokenizer_init else _load_tokenizer(tokenizer or self.model_path)
        if not platform.HAS_CUDA:
            from mrv2.cpu_defaults import apply_cpu_threads

            apply_cpu_threads(self.model)  # tiny ops: fewer threads are faster

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
        num_blocks = self.cache_config.num_gpu_blocks or self._auto_num_blocks()
        if num_blocks * block_size < max_model_len:
            # NOTE: a pool smaller than one full sequence would preempt that sequence forever.
            raise ValueError(f"the KV pool holds {num_blocks} blocks x {block_size} = "
                             f"{num_blocks * block_size} tokens, fewer than max_model_len="
                             f"{max_model_len}: raise kv_cache_memory_bytes or "
                             "num_gpu_blocks_override, or lower max_model_len")

        if runner == "v2":
            from mrv2.runner import ModelRunner
        else:
            from mrv2.v1.runner import V1ModelRunner as ModelRunner

        extra = {} if model_state_cls is None else {"model_state_cls": model_state_cls}
        extra["prefill_graphs"] = cudagraph_mode == "FULL"
        if spec_config is not None:
            extra["speculative_config"] = spec_config
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
            if spec_config is not None and spec_config.method == "draft_model" else 0)
        self.engine = Engine(self.scheduler, self.runner, self.tokenizer, max_model_len,
                             async_scheduling=self.async_scheduling)
        self.eos_token_ids = _eos_ids(self.model_path, self.hf_config, self.tokenizer)
        self._rng = random.Random(seed)
        self._counter = 0

    # -- set-up -----------------------------------------------------------------

    def _kv_bytes_per_block(self) -> int:
        return ModelState.kv_bytes_per_block(self.hf_config, self.cache_config.block_size,
                                             self.dtype)

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

        Args:
            prompts: a string, a ``TextPrompt`` / ``TokensPrompt`` dict (``mrv2.inputs``),
                or a list of them.
            sampling_params: one ``SamplingParams`` for all prompts, or one per prompt
                (``None``: ``get_default_sampling_params()``).
            use_tqdm: show a progress bar.
            lora_request: only ``None`` (no LoRA).
            priority: ``None`` or zeros (first-come-first-served).

        Returns:
            One ``RequestOutput`` per prompt, in input order.
        """
        prompts = normalize_prompts(prompts, prompt_token_ids)
        check_unsupported_args(len(prompts), lora_request, priority)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        # Validate everything before submitting anything: a bad prompt loses no other request.
        for sp in params:
            self._check_params(sp)
        parsed = [self._parse_prompt(p, sp.truncate_prompt_tokens) for p, sp in zip(prompts, params)]
        groups: list[list[Request]] = []
        for (text, ids), sp in zip(parsed, params):
            request_id = str(self._counter)  # one id per prompt, as vLLM: contiguous with n > 1
            self._counter += 1
            groups.append([self._make_request(request_id, text, ids, sp, i) for i in range(sp.n)])
        for group in groups:
            for req in group:
                self.engine.add_request(req)
        self._run(len(groups), groups, use_tqdm)
        return [self._to_output(g) for g in groups]

    def _parse_prompt(self, prompt, truncate: int | None = None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; with skip_tokenizer_init=True "
                                 "pass {'prompt_token_ids': [...]}")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self._parse_prompt(prompt["prompt"], truncate)
        else:
            raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        ids = truncate_prompt(ids, truncate, self.scheduler_config.max_model_len)
        vocab = self.hf_config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        max_len = self.scheduler_config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"the prompt is {len(ids)} tokens long, but max_model_len is {max_len}: "
                             "it must be shorter to leave room for one generated token")
        # (The pool holds at least max_model_len tokens, checked in __init__: the prompt fits.)
        return text, ids

    def _check_params(self, sp: SamplingParams) -> None:
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        vocab = self.hf_config.vocab_size
        for name, ids in (("logit_bias", sp.logit_bias or ()),
                          ("allowed_token_ids", sp.allowed_token_ids or ())):
            if any(t >= vocab for t in ids):
                raise ValueError(f"SamplingParams.{name} holds a token id >= vocab size {vocab}")
        if sp.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (skip_tokenizer_init=True)")
        if sp.bad_words:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.bad_words needs a tokenizer "
                                 "(skip_tokenizer_init=True)")
            from mrv2.sample.bad_words import bad_words_token_ids

            sp.bad_words_token_ids = bad_words_token_ids(self.tokenizer, sp.bad_words, vocab)
        # Capacity limits and unsupported features (the V1 baseline supports fewer).
        self.runner.validate_params(sp, len(self.eos_token_ids))

    def _make_request(self, request_id: str, text, ids, sp: SamplingParams,
                      index: int) -> Request:
        sp = sp.clone()
        user_seeded = sp.seed is not None
        if sp.seed is None:
            sp.seed = self._rng.getrandbits(63)  # one seeded path serves every request
        elif index:
            sp.seed += index  # the n completions of a seeded prompt differ, reproducibly
        sp.all_stop_token_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_token_ids)
        # NOTE: the engine's id of each of the n requests is unique; the output's is the prompt's.
        req = Request(request_id if sp.n == 1 else f"{index}_{request_id}", ids, sp,
                      arrival=int(request_id), prompt=text, index=index, user_seeded=user_seeded,
                      parent_request_id=request_id, arrival_time=now())
        return req

    def _run(self, num_prompts: int, groups, use_tqdm: bool) -> None:
        bar = tqdm(total=num_prompts, desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        left = {id(g): len(g) for g in groups}
        owner = {r.request_id: id(g) for g in groups for r in g}
        out_tokens = 0
        try:
            while self.engine.has_unfinished():
                for req in self.engine.step():
                    out_tokens += len(req.output_token_ids)
                    left[owner[req.request_id]] -= 1
                    if left[owner[req.request_id]] == 0:
                        bar.update(1)
                        elapsed = bar.format_dict.get("elapsed") or 1e-9
                        bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} tok/s", refresh=False)
        finally:
            bar.close()

    def _to_output(self, group: list[Request]) -> RequestOutput:
        first = group[0]
        outs = [CompletionOutput(index=r.index, text=r.output_text, token_ids=list(r.output_token_ids),
                                 cumulative_logprob=r.cumulative_logprob, logprobs=r.logprobs,
                                 finish_reason=r.finish_reason, stop_reason=r.stop_reason)
                for r in group]
        return RequestOutput(request_id=first.parent_request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids,
                             prompt_logprobs=first.prompt_logprobs,
                             outputs=outs, finished=all(r.is_finished for r in group),
                             num_cached_tokens=max(first.num_cached_tokens, 0),
                             metrics=group_metrics(group, self.runner.spec_decode_stats))


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
