"""Compare training runs of examples/train_gpt2.py that differ only in --attention.

    python examples/compare_runs.py runs/a runs/b ... [--out comparison.png]

Prints tokens/s per run and the largest gap between each run's loss curve and the first's
(smoothed over 20 steps, so that bf16 noise in single steps does not dominate), and plots the
curves together.
"""

import argparse
import json
import pathlib

import numpy as np


def smoothed(values, window=20):
    values = np.asarray(values, np.float64)
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid") if len(values) >= window else values


def label(log):
    """The run's attention path: --attention, with the options that change its arithmetic."""
    args = log["args"]
    extras = [name for name, on in (("fp8", args.get("fp8")), ("sinks", args.get("sinks")),
                                     ("soft-cap", args.get("logits_soft_cap"))) if on]
    return " + ".join([args["attention"], *extras])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("comparison.png"))
    args = parser.parse_args()
    logs = [json.loads((run / "log.json").read_text()) for run in args.runs]
    base = smoothed([h["loss"] for h in logs[0]["train"]])
    print("| attention | tokens/s | final validation loss | max gap to first (smoothed) |")
    print("|---|---|---|---|")
    for log in logs:
        curve = smoothed([h["loss"] for h in log["train"]])
        n = min(len(curve), len(base))
        gap = float(np.max(np.abs(curve[:n] - base[:n])))
        print(f"| {label(log)} | {log['tokens_per_s']:,.0f} | "
              f"{log['validation'][-1]['loss']:.3f} | {gap:.3f} |")
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4))
    for log in logs:
        steps = [h["step"] for h in log["train"]]
        ax.plot(steps, [h["loss"] for h in log["train"]], lw=0.7,
                label=f"{label(log)} ({log['tokens_per_s']:,.0f} tok/s)")
    ax.set_xlabel("step")
    ax.set_ylabel("train cross-entropy (nats/byte)")
    ax.set_title(f"{logs[0]['device']}: same seed, attention paths compared")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
