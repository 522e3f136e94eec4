"""Generate text with what examples/train_gpt2.py trained, through a paged KV cache.

    python examples/train_gpt2.py --out-dir runs/small     # trains, writes params.npz
    python examples/generate.py runs/small                  # default: the newest run in runs/

A batch of prompts of different lengths (lines of the standard library's source) is prefilled
in one chunked call (left-padded; the padding is never written to the cache), then decoded one
token per step: every layer writes its new keys and values into pages of a shared pool
(jax_sdpa.paged_kv_update) and attends over them (jax_sdpa.paged_attention). Prints the
continuations and the decode rate in tokens/s.
"""

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_model import GPT, GPTConfig, load_parameters  # noqa: E402
from stdlib_text import load_stdlib_documents  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default=None,
                        help="a train_gpt2.py output directory (default: the newest runs/*)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def newest_run():
    runs = sorted(pathlib.Path("runs").glob("*/params.npz"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit("no runs/*/params.npz: train first (python examples/train_gpt2.py)")
    return runs[-1].parent


def load_model(run_dir):
    args = json.loads((run_dir / "log.json").read_text())["args"]
    config = GPTConfig(seq_len=args["seq_len"], n_layer=args["n_layer"], n_head=args["n_head"],
                       d_model=args["d_model"], dtype=args["dtype"],
                       logits_soft_cap=args.get("logits_soft_cap"),
                       sinks=bool(args.get("sinks")))
    return load_parameters(run_dir / "params.npz", GPT(config, nnx.Rngs(0))), config


def prompts(count, rng, longest):
    """Lines of source of different lengths (bytes)."""
    lines = [line for doc in load_stdlib_documents(2**20)
             for line in bytes(doc).split(b"\n") if 12 <= len(line.strip()) <= longest]
    return [lines[i] + b"\n" for i in rng.choice(len(lines), size=count, replace=False)]


def page_table(batch, max_len, page_size, pool_pages, rng):
    """Each sequence's pages, taken from a shuffled pool (pages need not be contiguous)."""
    per_sequence = -(-max_len // page_size)
    pages = rng.permutation(pool_pages)[:batch * per_sequence]
    return jnp.asarray(pages.reshape(batch, per_sequence), jnp.int32)


def generate(model, config, texts, new_tokens, page_size, temperature, seed):
    """(continuations: list of bytes, decode tokens/s)."""
    batch = len(texts)
    lengths = np.array([len(t) for t in texts], np.int32)
    width = int(lengths.max())
    max_len = width + new_tokens
    if max_len > config.seq_len:
        raise SystemExit(f"prompts + new tokens ({max_len}) exceed the model's {config.seq_len}")
    rng = np.random.default_rng(seed)
    pool_pages = 2 * batch * (-(-max_len // page_size))
    table = page_table(batch, max_len, page_size, pool_pages, rng)
    head_dim = config.d_model // config.n_head
    dtype = jnp.dtype(config.dtype)
    caches = [tuple(jnp.zeros((pool_pages, page_size, config.n_head, head_dim), dtype)
                    for _ in range(2)) for _ in range(config.n_layer)]
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, caches, start, key):
        logits, caches = nnx.merge(graphdef, state).decode(tokens, caches, table, start)
        last = logits[:, -1] / temperature
        return jax.random.categorical(key, last).astype(jnp.int32), caches

    # Prefill: left-padded prompts in one call; token t of row b sits at lengths[b] - width + t.
    padded = np.zeros((batch, width), np.int32)
    for row, text in enumerate(texts):
        padded[row, width - len(text):] = np.frombuffer(text, np.uint8)
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    start = jnp.asarray(lengths - width)
    token, caches = step(state, jnp.asarray(padded), caches, start, sub)
    kv_lengths = jnp.asarray(lengths)
    out = [token]
    timed_tokens, timed_seconds = 0, 0.0
    for i in range(new_tokens - 1):
        key, sub = jax.random.split(key)
        begin = time.perf_counter()
        token, caches = step(state, token[:, None], caches, kv_lengths, sub)
        token.block_until_ready()
        if i > 0:  # the first decode step compiles
            timed_seconds += time.perf_counter() - begin
            timed_tokens += batch
        kv_lengths = kv_lengths + 1
        out.append(token)
    generated = np.stack([np.asarray(t) for t in out], axis=1)
    rate = timed_tokens / timed_seconds if timed_seconds else float("nan")
    return [bytes(row.astype(np.uint8)) for row in generated], rate


def main(argv=None):
    args = parse_args(argv)
    run_dir = pathlib.Path(args.run_dir) if args.run_dir else newest_run()
    model, config = load_model(run_dir)
    rng = np.random.default_rng(args.seed)
    longest = max(12, config.seq_len - args.new_tokens - 1)
    texts = prompts(args.prompts, rng, min(longest, 60))
    continuations, rate = generate(model, config, texts, args.new_tokens, args.page_size,
                                   args.temperature, args.seed)
    for text, continuation in zip(texts, continuations):
        print(repr(text.decode("utf-8", "replace")), "->",
              repr(continuation.decode("utf-8", "replace")))
    print(f"{len(texts)} prompts of {min(len(t) for t in texts)}-{max(len(t) for t in texts)} "
          f"bytes, {args.new_tokens} new tokens each, page size {args.page_size}: {rate:,.0f} "
          f"tokens/s decoding on {jax.devices()[0].device_kind} ({run_dir})")
    print(quality_note(run_dir))


def quality_note(run_dir):
    """What to expect of the text, from the size and the validation loss the run reached."""
    log = json.loads((run_dir / "log.json").read_text())
    loss = (log.get("validation") or [{}])[-1].get("loss")
    size = f"a {log['parameters'] / 1e6:.1f}M-parameter byte-level model"
    if loss is None:
        return f"({size} with no validation loss recorded)"
    expect = ("Python-shaped text: indentation, keywords, common names, rarely code that runs"
              if loss > 1.0 else "plausible lines of Python")
    return f"({size} at {loss:.2f} nats/byte of validation loss: expect {expect})"

if __name__ == "__main__":
    main()
