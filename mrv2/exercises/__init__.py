"""Checkers for the book's "build it yourself" exercises (Triton-Puzzles style).

Each ``check_*`` runs the learner's function (or Triton kernel, under the interpreter on a
CPU) against the package's own reference on random and edge-case inputs, and either prints
how many cases passed or raises :class:`ExerciseFailed` saying which case, which output and
where it differs. The exercises sit in the chapters' "Exercises" sections; the solutions in
``notebooks/solutions/``; the learner copies (skeletons, no outputs) in ``notebooks/clean/``
(``scripts/make_clean_notebooks.py``).
"""

from mrv2.exercises.checks import (
    ExerciseFailed,
    check_gumbel_argmax_kernel,
    check_prepare_inputs,
    check_slot_mapping_kernel,
)

__all__ = ["ExerciseFailed", "check_gumbel_argmax_kernel", "check_prepare_inputs",
           "check_slot_mapping_kernel"]

# --- chapters 01, 02, 06, 07 (mrv2/exercises/ch01.py, ch02.py, ch06.py, ch07.py) -------------
from mrv2.exercises.ch01 import check_paged_decode_attention
from mrv2.exercises.ch02 import check_state_rows
from mrv2.exercises.ch06 import check_sampled_logprobs_kernel
from mrv2.exercises.ch07 import check_post_update_kernel

__all__ += ["check_paged_decode_attention", "check_post_update_kernel",
            "check_sampled_logprobs_kernel", "check_state_rows"]

# --- chapters 08-12 (mrv2/exercises/ch08_10.py, ch11_12.py) -------------------------------
from mrv2.exercises.ch08_10 import (
    check_accept_kernel,
    check_decode_roofline,
    check_graph_padding,
)
from mrv2.exercises.ch11_12 import check_serve_stats, check_tp_shard

__all__ += ["check_accept_kernel", "check_decode_roofline", "check_graph_padding",
            "check_serve_stats", "check_tp_shard"]
