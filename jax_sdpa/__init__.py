"""jax_sdpa: cuDNN fused flash attention, forward and backward, for JAX."""

import jax as _jax

from jax_sdpa.versions import check_jax as _check_jax

_check_jax(_jax.__version__)

from jax_sdpa._ffi import cudnn_version, graph_cache_stats
from jax_sdpa.attention import dot_product_attention
from jax_sdpa.reference import attention_reference

__all__ = ["dot_product_attention", "attention_reference", "cudnn_version", "graph_cache_stats"]
__version__ = "0.1.0"
