"""Score modifiers on cuDNN: a JAX function score_mod(score, batch, head, q_index, kv_index)
written as cuDNN pointwise programs, forward and derivative (program.py)."""
