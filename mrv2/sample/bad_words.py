"""``bad_words``: never generate a listed word, as a per-row logit rule on the device.

vLLM tokenizes every bad word (with and without a leading space) into token-id
sequences; at each step the *last* token of a sequence is banned (logit -inf)
when the row's generated tokens end with the sequence's other tokens (a one-token
word is always banned). Only generated tokens count, not the prompt, as in vLLM.
V1 looped over the batch on the CPU with each request's output list; here every
state-table row stores its sequences in fixed device arrays, written once at
admission (staged, one indexed copy per array), and one Triton kernel reads the
row's history from ``state.token_ids`` through ``idx_mapping``: no sync, no host list.

Per row: ``num_words`` int32 ``[R]``, ``word_lens`` int32 ``[R, max_words]``, ``words``
int32 ``[R, max_words, max_word_len]`` (padded with -1).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from mrv2.state import to_device_async

MAX_BAD_WORDS = 32     # token sequences per request (each word gives one or two)
MAX_BAD_WORD_LEN = 16  # tokens per sequence


def bad_words_token_ids(tokenizer, bad_words: list[str], vocab_size: int) -> list[list[int]]:
    """Token-id sequences of ``bad_words``, as vLLM builds them.

    Each word is encoded as written (left-stripped) and, when that gives a different
    first token but the same length, once more with a leading space (the form a word
    takes mid-sentence).

    Args:
        tokenizer: a Hugging Face tokenizer.
        bad_words: the words.
        vocab_size: the model's vocabulary size (longer ids are refused).

    Returns:
        The sequences, each a non-empty list of token ids.

    Raises:
        ValueError: a token id outside the model's vocabulary, or too many / too long.
    """
    seqs: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        seqs.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    for seq in seqs:
        if any(t >= vocab_size for t in seq):
            raise ValueError(f"SamplingParams.bad_words: token ids {seq} reach past the "
                             f"model's vocabulary size {vocab_size}")
        if len(seq) > MAX_BAD_WORD_LEN:
            raise ValueError(f"SamplingParams.bad_words: a word is {len(seq)} tokens long; "
                             f"at most {MAX_BAD_WORD_LEN}")
    if len(seqs) > MAX_BAD_WORDS:
        raise ValueError(f"SamplingParams.bad_words gives {len(seqs)} token sequences; "
                         f"at most {MAX_BAD_WORDS}")
    return seqs


@triton.jit
def _bad_words_kernel(
    logits_ptr, idx_mapping_ptr, num_words_ptr, word_lens_ptr, words_ptr,  # inputs (logits
    token_ids_ptr, prompt_len_ptr, total_len_ptr,                          # in place)
    vocab_size,                                                            # sizes
    logits_stride, word_lens_stride, words_stride_row, words_stride_word,  # strides
    token_ids_stride,
    BLOCK_L: tl.constexpr,
):
    b = tl.program_id(0)  # one program per batch slot
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    n = tl.load(num_words_ptr + row)
    total = tl.load(total_len_ptr + row)
    num_output = total - tl.load(prompt_len_ptr + row)
    j = tl.arange(0, BLOCK_L)
    ids_row = token_ids_ptr + row * token_ids_stride
    for w in range(n):
        # Load: the word (padded) and the row's last (length - 1) generated tokens.
        length = tl.load(word_lens_ptr + row * word_lens_stride + w)
        word_ptr = words_ptr + row * words_stride_row + w * words_stride_word
        word = tl.load(word_ptr + j, mask=j < length, other=-1)
        # NOTE: a word longer than the output + 1 cannot match: compare nothing, ban nothing.
        fits = length - 1 <= num_output
        num_prefix = tl.where(fits, length - 1, 0)
        hist = tl.load(ids_row + total - num_prefix + j, mask=j < num_prefix, other=-1)
        # Compute: the prefix matches when no position of it differs.
        mismatches = tl.sum(tl.where((j < num_prefix) & (hist != word), 1, 0), axis=0)
        last = tl.sum(tl.where(j == length - 1, word, 0), axis=0)
        ok = tl.where(fits & (last < vocab_size), mismatches, 1)
        # Store: -inf on the word's last token (lane 0 writes it when the prefix matched).
        tl.store(logits_ptr + b * logits_stride + last + j * 0,
                 tl.full([BLOCK_L], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
                 mask=(j == 0) & (ok + j * 0 == 0))


def bad_words_banned_ref(output_token_ids: list[int], seqs: list[list[int]]) -> set[int]:
    """Plain-Python specification: the tokens ``seqs`` ban after ``output_token_ids``."""
    banned = set()
    for seq in seqs:
        k = len(seq) - 1
        if k <= len(output_token_ids) and output_token_ids[len(output_token_ids) - k:] == seq[:k]:
            banned.add(seq[-1])
    return banned


def apply_bad_words_ref(logits: torch.Tensor, outputs: list[list[int]],
                        seqs: list[list[list[int]]]) -> torch.Tensor:
    """Torch reference: ``logits [B, V]`` with each row's banned tokens set to -inf.

    Args:
        logits: ``[B, V]`` logits (not modified).
        outputs: per batch slot, the generated token ids so far.
        seqs: per batch slot, its bad-word token sequences.
    """
    out = logits.clone()
    for b, (output, row_seqs) in enumerate(zip(outputs, seqs)):
        banned = sorted(bad_words_banned_ref(output, row_seqs))
        if banned:
            out[b, torch.tensor(banned, dtype=torch.int64)] = float("-inf")
    return out


class BadWordsState:
    """Per-row bad-word sequences on the device, and the kernel that applies them.

    Args:
        max_num_reqs: rows of the state table.
        device: where the tables live.
        max_words, max_word_len: capacity per row (``bad_words_token_ids`` checks them).
    """

    def __init__(self, max_num_reqs: int, device: torch.device | str,
                 max_words: int = MAX_BAD_WORDS, max_word_len: int = MAX_BAD_WORD_LEN):
        self.device = torch.device(device)
        self.max_words, self.max_word_len = max_words, max_word_len
        self.num_words = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)  # [R]
        self.word_lens = torch.zeros(max_num_reqs, max_words, dtype=torch.int32,
                                     device=self.device)                    # [R, W]
        self.words = torch.full((max_num_reqs, max_words, max_word_len), -1, dtype=torch.int32,
                                device=self.device)                         # [R, W, L]
        # CPU flags: which rows have words (for any_active) and which device rows are stale.
        self._active = np.zeros(max_num_reqs, dtype=bool)
        self._dirty = np.zeros(max_num_reqs, dtype=bool)
        self._staged: dict[int, list[list[int]]] = {}

    def add_request(self, row: int, sampling_params) -> None:
        """Stage ``row``'s sequences (``sampling_params.bad_words_token_ids``)."""
        seqs = list(getattr(sampling_params, "bad_words_token_ids", None) or [])
        if len(seqs) > self.max_words or any(not 0 < len(s) <= self.max_word_len for s in seqs):
            raise ValueError(f"bad_words: at most {self.max_words} sequences of 1 to "
                             f"{self.max_word_len} tokens, got lengths {[len(s) for s in seqs]}")
        self._active[row] = bool(seqs)
        if seqs or self._dirty[row]:  # NOTE: a row without words only zeroes a stale count
            self._staged[row] = seqs

    def remove_request(self, row: int) -> None:
        self._active[row] = False
        self._staged.pop(row, None)

    def any_active(self, rows) -> bool:
        """Whether any of ``rows`` has bad words (CPU only)."""
        return bool(self._active[rows].any())

    def apply_staged_writes(self) -> None:
        """Write the staged rows: three host->device copies and three indexed copies."""
        if not self._staged:
            return
        rows = sorted(self._staged)
        n = len(rows)
        num = np.zeros(n, dtype=np.int32)
        lens = np.zeros((n, self.max_words), dtype=np.int32)
        words = np.full((n, self.max_words, self.max_word_len), -1, dtype=np.int32)
        for i, row in enumerate(rows):
            seqs = self._staged[row]
            num[i] = len(seqs)
            for w, seq in enumerate(seqs):
                lens[i, w] = len(seq)
                words[i, w, :len(seq)] = seq
            self._dirty[row] = bool(seqs)
        self._staged.clear()
        index = to_device_async(np.array(rows, dtype=np.int64), self.device)
        self.num_words.index_copy_(0, index, to_device_async(num, self.device))
        self.word_lens.index_copy_(0, index, to_device_async(lens, self.device))
        self.words.index_copy_(0, index, to_device_async(words, self.device))

    def apply(self, logits: torch.Tensor, idx_mapping: torch.Tensor, state) -> torch.Tensor:
        """Ban, in place, each row's bad-word tokens whose prefix was just generated.

        Args:
            logits: ``[B, V]`` logits.
            idx_mapping: int32 ``[>= B]`` batch slot -> state-table row.
            state: the ``RequestStateTable`` (``token_ids``, ``prompt_len``, ``total_len``).

        Returns:
            ``logits``.
        """
        num_reqs, vocab_size = logits.shape
        if num_reqs:
            _bad_words_kernel[(num_reqs,)](
                logits, idx_mapping, self.num_words, self.word_lens, self.words,
                state.token_ids, state.prompt_len, state.total_len,
                vocab_size, logits.stride(0), self.word_lens.stride(0), self.words.stride(0),
                self.words.stride(1), state.token_ids.stride(0),
                BLOCK_L=triton.next_power_of_2(self.max_word_len))
        return logits
