"""The public functions: dot_product_attention (jax.nn's signature on cuDNN), varlen_attention
(cumulative lengths as segment ids) and paged_attention / paged_kv_update (a paged KV cache).
jax_sdpa/__init__.py exports them; flax.py, fp8.py and ring/ are the other entry points."""
