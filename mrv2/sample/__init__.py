"""The sampling stage of the runner: logits of the scheduled rows in, token ids out."""

from mrv2.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from mrv2.sample.states import SamplingStates, register_sampling_rule

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingStates",
           "register_sampling_rule"]
