"""The benchmark configurations: the shapes the peers were measured at (docs/PERFORMANCE.md), so
our figures line up with theirs."""

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: object
    causal: bool
    run_xla: bool = True  # the XLA path materialises [B, N, S, S] scores: skip it where too big

    def forward_flops(self) -> float:
        # Two matmuls of 2*B*N*S*S*H each; causal computes half of the score matrix.
        flops = 4.0 * self.batch * self.q_heads * self.seq * self.seq * self.head_dim
        return flops / 2 if self.causal else flops

    def backward_flops(self) -> float:
        return 2.5 * self.forward_flops()


ANCHOR_CONFIGS = [
    Config("gpt2-seed", 4, 1024, 12, 12, 64, jnp.float16, True),
    Config("d128-s4k-causal", 2, 4096, 16, 16, 128, jnp.bfloat16, True),
    Config("d128-s4k-full", 2, 4096, 16, 16, 128, jnp.bfloat16, False),
    Config("d128-s16k-causal", 1, 16384, 16, 16, 128, jnp.bfloat16, True, run_xla=False),
    Config("gqa-s8k-causal", 2, 8192, 32, 8, 128, jnp.bfloat16, True, run_xla=False),
    Config("d64-s8k-causal", 4, 8192, 16, 16, 64, jnp.bfloat16, True, run_xla=False),
    Config("d256-s4k-causal", 2, 4096, 16, 16, 256, jnp.bfloat16, True),
]


def parse_config(text: str) -> Config:
    """'name:B,S,Nq,Nkv,H,dtype,causal|full', e.g. 'mine:2,2048,16,4,128,bf16,causal'."""
    name, _, spec = text.partition(":")
    b, s, n, k, h, dtype, mask = spec.split(",")
    dtypes = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
    return Config(name, int(b), int(s), int(n), int(k), int(h), dtypes[dtype], mask == "causal",
                  run_xla=int(b) * int(n) * int(s) ** 2 <= 2 * 16 * 4096 ** 2)
