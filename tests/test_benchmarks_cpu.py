"""The benchmarks' bookkeeping, without a GPU: which plan calls run, and the ratios the plan
table reports (benchmarks/plans.py), config parsing and NVIDIA's reference row
(benchmarks/configs.py)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import plans
from benchmarks.configs import ANCHOR_CONFIGS, PUBLISHED, parse_config, published_rows


IMPLS = ("jax_sdpa", "jax_sdpa plain", "jax_sdpa cmdbuf", "jax.nn cudnn")


def plan(index, ms, error=""):
    return dict(plan=index, name=f"eng{index}", workspace_bytes=2**20, ms=ms, host_us=9.0,
                error=error)


def test_the_preferred_plan_is_the_first_that_built():
    timings = [plan(0, -1, "not supported"), plan(1, 0.5), plan(2, 0.25)]
    assert plans.preferred(timings)["plan"] == 1


def test_plan_table_ratios():
    result = dict(
        config="c", plans={"forward": [plan(0, 0.2), plan(1, 0.4)],
                           "backward": [plan(0, -1, "failed"), plan(1, 0.6)]},
        alone_ms={"fwd": 0.2, "fwd+bwd": 0.8}, best_ms={"fwd": 0.2, "fwd+bwd": 0.8},
        calls_ms={f"{impl}|{mode}": ms for impl in IMPLS
                  for mode, ms in (("fwd", 0.21), ("fwd+bwd", 1.0))})
    table = plans.markdown([result])
    assert "| c | fwd | 0.200 | 0.210 (1.050) |" in table
    assert "| c | fwd+bwd | 0.800 | 1.000 (1.250) |" in table
    assert "| c | forward | 1 | eng1 | 0.400 | 2.000 | 1.0 | 9.0 |  |" in table
    assert "| c | backward | 0 | eng0 | – | – | 1.0 | 9.0 | failed |" in table
    assert "| c | backward | 1 | eng1 | 0.600 | 1.000 |" in table


def test_other_forward_implementations_compare_with_the_frontends_choice():
    result = dict(
        config="c", plans={"forward": [plan(0, 0.2)], "backward": [plan(0, 0.6)],
                           "forward unified": [plan(0, 0.18)],
                           "forward composite": [plan(0, 0.0, "unified refuses masks")]},
        alone_ms={"fwd": 0.2, "fwd+bwd": 0.8}, best_ms={"fwd": 0.2, "fwd+bwd": 0.8},
        calls_ms={f"{impl}|{mode}": 1.0 for impl in IMPLS for mode in ("fwd", "fwd+bwd")})
    table = plans.markdown([result])
    assert "| c | forward unified | 0 | eng0 | 0.180 | 0.900 |" in table
    assert ("| c | forward composite | 0 | eng0 | – | – | 1.0 | 9.0 | unified refuses masks |"
            in table)


def test_a_refused_implementation_is_a_row_with_cudnns_message(monkeypatch):
    def refuse(config, direction, rounds, inputs, implementation="auto"):
        assert direction == "forward"
        raise RuntimeError(f"cuDNN frontend build failed: {implementation} not supported")
    monkeypatch.setattr(plans, "time_plans", refuse)
    found = plans.time_other_implementations(None, 1, [], ["unified"])
    assert list(found) == ["forward unified"]
    (row,) = found["forward unified"]
    assert row["ms"] == 0 and "unified not supported" in row["error"]


def test_parse_config():
    config = parse_config("mine:2,2048,16,4,128,bf16,causal")
    assert (config.name, config.batch, config.seq, config.q_heads, config.kv_heads,
            config.head_dim, config.causal) == ("mine", 2, 2048, 16, 4, 128, True)
    assert config.dtype == jnp.bfloat16
    assert config.forward_flops() == 4.0 * 2 * 16 * 2048 ** 2 * 128 / 2


def test_the_llama_shape_carries_nvidias_published_figures_as_a_reference_row():
    llama = next(c for c in ANCHOR_CONFIGS if c.name == "llama3.1-s16k")
    measured = [dict(impl="jax.nn cudnn", mode=mode, ms=ms) for mode, ms in
                (("fwd", 10.0), ("fwd+bwd", 40.0))]
    fwd, fwd_bwd = published_rows(llama, measured)
    assert fwd["impl"] == fwd_bwd["impl"] == PUBLISHED
    assert np.isclose(fwd["tflops"], 673.0)
    # fwd+bwd: the time of the forward at 673 plus the backward (2.5x its FLOPs) at 579
    assert np.isclose(fwd_bwd["tflops"], 3.5 / (1 / 673.0 + 2.5 / 579.0))
    assert np.isclose(fwd["vs_jax_nn_cudnn"], fwd["ms"] / 10.0)
    assert fwd["vs_flash_attn3"] is None
    assert published_rows(ANCHOR_CONFIGS[0], measured) == []


def test_rounds_interleave_every_function():
    """Each round visits every function once, in turn, with its own inputs."""
    from benchmarks.attention import interleaved_rounds

    calls = []

    def recorder(name):
        def fn(inputs):
            calls.append((name, inputs))
            return jnp.zeros(())
        return fn
    samples = interleaved_rounds({"a": recorder("a"), "b": recorder("b")},
                                 lambda key: key * 2, rounds=3)
    assert calls == [("a", "aa"), ("b", "bb")] * 3
    assert {key: len(times) for key, times in samples.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for times in samples.values() for t in times)


def test_packed_configs_fill_their_rows_and_count_useful_flops():
    from benchmarks import packed  # noqa: PLC0415
    for config in packed.configs():
        assert all(sum(row) == config.seq for row in config.lengths), config.name
        ids = config.segment_ids()
        assert ids.shape == (config.batch, config.seq)
        # one run per document, ids 1..n in order
        assert all(len(np.unique(row)) == len(lengths)
                   for row, lengths in zip(ids, config.lengths))
    eight = packed.configs()[0]
    assert eight.flops("fwd") == 4 * 8 * 2.0 * 16 * 128 * 1024 ** 2
    assert eight.flops("fwd+bwd") == 3.5 * eight.flops("fwd")


def test_packed_markdown_has_a_row_per_result():
    from benchmarks import packed  # noqa: PLC0415
    rows = [dict(config="8x1024", impl=name, mode="fwd", ms=ms, tflops=1.0, compile_s=0.1,
                 first_run_s=0.1, error_vs_bound=0.0, vs_bound=ms / 2.0,
                 vs_flash_varlen=None) for name, ms in (("ragged", 1.0), ("bound", 2.0))]
    table = packed.markdown(rows, {"long": {"ragged": 0.3}})
    assert "| 8x1024 | fwd | ragged | 1.000 | 1 | 0.500 | – |" in table
    assert "| long | ragged | 0.300 |" in table


def test_clock_windows_take_the_samples_of_their_call_and_the_one_just_before():
    from benchmarks.clocks import summary, window
    samples = [(0.98, 1980.0, 120.0), (1.00, 1900.0, 500.0), (1.02, 1700.0, 690.0),
               (1.06, 1600.0, 700.0)]
    assert window(samples, 1.005, 1.03, margin=0.01) == (1800.0, 595.0)
    nan_clock, _ = window(samples, 2.0, 2.1)
    assert nan_clock != nan_clock
    rows = [(0.007, 1980.0, 300.0), (0.009, float("nan"), float("nan")), (0.008, 1700.0, 690.0)]
    assert summary(rows) == (0.008, 1840.0, 495.0)


def test_ragged_plan_timing_uses_the_graph_the_packed_call_runs():
    from benchmarks import packed
    by_name = {c.name: c for c in packed.configs()}
    entries, bound, lengths = plans.ragged_layout(by_name["4x2048"], 64)
    assert (entries, bound) == (32, 2048)
    assert lengths == [2048] * 16 + [0] * 16
    entries, bound, lengths = plans.ragged_layout(by_name["8x1024"], 64)
    assert (entries, bound, lengths) == (32, 1024, [1024] * 32)
    entries, bound, lengths = plans.ragged_layout(by_name["mixed"], 64)
    documents = [n for row in by_name["mixed"].lengths for n in row]
    assert entries >= len(documents) and bound >= max(documents)
    assert lengths[:len(documents)] == documents and not any(lengths[len(documents):])


def test_kernel_times_read_the_gpu_lines_of_a_trace_and_the_table_scales_them(tmp_path):
    import gzip
    import json

    from benchmarks.traces import (events_line, kernel_events, kernel_launches, kernel_table,
                                   kernel_times, launch_table)
    launch = {"kernel_details": "regs:30 grid:256,32,16 block:128,1,1 occ_pct:100"}
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "name": "fprop", "dur": 30, "ts": 50, "args": launch},
              {"ph": "X", "pid": 1, "name": "fprop", "dur": 31, "ts": 10},
              {"ph": "X", "pid": 1, "name": "memset", "dur": 2},
              {"ph": "X", "pid": 2, "name": "fprop", "dur": 500}]
    (tmp_path / "plugins").mkdir()
    with gzip.open(tmp_path / "plugins" / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    totals, counts = kernel_times(str(tmp_path))
    assert totals == {"fprop": 61, "memset": 2} and counts == {"fprop": 2, "memset": 1}
    lines = kernel_table(totals, counts, per=2)
    assert "30.50 µs" in lines[0] and "fprop" in lines[0] and "x1 " in lines[0]
    assert kernel_launches(str(tmp_path)) == {"fprop": ["grid:256,32,16 block:128,1,1"]}
    assert kernel_events(str(tmp_path), "prop") == [(10, 31), (50, 30)]  # GPU only, in order
    assert launch_table(str(tmp_path), per=2)[:2] == [lines[0],
                                                      "        grid:256,32,16 block:128,1,1"]
    assert events_line(str(tmp_path), "prop").endswith("µs: 31 30")
    assert "ms" in kernel_table(totals, counts, unit="ms")[0]


def test_cudnn_parts_fit_one_device_call_each():
    import importlib.util
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "pack_cudnn_parts.py"
    spec = importlib.util.spec_from_file_location("pack_cudnn_parts", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mib = 2**20
    sizes = {"tir": 60 * mib, "graph": 45 * mib, "heuristic": 30 * mib, "ops": 29 * mib,
             "runtime": 17 * mib, "ext": 4 * mib, "cnn": 1 * mib}
    bins = module.parts(sizes)
    assert sorted(f for b in bins for f in b["files"]) == sorted(sizes)
    assert all(b["bytes"] <= module.PART_BYTES for b in bins)
    assert len(bins) == 3  # 186 MiB in 63 MiB parts: no fewer can hold it


def test_fp8_per_call_column_separates_the_chains_fixed_cost(monkeypatch, capsys):
    """benchmarks.fp8 --per-call: from a chain of CALLS calls and one of twice as many, the
    time per call and the chain's fixed cost; every row gets both (jax.nn standing in for the
    GPU implementations on CPU)."""
    from benchmarks import fp8
    from benchmarks.attention import CALLS
    from benchmarks.configs import Config

    # Times per CALLS calls (as time_once gives them) of 3 ms for the short chain and 5 for the
    # doubled one: the extra CALLS calls took 2 * CALLS ms (2 ms per call), and the short
    # chain's 3 * CALLS ms hold CALLS * 2 ms of calls and the rest is its fixed cost.
    assert fp8.per_call(3.0, 5.0) == (2.0, 1.0 * CALLS)

    def attention(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    monkeypatch.setattr(fp8, "available",
                        lambda config: {"jax_sdpa": attention, "jax_sdpa fp8": attention})
    fp8.bench(Config("tiny", 1, 16, 2, 2, 128, jnp.bfloat16, True), rounds=1, doubled=True)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(rows) == 6  # three implementations, fwd and fwd+bwd
    assert all(line.count("|") == 9 for line in rows)


def test_first_call_graph_cache_rows_fill_then_read_one_new_directory(monkeypatch):
    """--graph-cache: a row runs in a process that fills a new JAX_SDPA_GRAPH_CACHE_DIR, then in
    another that reads the same directory; without it, once with the caller's environment."""
    import os
    from benchmarks import first_call

    seen = []

    def fake(module, child_args, timeout, env=None):
        directory = (env or {}).get("JAX_SDPA_GRAPH_CACHE_DIR")
        seen.append((module, child_args, directory, directory and os.path.isdir(directory)))
        return {"first_call_s": 1.0}
    monkeypatch.setattr(first_call, "in_fresh_process", fake)
    stages = first_call.runs("benchmarks.x", ("a",), 5, graph_cache=True)
    assert [stage for stage, _ in stages] == ["graph files filling", "graph files warm"]
    assert seen[0][2] == seen[1][2] and seen[0][3] and seen[1][3]
    assert not os.path.exists(seen[0][2])  # removed afterwards
    assert first_call.runs("benchmarks.x", ("a",), 5) == [("", {"first_call_s": 1.0})]
    assert seen[-1][2] is None
    assert first_call.stage_name("checked", "graph files warm") == "checked, graph files warm"
    assert first_call.stage_name("checked", "") == "checked"


