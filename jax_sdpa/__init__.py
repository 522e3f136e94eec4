"""jax_sdpa: cuDNN fused flash attention, forward and backward, for JAX."""

import jax as _jax

from jax_sdpa.common.versions import check_jax as _check_jax

_check_jax(_jax.__version__)

from jax_sdpa.cudnn.extension import (cudnn_version, export_disabled_checks, graph_cache_stats,
                                 register_ffi_targets)
from jax_sdpa.api.attention import dot_product_attention
from jax_sdpa.api.explain import explain
from jax_sdpa.api.paged import paged_attention, paged_kv_update
from jax_sdpa.reference.attention import alibi_slopes, attention_reference
from jax_sdpa.api.varlen import varlen_attention
from jax_sdpa import masks

__all__ = ["dot_product_attention", "explain", "varlen_attention", "paged_attention",
           "paged_kv_update", "attention_reference", "alibi_slopes", "cudnn_version", "masks",
           "export_disabled_checks", "graph_cache_stats", "register_ffi_targets"]
__version__ = "0.1.0"
