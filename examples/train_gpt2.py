"""Train a GPT-2-style byte-level model on the Python standard library's source, with its
attention through jax_sdpa (or jax.nn's paths, to compare).

    python examples/train_gpt2.py                      # small model on CPU, GPT-2 small on a GPU
    python examples/train_gpt2.py --attention xla --steps 200
    python examples/train_gpt2.py --pack               # rows packed with whole source files
    python examples/train_gpt2.py --rows padded        # one file per row, padded: to compare
    python examples/train_gpt2.py --logits-soft-cap 30 --sinks   # Gemma 2 / gpt-oss attention
    python examples/train_gpt2.py --fp8-attention --n-head 6     # FP8 attention, head_dim 128
    python examples/train_gpt2.py --alibi                        # ALiBi, no learned positions
    python examples/train_gpt2.py --mask global:16,window:256    # a jax_sdpa.masks description
    python examples/train_gpt2.py --mask prefix:256              # a prefix LM

Rows: "windows" (default) are random windows of the concatenated files; "packed" rows are
windows too, but each file is a document of its own (segment ids: tokens attend within their
file, positions restart at its first token, no loss across a file boundary), at most
--documents-per-row files per row, which the model states to jax_sdpa (the fast way to run packed
rows: docs/packed.md); "padded" rows hold one file each from its start, padded. tokens/s counts
the tokens that carry a loss, over the time between consecutive losses (each read after the
next step is dispatched, so that the host stays ahead of the GPU).

Writes <out-dir>/log.json (config, losses, tokens/s), <out-dir>/loss.png and
<out-dir>/params.npz (the trained parameters: examples/generate.py samples from them).
"""

import argparse
import gc
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_model import ATTENTION, GPT, GPTConfig, attention_mask, save_parameters  # noqa: E402
from stdlib_text import (DocumentStream, load_stdlib_bytes, load_stdlib_documents,  # noqa: E402
                         random_batch, train_validation_split)

# Presets: "cpu" finishes in a few minutes on 2 cores; "gpt2" is GPT-2 small (124M parameters).
PRESETS = {
    "cpu": dict(n_layer=4, n_head=4, d_model=128, seq_len=256, batch=8, steps=500, lr=2e-3,
                dtype="float32", eval_every=100, data_mb=4),
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, batch=16, steps=300, lr=6e-4,
                 dtype="bfloat16", eval_every=100, data_mb=32),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="default: gpt2 on a GPU, cpu elsewhere")
    parser.add_argument("--attention", choices=sorted(ATTENTION), default="jax_sdpa")
    for name in ("steps", "batch", "seq_len", "n_layer", "n_head", "d_model", "eval_every",
                 "data_mb"):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", choices=["windows", "packed", "padded"], default="windows",
                        help="how rows are cut from the corpus (see the module docstring)")
    parser.add_argument("--pack", dest="rows", action="store_const", const="packed",
                        help="the same as --rows packed")
    parser.add_argument("--documents-per-row", type=int, default=4,
                        help="packed rows hold at most this many documents (a row with more is "
                             "drawn again) and jax_sdpa is told so: one cuDNN plan, no check on "
                             "the device; 0: no bound, the call checks the rows itself")
    parser.add_argument("--logits-soft-cap", type=float, default=None,
                        help="cap the attention scores: cap * tanh(scores / cap) (jax_sdpa)")
    parser.add_argument("--sinks", action="store_true",
                        help="a learned attention-sink logit per head (jax_sdpa)")
    parser.add_argument("--fp8-attention", dest="fp8", action="store_true",
                        help="FP8 attention (jax_sdpa, fp8=True; on Hopper the backward runs on "
                             "cuDNN at head_dim 128, e.g. --n-head 6 at d_model 768)")
    parser.add_argument("--alibi", action="store_true",
                        help="ALiBi (jax_sdpa's alibi_slopes) instead of learned positions")
    parser.add_argument("--mask", default=None,
                        help="a jax_sdpa.masks description: window:W, global:G or "
                             "global:G,window:W (causal besides), or prefix:P (a prefix LM) "
                             "(jax_sdpa)")
    parser.add_argument("--out-dir", default=None, help="default: runs/gpt2-<attention>-<time>")
    args = parser.parse_args(argv)
    if ((args.logits_soft_cap is not None or args.sinks or args.fp8 or args.alibi or
         args.mask) and args.attention != "jax_sdpa"):
        parser.error("--logits-soft-cap, --sinks, --fp8-attention, --alibi and --mask need "
                     "--attention jax_sdpa (jax.nn has none of them)")
    if args.mask:
        try:
            attention_mask(args.mask)
        except ValueError as error:
            parser.error(f"--mask: {error}")
        if args.fp8:
            parser.error("--mask takes no --fp8-attention")
    if args.alibi and (args.fp8 or args.rows != "windows"):
        parser.error("--alibi takes causal windows without --fp8-attention (a score modifier "
                     "on packed rows takes cuDNN's dense path)")
    if args.documents_per_row < 0:
        parser.error("--documents-per-row must be >= 0")
    if args.fp8 and (args.logits_soft_cap is not None or args.sinks or args.rows != "windows"):
        parser.error("--fp8-attention takes causal windows only (no --logits-soft-cap, --sinks "
                     "or packed/padded rows)")
    preset = args.preset or ("gpt2" if jax.default_backend() == "gpu" else "cpu")
    settings = dict(PRESETS[preset], preset=preset)
    # Flags given on the command line override the preset; the others keep the preset's value.
    settings.update({k: v for k, v in vars(args).items()
                     if k != "preset" and (v is not None or k not in settings)})
    return argparse.Namespace(**settings)


