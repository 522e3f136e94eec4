"""The same call after the GPU has idled and after it has run for a while, with its SM clock.

    python -m benchmarks.clocks [--only llama3.1-s16k] [--idle 2] [--calls 7] [--warm 5]

NVIDIA's published SDPA figures come from short runs (a few iterations per process, an L2 flush
between them); our side-by-side benchmarks run long back-to-back chains. An H200 at its 700 W
power limit lowers its SM clock under a long attention load, so the two methods can differ by
the clock alone. This runs one jitted call of each mode (jax_sdpa, cuDNN) both ways:
"burst" — each call alone after `--idle` seconds of idle GPU; "sustained" — the calls timed
after `--warm` seconds of back-to-back calls. Printed per row: ms (median), TFLOP/s, and the SM
clock and power nvidia-smi sampled during the timed calls (burst calls are shorter than the
sampling period: their clock is the one sampled just before and during them).
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time

import jax

from benchmarks.attention import make_inputs
from benchmarks.configs import ANCHOR_CONFIGS
from benchmarks.implementations import available
from benchmarks.report import benchmark_parser, machine_line

SAMPLE_MS = 20


class ClockSampler:
    """nvidia-smi's SM clock (MHz) and power draw (W) every SAMPLE_MS, with host timestamps.
    Without nvidia-smi (a CPU machine) it records nothing."""

    def __init__(self):
        self.samples = []  # (perf_counter seconds, MHz, W)
        try:
            self._process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 f"-lms={SAMPLE_MS}", "--id=0"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self._process = None
            return
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self._process.stdout:
            fields = [f.strip() for f in line.split(",")]
            try:
                self.samples.append((time.perf_counter(), float(fields[0]), float(fields[1])))
            except (ValueError, IndexError):
                continue

    def between(self, start, end):
        return window(self.samples, start, end)

    def stop(self):
        if self._process is not None:
            self._process.terminate()
            self._process.wait()


def window(samples, start, end, margin=SAMPLE_MS / 1e3):
    """(median MHz, median W) of the samples taken from `margin` before `start` to `end`;
    (nan, nan) when there are none."""
    inside = [(mhz, watts) for t, mhz, watts in samples if start - margin <= t <= end]
    if not inside:
        return float("nan"), float("nan")
    return (statistics.median(m for m, _ in inside), statistics.median(w for _, w in inside))


def single_call(attention, causal, mode):
    """One call (mode "fwd" or "fwd+bwd") jitted on its own."""
    def forward(q, k, v, d_out):
        return attention(q, k, v, causal)

    def forward_backward(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal), q, k, v)
        return out, *vjp(d_out)
    return jax.jit(forward if mode == "fwd" else forward_backward)


def timed(fn, inputs):
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    return start, time.perf_counter()


def burst(fn, inputs, calls, idle, sampler):
    """Each call alone after `idle` seconds of idle GPU: [(seconds, MHz, W)]."""
    rows = []
    for _ in range(calls):
        time.sleep(idle)
        start, end = timed(fn, inputs)
        rows.append((end - start, *sampler.between(start, end)))
    return rows


def sustained(fn, inputs, calls, warm, sampler):
    """Calls timed one by one after `warm` seconds of back-to-back calls: [(seconds, MHz, W)]."""
    until = time.perf_counter() + warm
    while time.perf_counter() < until:
        jax.block_until_ready([fn(*inputs) for _ in range(4)])
    rows = []
    for _ in range(calls):
        start, end = timed(fn, inputs)
        rows.append((end - start, *sampler.between(start, end)))
    return rows


def summary(rows):
    """(median seconds, median MHz, median W) over the rows that have clock samples."""
    clocks = [(mhz, watts) for _, mhz, watts in rows if mhz == mhz]
    return (statistics.median(s for s, _, _ in rows),
            statistics.median(m for m, _ in clocks) if clocks else float("nan"),
            statistics.median(w for _, w in clocks) if clocks else float("nan"))


def main(argv=None):
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=2.0)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--warm", type=float, default=5.0)
    parser.add_argument("--impl", action="append", default=[])
    args = parser.parse_args(argv)
    configs = [c for c in ANCHOR_CONFIGS if c.name in (args.only or ["llama3.1-s16k"])]
    print(machine_line())
    print("| config | impl | mode | method | ms | TFLOP/s | SM MHz | W |\n|---|---|---|---|---|---|---|---|")
    sampler = ClockSampler()
    try:
        for config in configs:
            q, k, v, d_out = make_inputs(config, seed=0)[0]
            impls = {n: f for n, f in available(config).items()
                     if n in (args.impl or ["jax_sdpa", "jax.nn cudnn"])}
            for name, attention in impls.items():
                for mode in ("fwd", "fwd+bwd"):
                    fn = single_call(attention, config.causal, mode)
                    jax.block_until_ready(fn(q, k, v, d_out))  # compile, build
                    flops = config.forward_flops() * (1 if mode == "fwd" else 3.5)
                    for method, rows in (
                            ("burst", burst(fn, (q, k, v, d_out), args.calls, args.idle, sampler)),
                            ("sustained", sustained(fn, (q, k, v, d_out), args.calls, args.warm,
                                                    sampler))):
                        seconds, mhz, watts = summary(rows)
                        print(f"| {config.name} | {name} | {mode} | {method} | {seconds * 1e3:.3f} "
                              f"| {flops / seconds / 1e12:.0f} | {mhz:.0f} | {watts:.0f} |",
                              flush=True)
    finally:
        sampler.stop()


if __name__ == "__main__":
    main()
