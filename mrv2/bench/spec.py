"""Speculative decoding in the benchmark: the runner variants and the acceptance figures.

``--speculative ngram|draft_model|eagle`` (or a comma list of them, e.g.
``ngram,draft_model,eagle``) makes every benchmark compare, in the same job, the V2
runner WITHOUT speculation (label ``v2``), WITH each method (``v2-<method>``) and, with
``--sync-accepted-counts``, with the V1-style sync of the accepted counts on
(``v2-<method>-sync``): the same weights, prompts and sizes. The acceptance figures come from
the runner's ``SpecDecodeStats`` (``llm.runner.spec_decode_stats``), read before and after
each timed run and diffed, so warm-ups and untimed runs never count.
See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

from mrv2.models.loader import DEFAULT_MODEL_DIR

#: The shipped draft of the embedded model.
EMBEDDED_DRAFT_DIR = DEFAULT_MODEL_DIR.parent / f"{DEFAULT_MODEL_DIR.name}-draft"
#: The shipped EAGLE head of the embedded model.
EMBEDDED_EAGLE_DIR = DEFAULT_MODEL_DIR.parent / f"{DEFAULT_MODEL_DIR.name}-eagle"
#: Methods the benchmark knows (``--speculative`` takes one or a comma list).
METHODS = ("ngram", "draft_model", "eagle")
#: ``SpecDecodeStats`` counters that add up (``accepted_per_position`` too, per position).
_COUNTS = ("num_spec_steps", "num_draft_slots", "num_draft_tokens", "num_accepted_tokens")


def spec_variants(method: str | None, k: int, *, sync: bool = False,
                  draft_model: str | None = None, eagle_model: str | None = None,
                  prompt_lookup_max: int | None = None,
                  prompt_lookup_min: int | None = None) -> list[tuple[str, dict | None]]:
    """``(label suffix, speculative_config)`` of each V2 variant, the plain runner first.

    Args:
        method: ``"ngram"``, ``"draft_model"``, ``"eagle"``, a comma list of them, or
            ``None`` (no speculation: one variant).
        k: num_speculative_tokens.
        sync: add the variant with ``sync_accepted_counts`` on (per method).
        draft_model: the draft's folder (``draft_model`` only).
        eagle_model: the EAGLE head's folder (``eagle`` only).
        prompt_lookup_max, prompt_lookup_min: the n-gram sizes (``None``: the config's default).

    Returns:
        ``[("", None), ("-<method>", cfg), ...]`` plus ``("-<method>-sync", cfg + sync)``.
    """
    if method is None:
        return [("", None)]
    out = [("", None)]
    for m in method.split(","):
        cfg = {"method": m, "num_speculative_tokens": k}
        if m in ("draft_model", "eagle"):
            cfg["model"] = str(draft_model if m == "draft_model" else eagle_model)
        for key, value in (("prompt_lookup_max", prompt_lookup_max),
                           ("prompt_lookup_min", prompt_lookup_min)):
            if value is not None and m == "ngram":
                cfg[key] = value
        out.append((f"-{m}", cfg))
        if sync:
            out.append((f"-{m}-sync", {**cfg, "sync_accepted_counts": True}))
    return out


def snapshot(llm) -> dict | None:
    """The runner's acceptance counters now (``None`` without speculative decoding)."""
    stats = getattr(getattr(llm, "runner", None), "spec_decode_stats", None)
    if stats is None:
        return None
    return {**{key: getattr(stats, key) for key in _COUNTS},
            "accepted_per_position": list(stats.accepted_per_position)}


def delta(before: dict | None, after: dict | None) -> dict | None:
    """The counts between two snapshots, with the figures derived from them."""
    if before is None or after is None:
        return None
    counts = {key: after[key] - before[key] for key in _COUNTS}
    counts["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"],
                                                             before["accepted_per_position"])]
    return figures(counts)


def merge(runs: list[dict | None]) -> dict | None:
    """The counts of several timed runs added up (``None`` when none has any)."""
    runs = [r for r in runs if r is not None]
    if not runs:
        return None
    counts = {key: sum(r[key] for r in runs) for key in _COUNTS}
    counts["accepted_per_position"] = [sum(col) for col in
                                       zip(*(r["accepted_per_position"] for r in runs))]
    return figures(counts)


