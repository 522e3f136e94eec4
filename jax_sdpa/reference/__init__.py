"""The semantics in plain JAX: attention.py (attention_reference, the float32 oracle and the
path for every call cuDNN cannot take), empty_rows.py (rows that see no key: the rule, the
value, the repair), kernel.py (the reference behind the kernels' calling convention), paged.py
and fp8.py (the paged and FP8 calls' references) and fp8_scaling.py (the FP8 recipe)."""
