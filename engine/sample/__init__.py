"""Sampling on the device: batched greedy/temperature/top-k/top-p/min-p (``sampler``), logits
processing (``logits``, ``bad_words``) and logprobs."""
