"""Benchmark workloads: random-token prompts with per-request output lengths.

Every runner of one benchmark sees the very same prompts (numpy
``RandomState(seed)``: lengths first, then the token ids), so the figures compare
runners, not inputs. Token ids are uniform in ``[0, vocab)``; requests set
``ignore_eos`` so each produces exactly its requested number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The workloads of DESIGN.md ("Benchmarks"): requests and (low, high) length ranges.
WORKLOADS = {
    "standard": {"num_requests": 256, "input_len": (100, 1024), "output_len": (100, 1024)},
    "host-bound": {"num_requests": 1024, "input_len": (32, 32), "output_len": (128, 128)},
}

#: ``--tiny``: the same shapes, shrunk so the Triton interpreter runs them in seconds.
TINY_WORKLOADS = {
    "standard": {"num_requests": 4, "input_len": (8, 20), "output_len": (3, 8)},
    "host-bound": {"num_requests": 6, "input_len": (8, 8), "output_len": (5, 5)},
}

#: Sampling of every benchmark request (nano-vllm / mini-sglang protocol).
TEMPERATURE = 0.6


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


def make_workload(name: str, vocab_size: int, seed: int = 0, num_requests: int | None = None,
                  input_len: int | None = None, output_len: int | None = None,
                  tiny: bool = False) -> Workload:
    """A named throughput workload, with optional overrides.

    Args:
        name: ``"standard"`` or ``"host-bound"``.
        vocab_size: the model's vocabulary size.
        seed: the workload seed.
        num_requests: overrides the number of requests.
        input_len, output_len: override the length ranges with one fixed length.
        tiny: the CPU preset (``TINY_WORKLOADS``).

    Returns:
        The ``Workload``.
    """
    table = TINY_WORKLOADS if tiny else WORKLOADS
    if name not in table:
        raise ValueError(f"workload must be one of {sorted(table)}, got {name!r}")
    spec = table[name]
    return random_workload(name, num_requests or spec["num_requests"],
                           (input_len,) * 2 if input_len else spec["input_len"],
                           (output_len,) * 2 if output_len else spec["output_len"],
                           vocab_size, seed)
