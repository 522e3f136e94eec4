"""jax_sdpa."""
