"""Sampling for a whole batch: the sampler and the rejection sampler of speculative decoding."""
