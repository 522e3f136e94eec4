"""Masks at the cost of what they keep: a jax_sdpa.masks description cut, at trace time, into
rectangles of query rows x keys that our dense target runs at their own cost (dense, causal
from either corner, a band ending on a diagonal), merged by log-sum-exp. `intervals` reads the
keys each row keeps from a description's structure; `plan` cuts them into pieces."""
