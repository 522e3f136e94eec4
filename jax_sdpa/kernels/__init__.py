"""The kernel layer, below the public functions: vjp.py (forward and backward joined by
jax.custom_vjp, the forward's stats as the residual), sharding.py (custom_partitioning and
custom_vmap), dispatch.py (the switch by implementation and job), fp8.py (FP8 on cuDNN:
quantize, call, dequantize) and sink_softmax.py (sinks as a rescaling of any kernel's
output)."""