def test_first_call_xla_cache_rows_share_one_compilation_cache(monkeypatch):
    """--graph-cache --xla-cache: both processes also point JAX's persistent compilation cache
    (for every executable) into the same new directory."""
    from benchmarks import first_call

    seen = []

    def fake(module, child_args, timeout, env=None):
        seen.append(dict(env))
        return {"first_call_s": 1.0}
    monkeypatch.setattr(first_call, "in_fresh_process", fake)
    stages = first_call.runs("benchmarks.x", ("a",), 5, graph_cache=True, xla_cache=True)
    assert [stage for stage, _ in stages] == ["graph files and XLA cache filling",
                                              "graph files and XLA cache warm"]
    assert seen[0] == seen[1]
    assert seen[0]["JAX_COMPILATION_CACHE_DIR"].startswith(seen[0]["JAX_SDPA_GRAPH_CACHE_DIR"])
    assert seen[0]["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"


def test_mask_benchmark_densities_are_the_boolean_forms():
    """benchmarks.masks reads each row's kept share from the description's structure (a 32k
    boolean form would take a GiB): the same share its boolean form keeps."""
    from benchmarks import masks as mask_benchmark  # noqa: PLC0415
    seq = 2048
    for name, (mask, _) in mask_benchmark.mask_set(seq).items():
        assert abs(mask_benchmark.intervals_density(mask, seq) - mask.density(seq, seq)) < 1e-9, \
            name