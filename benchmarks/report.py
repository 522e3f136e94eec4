"""What the benchmark writes: the markdown table, and a PNG chart of every implementation's
time relative to jax.nn's cuDNN path (below 1: faster), one panel per mode."""

from __future__ import annotations

import argparse
import os
import time


def machine_line() -> str:
    """'2026-11-30, NVIDIA H200, JAX 0.11.2, cuDNN 91900': what every table is measured on."""
    import jax  # noqa: PLC0415 - the CPU tests import this module's tables without a device

    import jax_sdpa  # noqa: PLC0415

    return (f"{time.strftime('%Y-%m-%d')}, {jax.devices()[0].device_kind}, JAX "
            f"{jax.__version__}, cuDNN {jax_sdpa.cudnn_version()}")


def cell(value, fmt: str) -> str:
    """A table cell: the value formatted, or '–' where there is none (a peer that did not
    run)."""
    return "–" if value is None else format(value, fmt)


def benchmark_parser(description: str, rounds: int = 10) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark takes: --only NAME (repeatable), --rounds,
    --out DIR (default $OUT, the device machine's output folder)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", type=output_directory, default=os.environ.get("OUT", "."))
    return parser


def output_directory(path):
    """--out's directory, made if it is not there yet."""
    os.makedirs(path, exist_ok=True)
    return path


def markdown(rows):
    lines = ["| config | impl | mode | ms | TFLOP/s | × jax.nn cudnn | × flash-attn3 "
             "| first call s | rel. error vs jax.nn |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fa3 = f"{r['vs_flash_attn3']:.3f}" if r["vs_flash_attn3"] is not None else "–"
        lines.append(f"| {r['config']} | {r['impl']} | {r['mode']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.0f} | {r['vs_jax_nn_cudnn']:.3f} | {fa3} | "
                     f"{r['first_call_s']:.2f} | {r.get('error_vs_jax_nn', float('nan')):.1e} |")
    return "\n".join(lines)


def memory_markdown(memory_rows):
    lines = ["| config | impl | fwd+bwd temporary memory (GiB, XLA's compiled estimate) |",
             "|---|---|---|"]
    for r in memory_rows:
        lines.append(f"| {r['config']} | {r['impl']} | {r['temp_gib']:.3f} |")
    return "\n".join(lines)


def chart(rows, header, path):
    """Grouped bars: x = config, one bar per implementation, y = ms / jax.nn cudnn's ms."""
    import matplotlib  # noqa: PLC0415 - optional, only for the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    modes = ["fwd", "fwd+bwd"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    figure, axes = plt.subplots(1, 2, figsize=(15, 5), sharey=True)
    width = 0.8 / len(impls)
    for axis, mode in zip(axes, modes):
        for i, impl in enumerate(impls):
            ratios = []
            for config in configs:
                match = [r for r in rows if (r["config"], r["impl"], r["mode"]) ==
                         (config, impl, mode)]
                ratios.append(match[0]["vs_jax_nn_cudnn"] if match else float("nan"))
            positions = [c + (i - (len(impls) - 1) / 2) * width for c in range(len(configs))]
            axis.bar(positions, ratios, width, label=impl)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(range(len(configs)), configs, rotation=30, ha="right")
        axis.set_title(f"{mode}: time / jax.nn cudnn (lower is faster)")
        axis.set_ylim(0, 2.0)
    axes[0].set_ylabel("time / jax.nn cudnn time")
    axes[1].legend(loc="upper right")
    figure.suptitle(header)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_markdown(directory, filename, header, table):
    """Writes header and table to directory/filename and prints them (a device call's output
    keeps only its end: the table comes last)."""
    import os  # noqa: PLC0415

    with open(os.path.join(directory, filename), "w") as f:
        f.write(header + "\n\n" + table + "\n")
    print(header)
    print(table)
