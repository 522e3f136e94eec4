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
    # NVIDIA's published (forward, backward) TFLOP/s for this shape, and where from; a reference
    # row in the table, not a measurement of ours.
    published: tuple | None = None

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
    Config("llama3.1-s16k", 1, 16384, 64, 8, 128, jnp.bfloat16, True, run_xla=False,
           published=(673.0, 579.0, "NVIDIA, cuDNN 9.19.1 on H200 (cudnn-frontend "
                                     "benchmark/sdpa_benchmark_training/results/"
                                     "h200_919_only_cudnn)")),
]

PUBLISHED = "NVIDIA published"


def published_rows(config, rows):
    """Reference rows (impl PUBLISHED) at NVIDIA's published throughput for this shape: fwd at
    its forward figure, fwd+bwd at the time both figures give; ratios against the measured jax.nn
    cudnn and flash-attn3-jax rows where present."""
    if config.published is None:
        return []
    forward, backward, _ = config.published
    seconds = {"fwd": config.forward_flops() / (forward * 1e12),
               "fwd+bwd": (config.forward_flops() / (forward * 1e12) +
                           config.backward_flops() / (backward * 1e12))}
    result = []
    for mode, time_s in seconds.items():
        flops = config.forward_flops() * (1 if mode == "fwd" else 3.5)
        peers = {r["impl"]: r["ms"] for r in rows if r["mode"] == mode}
        result.append(dict(config=config.name, impl=PUBLISHED, mode=mode, ms=time_s * 1e3,
                           tflops=flops / time_s / 1e12, spread=0.0,
                           first_call_s=float("nan"), error_vs_jax_nn=float("nan"),
                           vs_jax_nn_cudnn=(time_s * 1e3 / peers["jax.nn cudnn"]
                                            if "jax.nn cudnn" in peers else float("nan")),
                           vs_flash_attn3=(time_s * 1e3 / peers["flash-attn3-jax"]
                                           if "flash-attn3-jax" in peers else None)))
    return result


def parse_config(text: str) -> Config:
    """'name:B,S,Nq,Nkv,H,dtype,causal|full', e.g. 'mine:2,2048,16,4,128,bf16,causal'."""
    name, _, spec = text.partition(":")
    b, s, n, k, h, dtype, mask = spec.split(",")
    dtypes = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
    return Config(name, int(b), int(s), int(n), int(k), int(h), dtypes[dtype], mask == "causal",
                  run_xla=int(b) * int(n) * int(s) ** 2 <= 2 * 16 * 4096 ** 2)
