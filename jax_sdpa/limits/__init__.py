"""What cuDNN can run, one module per feature, asked before anything is traced: each function
answers None (it can) or the reason it cannot, in one sentence a user can act on, which the
planner (jax_sdpa/call/planning.py) turns into a warning or an error (and the entry points of
paged, ring and FP8 attention ask the same functions)."""
