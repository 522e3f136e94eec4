"""One call's description, from the keyword arguments to the kernels: spec.py (CallSpec, the
frozen description, its scalar options checked), validation.py (the arrays checked and
folded), planning.py (whether cuDNN runs it, the spec refined for cuDNN, the one place that
warns or raises for a fallback) and inputs.py (the kernels' inputs of a planned call)."""
