"""The sampling stage of the runner: logits of the scheduled rows in, token ids out."""

from mrv2.sample.sampler import Sampler, SamplingMetadata

__all__ = ["Sampler", "SamplingMetadata"]
