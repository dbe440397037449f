"""Benchmark workloads: random-token prompts with per-request output lengths.

Every runner of one benchmark sees the very same prompts (numpy
``RandomState(seed)``: lengths first, then the token ids), so the figures compare
runners, not inputs. Token ids are uniform in ``[0, vocab)``; requests set
``ignore_eos`` so each produces exactly its requested number of tokens.

``shared-prefix`` (prefix caching): every prompt is one shared prefix (a system prompt)
followed by its own distinct tokens. Each timed run draws new distinct tokens, so only
the prefix can be found in the cache, never a whole prompt of an earlier run; the other
workloads start every timed run with an empty prefix cache (``keep_prefix_cache``).

``repetitive`` (speculative decoding): prompts that repeat a loop, so a proposer that looks
up the request's own tokens finds real drafts. For the embedded model the loop is its own
natural greedy loop (``EMBEDDED_LOOP``, its continuation repeats it: acceptance is real);
for any other model a random ``period``-token n-gram per request, repeated (whether the
model continues it is up to the model: the benchmark reports the acceptance it measured).
Greedy by default (``temperature=0``).

``shakespeare`` (speculative decoding, latency): held-out text, where proposers differ. Each
request's prompt is its own window of the validation split (the last 10% of the characters,
the split the embedded model and its draft / EAGLE head were not trained on) of
``$MRV2_SHARED_DATA/tinyshakespeare.txt``, starting at a line start, tokenized with the
model's tokenizer; greedy. The model's own greedy loop (``repetitive``) is accepted whole by
every proposer; natural text is not.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np

#: The workloads of DESIGN.md ("Benchmarks"): requests and (low, high) length ranges.
WORKLOADS = {
    "standard": {"num_requests": 256, "input_len": (100, 1024), "output_len": (100, 1024)},
    "host-bound": {"num_requests": 1024, "input_len": (32, 32), "output_len": (128, 128)},
    "shared-prefix": {"num_requests": 256, "prefix_len": 1024, "suffix_len": 64,
                      "output_len": 128},
    "repetitive": {"num_requests": 64, "input_len": (128, 128), "output_len": (256, 256)},
}

#: ``--tiny``: the same shapes, shrunk so the Triton interpreter runs them in seconds.
TINY_WORKLOADS = {
    "standard": {"num_requests": 4, "input_len": (8, 20), "output_len": (3, 8)},
    "host-bound": {"num_requests": 6, "input_len": (8, 8), "output_len": (5, 5)},
    "shared-prefix": {"num_requests": 4, "prefix_len": 32, "suffix_len": 5, "output_len": 3},
    "repetitive": {"num_requests": 4, "input_len": (16, 16), "output_len": (6, 6)},
}

#: Sampling of every benchmark request (nano-vllm / mini-sglang protocol).
TEMPERATURE = 0.6
#: The embedded model's own greedy loop after "JULIET:" (11 tokens; tests/test_spec_decode_e2e).
EMBEDDED_LOOP = [952, 26, 199, 47, 12, 292, 359, 850, 1, 199, 199]
#: ``repetitive`` with another model: the length of each request's random repeated n-gram.
REPETITIVE_PERIOD = 11
#: ``shakespeare``: the text's file name in $MRV2_SHARED_DATA, and where its validation split
#: starts (the fraction of the characters before it: the training scripts' split).
SHAKESPEARE_FILE = "tinyshakespeare.txt"
SHAKESPEARE_VAL_START = 0.9


@dataclass
class Workload:
    """A list of requests: prompt token ids and how many tokens each must generate.

    Args:
        name: workload name (``"standard"``, ``"host-bound"``, ``"latency-b8"`` ...).
        prompts: token ids of each prompt.
        output_lens: tokens to generate for each request.
        temperature: sampling temperature of every request.
    """

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float = TEMPERATURE
    #: Keep the prefix cache warm between runs (else each timed run starts it empty).
    keep_prefix_cache = False

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def output_tokens(self) -> int:
        """Tokens the workload asks for in total (the numerator of output tokens/s)."""
        return int(sum(self.output_lens))

    @property
    def max_len(self) -> int:
        """Longest prompt + output: the ``max_model_len`` the workload needs."""
        return max(i + o for i, o in zip(self.input_lens, self.output_lens))

    def requests(self) -> list[dict]:
        """Prompts in ``LLM.generate`` form: ``[{"prompt_token_ids": [...]}, ...]``."""
        return [{"prompt_token_ids": p} for p in self.prompts]

    def sampling_params(self, max_tokens: int | None = None) -> list:
        """One ``SamplingParams`` per request (``max_tokens`` overrides every length)."""
        from mrv2.sampling_params import SamplingParams

        return [SamplingParams(temperature=self.temperature, ignore_eos=True,
                               max_tokens=max_tokens or n) for n in self.output_lens]

    def subset(self, k: int, name: str | None = None) -> Workload:
        """The first ``k`` requests (the order is random already, so a fair sample)."""
        return Workload(name or f"{self.name}[:{k}]", self.prompts[:k], self.output_lens[:k],
                        self.temperature)

    def summary(self) -> dict:
        """Sizes for the results JSON."""
        ins, outs = self.input_lens, self.output_lens
        return {"name": self.name, "num_requests": self.num_requests,
                "input_len_mean": float(np.mean(ins)), "input_len_min": int(min(ins)),
                "input_len_max": int(max(ins)), "output_len_mean": float(np.mean(outs)),
                "output_len_min": int(min(outs)), "output_len_max": int(max(outs)),
                "output_tokens": self.output_tokens, "temperature": self.temperature}


def random_workload(name: str, num_requests: int, input_len: tuple[int, int],
                    output_len: tuple[int, int], vocab_size: int, seed: int = 0) -> Workload:
    """Random prompts with lengths uniform in the given inclusive ranges.

    Args:
        name: workload name.
        num_requests: number of requests.
        input_len, output_len: inclusive ``(low, high)`` ranges (equal ends: a fixed length).
        vocab_size: token ids are drawn uniform in ``[0, vocab_size)``.
        seed: seeds ``numpy.random.RandomState``.

    Returns:
        The ``Workload``.
    """
    for what, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{what} range must satisfy 1 <= low <= high, got ({lo}, {hi})")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rs = np.random.RandomState(seed)
    in_lens = rs.randint(input_len[0], input_len[1] + 1, size=num_requests)
    out_lens = rs.randint(output_len[0], output_len[1] + 1, size=num_requests)
    prompts = [rs.randint(0, vocab_size, size=int(n)).tolist() for n in in_lens]
    return Workload(name, prompts, [int(n) for n in out_lens])


class SharedPrefixWorkload(Workload):
    """One shared prefix + distinct tokens per request; new distinct tokens every run.

    ``prompts`` holds draw 0 (what the warm-up and the lengths use); each
    ``requests()`` call draws the next set of distinct tokens (seeded by the draw), so a
    timed run can hit the prefix but never a whole prompt from an earlier run.
    """

    keep_prefix_cache = True

    def __init__(self, name: str, prefix: list[int], suffix_len: int, output_lens: list[int],
                 vocab_size: int, seed: int = 0, temperature: float = TEMPERATURE):
        self.prefix, self.suffix_len, self.vocab_size, self.seed = prefix, suffix_len, vocab_size, seed
        self._draws = 0
        super().__init__(name, self._draw(0, len(output_lens)), output_lens, temperature)

    def _draw(self, k: int, n: int) -> list[list[int]]:
        rs = np.random.RandomState([self.seed, k + 1])
        return [self.prefix + rs.randint(0, self.vocab_size, size=self.suffix_len).tolist()
                for _ in range(n)]

    def requests(self) -> list[dict]:
        """The prompts of the next draw (1, 2, ...) in ``LLM.generate`` form."""
        self._draws += 1
        return [{"prompt_token_ids": p} for p in self._draw(self._draws, self.num_requests)]

    def summary(self) -> dict:
        return {**super().summary(), "prefix_len": len(self.prefix), "suffix_len": self.suffix_len}


def shared_prefix_workload(name: str, num_requests: int, prefix_len: int, suffix_len: int,
                           output_len: int, vocab_size: int, seed: int = 0) -> SharedPrefixWorkload:
    """``num_requests`` prompts of one random ``prefix_len`` prefix + ``suffix_len`` own tokens.

    Args:
        name: workload name.
        num_requests, prefix_len, suffix_len, output_len: sizes (``suffix_len >= 1``).
        vocab_size: token ids are uniform in ``[0, vocab_size)``.
        seed: seeds the prefix and every draw of distinct tokens.

    Returns:
        The ``SharedPrefixWorkload``.
    """
    for what, v in (("num_requests", num_requests), ("prefix_len", prefix_len),
                    ("suffix_len", suffix_len), ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{what} must be >= 1, got {v}")
    prefix = np.random.RandomState([seed, 0]).randint(0, vocab_size, size=prefix_len).tolist()
    return SharedPrefixWorkload(name, prefix, suffix_len, [output_len] * num_requests,
                                vocab_size, seed)


def repetitive_workload(name: str, num_requests: int, input_len: int, output_len: int,
                        vocab_size: int, seed: int = 0, loop: list[int] | None = None,
                        temperature: float = 0.0) -> Workload:
    """Prompts that repeat a loop: ``loop`` rotated by the request's index (so the prompts
    differ), or, with ``loop=None``, a random ``REPETITIVE_PERIOD``-token n-gram per request.

    Args:
        name: workload name.
        num_requests, input_len, output_len: sizes (fixed lengths).
        vocab_size: random n-grams are uniform in ``[0, vocab_size)``.
        seed: seeds the random n-grams.
        loop: the model's own loop (``EMBEDDED_LOOP`` for the embedded model), or ``None``.
        temperature: of every request (greedy by default).

    Returns:
        The ``Workload``.
    """
    for what, v in (("num_requests", num_requests), ("input_len", input_len),
                    ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{what} must be >= 1, got {v}")
    rs = np.random.RandomState([seed, 7])
    prompts = []
    for i in range(num_requests):
        unit = (loop[i % len(loop):] + loop[:i % len(loop)] if loop is not None
                else rs.randint(0, vocab_size, size=REPETITIVE_PERIOD).tolist())
        prompts.append((unit * (input_len // len(unit) + 1))[:input_len])
    return Workload(name, prompts, [output_len] * num_requests, temperature)


def shakespeare_workload(name: str, num_requests: int, input_len: int, output_len: int,
                         text_path, tokenizer, seed: int = 0,
                         temperature: float = 0.0) -> Workload:
    """Held-out prompts: one window of the text's validation split per request.

    Each prompt is the first ``input_len`` tokens of the text from a line start of the
    validation split (the last ``1 - SHAKESPEARE_VAL_START`` of the characters), the line
    starts drawn without replacement (``RandomState([seed, 11])``), so every request has its
    own prompt and the same seed gives the same prompts.

    Args:
        name: workload name.
        num_requests, input_len, output_len: sizes (fixed lengths).
        text_path: the text (``$MRV2_SHARED_DATA/tinyshakespeare.txt``).
        tokenizer: the model's (a Hugging Face tokenizer: ``encode(text,
            add_special_tokens=False)``).
        seed: seeds the choice of windows.
        temperature: of every request (greedy by default).

    Returns:
        The ``Workload``.

    Raises:
        FileNotFoundError: no file at ``text_path``.
        ValueError: bad sizes, or a split with too few line starts or too little text.
    """
    for what, v in (("num_requests", num_requests), ("input_len", input_len),
                    ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{what} must be >= 1, got {v}")
    path = pathlib.Path(text_path)
    if not path.is_file():
        raise FileNotFoundError(f"the shakespeare workload reads {path}: not found (set "
                                f"MRV2_SHARED_DATA to the folder holding {SHAKESPEARE_FILE})")
    text = path.read_text(encoding="utf-8")
    val = text[int(SHAKESPEARE_VAL_START * len(text)):]
    # Line starts with enough text after them: 8 characters per token is ample here.
    span = 8 * input_len
    starts = [i + 1 for i, c in enumerate(val[:max(0, len(val) - span)]) if c == "\n"]
    if len(starts) < num_requests:
        raise ValueError(f"{path}: its validation split has {len(starts)} line starts with "
                         f"{span} characters after them, fewer than num_requests="
                         f"{num_requests}")
    picks = np.random.RandomState([seed, 11]).choice(len(starts), num_requests, replace=False)
    prompts = []
    for i in picks:
        ids = tokenizer.encode(val[starts[i]:starts[i] + span], add_special_tokens=False)
        if len(ids) < input_len:
            raise ValueError(f"{path}: a window of {span} characters gave only {len(ids)} "
                             f"tokens, fewer than input_len={input_len}")
        prompts.append(list(ids[:input_len]))
    return Workload(name, prompts, [output_len] * num_requests, temperature)


def make_workload(name: str, vocab_size: int, seed: int = 0, num_requests: int | None = None,
                  input_len: int | None = None, output_len: int | None = None,
                  tiny: bool = False, prefix_len: int | None = None,
                  suffix_len: int | None = None, loop: list[int] | None = None) -> Workload:
    """A named throughput workload, with optional overrides.

    Args:
        name: ``"standard"``, ``"host-bound"``, ``"shared-prefix"`` or ``"repetitive"``.
        vocab_size: the model's vocabulary size.
        seed: the workload seed.
        num_requests: overrides the number of requests.
        input_len, output_len: override the length ranges with one fixed length.
        tiny: the CPU preset (``TINY_WORKLOADS``).
        prefix_len, suffix_len: override the shared-prefix sizes.
        loop: ``repetitive``: the model's own loop (``None``: random repeated n-grams).

    Returns:
        The ``Workload``.
    """
    table = TINY_WORKLOADS if tiny else WORKLOADS
    if name not in table:
        raise ValueError(f"workload must be one of {sorted(table)}, got {name!r}")
    spec = table[name]
    if name == "shared-prefix":
        return shared_prefix_workload(name, num_requests or spec["num_requests"],
                                      prefix_len or spec["prefix_len"],
                                      suffix_len or spec["suffix_len"],
                                      output_len or spec["output_len"], vocab_size, seed)
    if name == "repetitive":
        return repetitive_workload(name, num_requests or spec["num_requests"],
                                   input_len or spec["input_len"][0],
                                   output_len or spec["output_len"][0], vocab_size, seed, loop)
    return random_workload(name, num_requests or spec["num_requests"],
                           (input_len,) * 2 if input_len else spec["input_len"],
                           (output_len,) * 2 if output_len else spec["output_len"],
                           vocab_size, seed)
