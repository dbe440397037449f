"""Speculative decoding: the config, the n-gram proposer and draft verification on the device.

``config.py`` checks vLLM's ``speculative_config`` dict; ``ngram.py`` proposes drafts by
prompt lookup in the state table's token buffer; ``draft_model.py`` and ``eagle.py`` (an EAGLE-1
head over the target's hidden states, ``eagle_head.py``) run small models; ``verify.py`` accepts or rejects them
(``exact``: the target's own stateless Gumbel sample; ``probabilistic``: Leviathan / Chen
rejection sampling); ``draft_slots.py`` puts the drafts into the state table's token buffer
for the unchanged ``prepare_inputs`` and appends the accepted tokens on the device, where
the next step reads them. See notebooks/09_speculative_decoding.ipynb.
"""

from mrv2.spec_decode.config import SpeculativeConfig, check_draft_compatible
from mrv2.spec_decode.draft_slots import spec_post_update, write_draft_slots
from mrv2.spec_decode.ngram import ngram_propose, ngram_propose_ref
from mrv2.spec_decode.verify import VerifyOutput, exact_verify, probabilistic_verify

__all__ = ["SpeculativeConfig", "VerifyOutput", "check_draft_compatible", "exact_verify",
           "ngram_propose", "ngram_propose_ref", "probabilistic_verify", "spec_post_update",
           "write_draft_slots"]