def figures(counts: dict) -> dict:
    """Acceptance figures of raw counts.

    Args:
        counts: ``num_spec_steps`` (request-steps that verified >= 1 draft slot),
            ``num_draft_slots``, ``num_draft_tokens`` (real proposals),
            ``num_accepted_tokens``, ``accepted_per_position`` (``[K]``).

    Returns:
        The counts plus ``mean_accepted_length`` (1 + accepted per speculating step, vLLM's
        definition), ``acceptance_rate`` (accepted / proposed), ``acceptance_per_position``
        (accepted at position j / speculating steps) and ``accepted_length_histogram``
        (``[K + 1]``: steps that accepted exactly 0, 1, ..., K drafts; accepted drafts are a
        prefix, so ``steps with a >= j`` is ``accepted_per_position[j - 1]``).
    """
    steps, per_pos = counts["num_spec_steps"], counts["accepted_per_position"]
    at_least = [steps] + list(per_pos) + [0]                    # steps with a >= 0 .. K + 1
    return {**counts,
            "mean_accepted_length": 1.0 + counts["num_accepted_tokens"] / max(steps, 1),
            "acceptance_rate": counts["num_accepted_tokens"] / max(counts["num_draft_tokens"], 1),
            "acceptance_per_position": [c / max(steps, 1) for c in per_pos],
            "accepted_length_histogram": [at_least[j] - at_least[j + 1]
                                          for j in range(len(per_pos) + 1)]}


def spec_pairs(labels: list[str], variants: list[tuple[str, dict | None]]) -> list[tuple]:
    """``(a, b)`` label pairs to compare: each speculating variant against the plain runner,
    and the sync variant against the one without the sync."""
    pairs = []
    for label in labels:
        for suffix, cfg in variants:
            if cfg is None or suffix not in label:
                continue
            base = label.replace(suffix, "", 1)
            if base in labels:
                pairs.append((label, base))
            if cfg.get("sync_accepted_counts") and label.replace("-sync", "", 1) in labels:
                pairs.append((label, label.replace("-sync", "", 1)))
    return pairs


def acceptance_lines(results: dict) -> list[str]:
    """Table lines: label, batch (latency; "-": a throughput workload), mean accepted
    length, acceptance rate, drafts proposed / accepted, acceptance per position."""
    rows = []
    for name, r in results.get("runners", {}).items():
        if "error" in r:
            continue
        items = ([(row["batch_size"], row.get("spec_decode")) for row in r.get("batches", [])]
                 or [(None, r.get("spec_decode"))])  # throughput: the whole workload
        rows += [(name, b, s) for b, s in items if s is not None]
    if not rows:
        return []
    lines = [f"acceptance (timed runs only; workload {results.get('workload', '?')}):",
             (f"{'runner':<20} {'batch':>5} {'mean len':>8} {'acc rate':>8} "
              f"{'proposed':>9} {'accepted':>9}  per position")]
    for name, b, s in rows:
        per = " ".join(f"{x:.2f}" for x in s["acceptance_per_position"])
        lines.append(f"{name:<20} {b if b is not None else '-':>5} "
                     f"{s['mean_accepted_length']:>8.2f} {s['acceptance_rate']:>8.2f} "
                     f"{s['num_draft_tokens']:>9d} {s['num_accepted_tokens']:>9d}  {per}")
    return lines


NOTES = [
    ("speculative decoding: v2 = the V2 runner without speculation, v2-<method> = the same "
     "runner with it, v2-<method>-sync = with sync_accepted_counts (a V1-style copy of the "
     "accepted counts to the CPU each step); same weights, prompts and sizes"),
    ("acceptance (spec_decode): the runner's SpecDecodeStats diffed around each timed run "
     "(warm-ups excluded; latency: the full runs of a batch added up). mean_accepted_length "
     "= 1 + accepted drafts per speculating request-step; acceptance_rate = accepted / real "
     "proposals (num_draft_tokens); acceptance_per_position[j] = steps that accepted draft j / "
     "speculating steps; num_draft_slots counts scheduled slots, proposals or not"),
    ("TPOT with speculation is wall time per returned token: an accepted run returns several "
     "tokens in one step"),
]
