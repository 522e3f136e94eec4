"""Reading jax.profiler traces: GPU time per kernel name, and the table the benchmarks print."""

from __future__ import annotations

import collections
import glob
import gzip
import json


def _gpu_events(trace_dir):
    """Every complete event on a GPU timeline of the Perfetto JSON traces under trace_dir."""
    for path in glob.glob(f"{trace_dir}/**/*trace.json.gz", recursive=True):
        with gzip.open(path) as f:
            events = json.load(f).get("traceEvents", [])
        pids = {e["pid"]: e["args"].get("name", "") for e in events
                if e.get("ph") == "M" and e.get("name") == "process_name"}
        yield from (e for e in events
                    if e.get("ph") == "X" and "GPU" in pids.get(e.get("pid"), ""))


def kernel_times(trace_dir):
    """({kernel name: total µs}, {kernel name: events}) from the Perfetto JSON of a
    jax.profiler trace (GPU timelines only)."""
    totals, counts = collections.Counter(), collections.Counter()
    for e in _gpu_events(trace_dir):
        totals[e["name"]] += e.get("dur", 0)
        counts[e["name"]] += 1
    return totals, counts


def gpu_span(trace_dir):
    """(span, busy, gaps) in µs over every GPU event of the traces: span from the first event's
    start to the last one's end, busy the union of the events (an event seen on two timelines
    counts once), gaps the idle stretches inside the span, longest first. span - busy is time
    the GPU waited for the host inside a chain of calls."""
    intervals = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in _gpu_events(trace_dir))
    if not intervals:
        return 0.0, 0.0, []
    busy, gaps = 0.0, []
    start, end = intervals[0]
    for s, e in intervals[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start  # end is now the last event's end: the starts are sorted
    return end - intervals[0][0], busy, sorted(gaps, reverse=True)


def span_line(trace_dir, per=1, what="per call", gaps_shown=8):
    """gpu_span as one line: span and busy in ms divided by `per` (calls, steps), then the
    longest idle gaps in µs."""
    span, busy, gaps = gpu_span(trace_dir)
    return (f"GPU span {span / per / 1e3:.3f} ms {what}, busy {busy / per / 1e3:.3f}; "
            f"{len(gaps)} gaps, longest (µs): {' '.join(f'{g:.0f}' for g in gaps[:gaps_shown])}")


def kernel_launches(trace_dir):
    """{kernel name: sorted launch shapes} ("grid:x,y,z block:x,y,z" from XProf's
    kernel_details) from the same traces: where one kernel's time changes, its grid says why."""
    launches = collections.defaultdict(set)
    for e in _gpu_events(trace_dir):
        details = e.get("args", {}).get("kernel_details", "")
        shape = " ".join(part for part in details.split() if part.startswith(("grid:", "block:")))
        if shape:
            launches[e["name"]].add(shape)
    return {name: sorted(shapes) for name, shapes in launches.items()}


def kernel_events(trace_dir, contains):
    """[(start µs, duration µs)] of the GPU events whose kernel name contains `contains`, in
    time order (every GPU timeline of the traces)."""
    return sorted((e["ts"], e.get("dur", 0)) for e in _gpu_events(trace_dir)
                  if contains in e["name"])


def kernel_table(totals, counts, per=1, limit=None, unit="µs"):
    """One line per kernel name, the most time first: time and events, both divided by `per`
    (calls, GPUs, or the duplicate GPU timelines an H200 trace shows), time in `unit` (µs, ms)."""
    scale = {"µs": 1.0, "ms": 1e-3}[unit]
    return [f"    {micros * scale / per:10.2f} {unit}  x{counts[name] / per:<7.4g} {name[:110]}"
            for name, micros in totals.most_common(limit)]


def launch_table(trace_dir, per=1, limit=None):
    """kernel_table's lines, each followed by that kernel's launch shapes."""
    totals, counts = kernel_times(trace_dir)
    launches = kernel_launches(trace_dir)
    lines = []
    for line, (name, _) in zip(kernel_table(totals, counts, per=per, limit=limit),
                               totals.most_common(limit)):
        lines += [line, f"        {'; '.join(launches.get(name, []))[:200]}"]
    return lines


def events_line(trace_dir, contains, width=400):
    """One line: the durations of the kernels named like `contains`, in time order."""
    durations = " ".join(f"{d:.0f}" for _, d in kernel_events(trace_dir, contains))
    return f"    {contains} events in time order, µs: {durations[:width]}"