def model_config(args):
    """The model the arguments describe, with what the rows promise about their documents."""
    documents_per_row = None
    if args.rows != "windows" and args.documents_per_row:
        # A padded row is its file and its padding.
        documents_per_row = 2 if args.rows == "padded" else args.documents_per_row
    return GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                     d_model=args.d_model, dtype=args.dtype, attention=args.attention,
                     logits_soft_cap=args.logits_soft_cap, sinks=args.sinks, fp8=args.fp8,
                     alibi=args.alibi, mask=args.mask,
                     documents_per_row=documents_per_row)


def make_train_step(graphdef, optimizer, positions=None):
    """(jitted train step, jitted loss); positions: the tokens' positions when the sequence is
    permuted (examples/sharded_training.py's zigzag layout), else 0..T-1. Both take (params,
    [opt_state,] x, y, rows=None); rows: packed or padded rows' weights, segment_ids and
    positions (stdlib_text.DocumentStream)."""
    def loss_fn(params, x, y, rows=None):
        rows = rows or {}
        logits = nnx.merge(graphdef, params)(x, rows.get("positions", positions),
                                             rows.get("segment_ids"))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        if "weights" not in rows:
            return losses.mean()
        return (losses * rows["weights"]).sum() / rows["weights"].sum()

    @jax.jit
    def train_step(params, opt_state, x, y, rows=None):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, rows)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, jax.jit(loss_fn)


def batches(args, rng):
    """(training batch source, validation batches): each batch (x, y, rows or None, tokens
    that carry a loss)."""
    if args.rows == "windows":
        train_data, val_data = train_validation_split(load_stdlib_bytes(args.data_mb * 2**20))
        val_rng = np.random.default_rng(args.seed + 1)
        validation = [(*random_batch(val_data, args.batch, args.seq_len, val_rng), None)
                      for _ in range(4)]

        def train():
            x, y = random_batch(train_data, args.batch, args.seq_len, rng)
            return x, y, None, x.size
        return train, validation, len(train_data)
    documents = load_stdlib_documents(args.data_mb * 2**20)
    cut = int(len(documents) * 0.9)
    train_stream, val_stream = DocumentStream(documents[:cut]), DocumentStream(documents[cut:])
    def cut_rows(stream, batch, seq_len, rng):
        if args.rows == "padded":
            return stream.padded_batch(batch, seq_len, rng)
        return stream.packed_batch(batch, seq_len, rng, args.documents_per_row or None)

    def as_batch(rows):
        x, y = rows.pop("tokens"), rows.pop("targets")
        return x, y, rows, int(rows["weights"].sum())
    val_rng = np.random.default_rng(args.seed + 1)
    validation = [as_batch(cut_rows(val_stream, args.batch, args.seq_len, val_rng))[:3]
                  for _ in range(4)]
    return (lambda: as_batch(cut_rows(train_stream, args.batch, args.seq_len, rng)),
            validation, len(train_stream.tokens))


def on_device(batch):
    """A batch (x, y, rows, tokens) with its arrays copied to the default device (asynchronously:
    the copy overlaps the step that runs meanwhile)."""
    *arrays, tokens = batch
    return (*jax.device_put(arrays), tokens)


