"""The first call of a jitted packed fwd+bwd step, each in a fresh process: trace + lower (cuDNN
graphs are built there), XLA compile, first and second run.

    python -m benchmarks.packed_first_call [--only 8x1024 ...] [--impl NAME ...] [--calls 1]
                                           [--ids argument|constant]
                                           [--graph-cache [--xla-cache]] [--out DIR]

benchmarks/packed.py reports the compile of its 8-call chains inside one process, where the
first implementation warms cuDNN for the others; here each (config, implementation) starts a
new process. --ids: the segment ids (or cu_seqlens) are an argument of the jitted step, as in
a training loop, or a constant it closes over (XLA may then evaluate what depends on them
while it compiles). --graph-cache: each row twice, filling a new JAX_SDPA_GRAPH_CACHE_DIR,
then reading it (benchmarks/first_call.py). Writes packed_first_call.md and
packed_first_call.json.
"""

from __future__ import annotations

import itertools
import json
import time

IMPLEMENTATIONS = ("stated bound", "checked", "varlen_attention stated", "per-document bound",
                   "flash-attn3-jax varlen")


def _attention(name, config):
    """f(q, k, v, aux) -> output [B, T, N, H], and aux (segment ids or cu_seqlens)."""
    import jax.numpy as jnp  # noqa: PLC0415 - the child process times its imports apart
    import numpy as np  # noqa: PLC0415

    import jax_sdpa  # noqa: PLC0415
    from benchmarks.packed import HEAD_DIM, N_HEADS, _per_document  # noqa: PLC0415

    ids = jnp.asarray(config.segment_ids())
    cu = jnp.asarray(np.concatenate([[0], np.cumsum([n for row in config.lengths
                                                      for n in row])]), jnp.int32)
    longest = config.longest()

    def flat(x):
        return x.reshape(-1, N_HEADS, HEAD_DIM)
    if name == "stated bound":
        return (lambda q, k, v, a: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=a, max_segments=config.documents(),
            max_document_length=longest, implementation="cudnn")), ids
    if name == "checked":
        return (lambda q, k, v, a: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, query_segment_ids=a, implementation="cudnn")), ids
    if name == "varlen_attention stated":
        return (lambda q, k, v, a: jax_sdpa.varlen_attention(
            flat(q), flat(k), flat(v), a, is_causal=True, max_seqlen_q=longest,
            implementation="cudnn").reshape(q.shape)), cu
    if name == "per-document bound":
        per_document = _per_document(config)
        return (lambda q, k, v, a: per_document(q, k, v)), cu
    from flash_attn3_jax import flash_mha_varlen  # noqa: PLC0415 - optional peer
    return (lambda q, k, v, a: flash_mha_varlen(
        flat(q), flat(k), flat(v), a, a, max_seqlen_q=longest, max_seqlen_k=longest,
        is_causal=True).reshape(q.shape)), cu


def child(config_name, name, calls, ids_mode):
    """Runs in the fresh process: prints one JSON line of seconds."""
    started = time.perf_counter()
    import jax  # noqa: PLC0415 - timed

    import jax_sdpa  # noqa: F401, PLC0415 - timed
    from benchmarks.packed import configs, make_inputs  # noqa: PLC0415
    jax.devices()
    imported = time.perf_counter()
    config = next(c for c in configs() if c.name == config_name)
    attention, aux = _attention(name, config)
    q, k, v, d_out = make_inputs(config, seed=0)[0]

    def step(q, k, v, d_out, given):
        a = given if ids_mode == "argument" else aux
        results = []
        for _ in range(calls):
            out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, a), q, k, v)
            results.append((out, *vjp(d_out)))
        return results
    args = (q, k, v, d_out, aux)
    jax.block_until_ready(args)
    start = time.perf_counter()
    lowered = jax.jit(step).trace(*args).lower()
    traced = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    first = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    second = time.perf_counter()
    print(json.dumps(dict(imports_s=imported - started, trace_lower_s=traced - start,
                          compile_s=compiled_at - traced, first_run_s=first - compiled_at,
                          second_run_s=second - first, first_call_s=first - start)),
          flush=True)


def main(argv=None):
    from benchmarks.first_call import (fresh_process_parser, markdown, record,  # noqa: PLC0415
                                       runs, stage_name)
    parser = fresh_process_parser(__doc__.splitlines()[0], 4, IMPLEMENTATIONS)
    parser.add_argument("--calls", type=int, default=1, help="fwd+bwd calls in the step")
    parser.add_argument("--ids", choices=("argument", "constant"), default="argument")
    args = parser.parse_args(argv)
    if args.child:
        config_name, name, calls, ids_mode = args.child
        child(config_name, name, int(calls), ids_mode)
        return
    from benchmarks.packed import configs  # noqa: PLC0415
    from benchmarks.report import machine_line, write_markdown  # noqa: PLC0415
    header = (f"{machine_line()}; one fresh process per row, ids "
              f"{'an argument of' if args.ids == 'argument' else 'a constant in'} the step")
    chosen = [c.name for c in configs() if not args.only or c.name in args.only]
    rows = []
    for config, name in itertools.product(chosen, args.impl or IMPLEMENTATIONS):
        for stage, measured in runs("benchmarks.packed_first_call",
                                    (config, name, str(args.calls), args.ids), args.timeout,
                                    args.graph_cache, args.xla_cache):
            record(args.out, "packed_first_call", header, rows,
                   dict(config=config, impl=stage_name(name, stage),
                        mode=f"fwd+bwd x {args.calls}", **measured))
    write_markdown(args.out, "packed_first_call.md", header, markdown(rows))


if __name__ == "__main__":
    main()
