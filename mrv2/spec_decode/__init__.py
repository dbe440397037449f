"""Speculative decoding: proposers, verification and the draft slots of the state table."""