class StepLog:
    """Each step's loss and time, read one step late: a step's time is the time between its
    loss and the one before it, which is the step's cost when the host dispatches ahead."""

    def __init__(self):
        self.history, self._timed = [], []  # timed: (seconds, tokens with a loss) per step
        self._pending = None  # the step dispatched last, read once the next one is dispatched
        self.restart_clock()

    def dispatched(self, step, loss, tokens):
        """Called once a step is dispatched: reads the step before it (the GPU already holds
        this one's work, so it never waits between steps) and keeps this one for later."""
        if step == 2:  # compiled: the objects alive now live for the whole run, and the
            gc.freeze()  # collector's full passes over them would stall a step by ~0.1 s
        self.flush()
        self._pending = (step, loss, tokens)

    def flush(self):
        """Reads the step dispatched last, if it is not read yet."""
        if self._pending is not None:
            self.read(*self._pending)
            self._pending = None

    def restart_clock(self):
        self._clock = time.perf_counter()

    def read(self, step, loss, tokens):
        """Waits for the step's loss and records it."""
        loss = float(loss)
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        if step > 2:  # the first steps compile
            self._timed.append((seconds, tokens))
        self.history.append(dict(step=step, loss=loss, seconds=seconds))

    @property
    def tokens_per_s(self):
        if not self._timed:
            return None
        return sum(t for _, t in self._timed) / sum(s for s, _ in self._timed)


def save_plot(path, history, validation, title):
    import matplotlib  # noqa: PLC0415 - only needed at the end
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8, label="train")
    if validation:
        ax.plot([v["step"] for v in validation], [v["loss"] for v in validation], "o-",
                label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    label = args.attention + ("-fp8" if args.fp8 else "")
    out_dir = pathlib.Path(args.out_dir or f"runs/gpt2-{label}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    next_batch, val_batches, train_bytes = batches(args, rng)
    model = GPT(model_config(args), nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10),
                                                  args.steps, args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
    opt_state = optimizer.init(params)
    train_step, eval_loss = make_train_step(graphdef, optimizer)
    device = jax.devices()[0]
    print(f"{args.preset} preset on {device.device_kind}: {n_params / 1e6:.2f}M parameters, "
          f"attention={label}, rows={args.rows}, {train_bytes / 1e6:.1f} MB of "
          "training bytes")

    step_log, validation = StepLog(), []
    bar = tqdm(range(1, args.steps + 1), desc="training", unit="step", dynamic_ncols=True)
    batch = on_device(next_batch())
    for step in bar:
        x, y, rows, tokens = batch
        params, opt_state, loss = train_step(params, opt_state, x, y, rows)
        batch = on_device(next_batch())  # cut and copied while the step runs, as a loader would
        step_log.dispatched(step, loss, tokens)
        if step % args.eval_every == 0 or step == args.steps:
            step_log.flush()
            val_loss = float(np.mean([eval_loss(params, vx, vy, vrows)
                                      for vx, vy, vrows in val_batches]))
            validation.append(dict(step=step, loss=val_loss))
            bar.write(f"step {step}: train {step_log.history[-1]['loss']:.3f}, "
                      f"validation {val_loss:.3f}")
            step_log.restart_clock()  # the evaluation's time is no step's
        if step_log.history:
            bar.set_postfix(loss=f"{step_log.history[-1]['loss']:.3f}",
                            tok_s=f"{step_log.tokens_per_s or float('nan'):,.0f}")
    tokens_per_s = step_log.tokens_per_s
    history = step_log.history
    log = dict(args=vars(args), parameters=int(n_params), device=device.device_kind,
               jax=jax.__version__, tokens_per_s=tokens_per_s, train=history,
               validation=validation)
    if args.sinks:  # how far the learned sinks moved from their start at 0
        sinks = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                 if "sinks" in jax.tree_util.keystr(path)]
        log["sinks_moved"] = float(max(np.max(np.abs(np.asarray(x))) for x in sinks))
    (out_dir / "log.json").write_text(json.dumps(log, indent=1))
    save_parameters(out_dir / "params.npz", params)  # examples/generate.py reads them
    save_plot(out_dir / "loss.png", history, validation,
              f"GPT ({n_params / 1e6:.1f}M), attention={label}, {device.device_kind}")
    rate = f"{tokens_per_s:,.0f}" if tokens_per_s else "n/a"
    print(f"done: validation loss {validation[-1]['loss']:.3f}, {rate} tokens/s; wrote "
          f"{out_dir / 'log.json'}, {out_dir / 'loss.png'} and {out_dir / 'params.npz'} "
          f"(python examples/generate.py {out_dir} samples from it)")


if __name__ == "__main__":
    main()
