"""The V1-style baseline runner: same model, kernels and API as mrv2's V2 runner.

vLLM's first model runner keeps a *persistent batch* whose row order is both the
batch order and the block-table layout, so requests joining and leaving move rows
around (``condense``, ``swap_states``); a ``CachedRequestState`` backup of every
request lives on the CPU; the step's inputs (``input_ids``, ``positions``,
``query_start_loc``, ``seq_lens``, ``slot_mapping``) are built with numpy and
copied to the device; and the sampled ids are copied back with a blocking sync
before the next step can be prepared. V2 replaces all of this with a stable state
table on the device, Triton input preparation and asynchronous outputs. This
package exists to measure that difference fairly (``LLM(runner="v1")`` or
``MRV2_USE_V2_MODEL_RUNNER=0``).
"""

from mrv2.v1.runner import V1ModelRunner

__all__ = ["V1ModelRunner"]
