"""Before/after speed from two runs of the same benchmark in one device call: for each row
(config, implementation, mode) of `bench.json` / `packed.json` under BEFORE and AFTER, the
milliseconds and their ratio, both raw and normalized by the reference column each run timed
in the same process (jax.nn's cuDNN path, or the packed table's per-document bound), which
cancels the machine's drift between the two processes.

    python scripts/compare_speed.py BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import json
import os
import statistics
import sys

# The column each table's rows are measured against, in the same process.
REFERENCE = {"bench.json": "jax.nn cudnn", "packed.json": "per-document bound"}


def load(path):
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {(r["config"], r["impl"], r["mode"]): r["ms"] for r in rows}


def compare(name, before, after):
    reference = REFERENCE[name]
    print(f"\n{name}: after / before (normalized: each run's ms / its own '{reference}' ms)")
    print(f"{'config':<20} {'implementation':<26} {'mode':<8} {'before':>8} {'after':>8} "
          f"{'ratio':>6} {'normalized':>10}")
    normalized_ratios = []
    for key in sorted(before.keys() & after.keys()):
        config, impl, mode = key
        ref_key = (config, reference, mode)
        ratio = after[key] / before[key]
        normalized = None
        if ref_key in before and ref_key in after and impl != reference:
            normalized = (after[key] / after[ref_key]) / (before[key] / before[ref_key])
            if impl.startswith("jax_sdpa") or impl.startswith("ragged") or "varlen_attention" in impl:
                normalized_ratios.append(normalized)
        shown = "" if normalized is None else f"{normalized:.3f}"
        print(f"{config:<20} {impl:<26} {mode:<8} {before[key]:8.3f} {after[key]:8.3f} "
              f"{ratio:6.3f} {shown:>10}")
    if normalized_ratios:
        print(f"our rows, normalized after/before: median {statistics.median(normalized_ratios):.3f}, "
              f"min {min(normalized_ratios):.3f}, max {max(normalized_ratios):.3f} "
              f"({len(normalized_ratios)} rows)")


def main(before_dir, after_dir):
    for name in REFERENCE:
        paths = [os.path.join(d, name) for d in (before_dir, after_dir)]
        if all(os.path.exists(p) for p in paths):
            compare(name, *map(load, paths))


if __name__ == "__main__":
    main(*sys.argv[1:3])
