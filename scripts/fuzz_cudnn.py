"""What users can build, run on cuDNN in child processes: random score_mod programs
(tests/random_score_mods.py) and random mask descriptions (tests/random_masks.py: unions,
intersections, per-head windows, prefix_lm, global tokens, T != S), each forward and backward
under jit(vjp), against the float32 reference.

A crash inside cuDNN cannot be caught, so the cases run in child processes that each run many:
the parent reads each child's "begin N" / "end N {...}" lines, and where a child dies the case
it had begun is recorded as a crash and a new child starts at the next case. Outcomes:

  matched    ran on cuDNN and agreed with the reference (relative error norms)
  mismatch   ran on cuDNN and did not agree
  refused    planning refused it before cuDNN saw it (implementation="cudnn" raised, naming why)
  cudnn      cuDNN failed and the failure came back as a Python exception
  error      any other Python exception (a bug of ours)
  crash      the child died inside the case
  hang       no word from the child for --case-timeout seconds

  python scripts/fuzz_cudnn.py --cases 500 --workers 8 --out DIR   (DIR/fuzz.jsonl, fuzz.md)

Case N is drawn from (--seed, N) alone, so `--first N --cases 1` replays it. Masks are drawn
twice over: through the public route (`mask=description`: cuDNN's own masks, pieces, a score_mod
or the boolean form, as planning picks) and forced into a score_mod (`masks.as_score_mod`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import queue
import random
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("score_mod", "mask", "mask_score_mod")
OUT_TOLERANCE, GRADIENT_TOLERANCE = 2e-2, 5e-2
LENGTHS = (1, 7, 64, 128, 130, 257, 300)
REFERENCE_SCORES = 1 << 22  # past T * S this large, a case only has to run


# Named cases (--probe): the programs that crashed, at the sizes they crashed at, and their
# neighbours that tell one cause from another. (text, route, shape B, T, S, N, K, H, grad)
_TEST_SHAPE = (2, 192, 256, 4, 2, 64)  # tests/test_gpu.py's
_ISSUE_SHAPE = (1, 8192, 8192, 16, 16, 128)
PROBES = (
    ("masks.global_tokens(4) | masks.sliding_window(16, 0)", "score_mod", _TEST_SHAPE, True),
    ("masks.global_tokens(4) | masks.sliding_window(16, 0)", "score_mod", _TEST_SHAPE, False),
    ("masks.sliding_window((0, 8, 32, 100), (0, 0, 4, 0))", "score_mod", _TEST_SHAPE, True),
    ("masks.sliding_window((0, 8, 32, 100), (0, 0, 4, 0))", "score_mod", _TEST_SHAPE, False),
    ("masks.global_tokens(64) | (masks.causal() & masks.sliding_window(1024))", "score_mod",
     _ISSUE_SHAPE, True),
    ("masks.global_tokens(64) | (masks.causal() & masks.sliding_window(1024))", "mask",
     _ISSUE_SHAPE, True),
    ("masks.prefix_lm(5)", "score_mod", _TEST_SHAPE, True),  # logic in both, few nodes
    ("masks.global_tokens(4) | masks.causal()", "score_mod", _TEST_SHAPE, True),
    ("masks.sliding_window((0, 8, 32, 100), 0)", "score_mod", _TEST_SHAPE, True),
    # no logic: 6 + 17 nodes, then 9 + 21 (one comparison)
    ("lambda s, b, h, q, k: 3.0 * jnp.tanh(s / 3.0) + 0.5 * jnp.tanh(s)", "score_mod",
     _TEST_SHAPE, True),
    ("lambda s, b, h, q, k: jnp.where(k <= q, 3.0 * jnp.tanh(s / 3.0) + 0.5 * jnp.tanh(0.5 * s), "
     "-jnp.inf)", "score_mod", _TEST_SHAPE, True),
    # logic in the forward alone, 23 + 2 nodes
    ("lambda s, b, h, q, k: jnp.where(k <= q, s + 0.05 * ((q - k) // 7), -jnp.inf)",
     "score_mod", _TEST_SHAPE, True),
)


def draw_case(seed: int, index: int, probe: bool = False) -> dict:
    """The case's description, JSON-ready: kind, shape, and the drawing seed (or, with probe,
    PROBES[index])."""
    if probe:
        text, route, shape, grad = PROBES[index]
        return dict(index=index, kind=f"probe {route}", text=text, grad=grad,
                    **dict(zip(("batch", "q_seq_len", "kv_seq_len", "heads", "kv_heads",
                                "head_dim"), shape)))
    draw = random.Random(f"{seed}-{index}")
    heads = draw.choice((2, 4))
    return dict(index=index, kind=KINDS[index % len(KINDS)], batch=draw.choice((1, 2)),
                q_seq_len=draw.choice(LENGTHS), kv_seq_len=draw.choice(LENGTHS), heads=heads,
                kv_heads=draw.choice([k for k in (1, 2, 4) if heads % k == 0]),
                head_dim=draw.choice((64, 128)), draw=draw.randrange(1 << 30))


# --- the child ------------------------------------------------------------------------------

def _keywords(case):
    """dot_product_attention's keywords for the case, and their text."""
    import jax.numpy as jnp  # noqa: PLC0415 - the parent never imports JAX
    import random_masks  # noqa: PLC0415
    import random_score_mods  # noqa: PLC0415
    from jax_sdpa import masks  # noqa: PLC0415

    if case["kind"].startswith("probe"):
        value = eval(case["text"], {"jax": __import__("jax"), "jnp": jnp,  # noqa: S307
                                    "masks": masks})
        if case["kind"] == "probe mask":
            return dict(mask=value), case["text"]
        return dict(score_mod=masks.as_score_mod(value) if isinstance(value, masks.Mask)
                    else value), case["text"]
    draw = random.Random(case["draw"])
    if case["kind"] == "score_mod":
        table = jnp.linspace(-1.0, 1.0, case["heads"], dtype=jnp.float32)
        source, fn = random_score_mods.function(case["draw"], table)
        return dict(score_mod=fn), source
    reach = max(case["q_seq_len"], case["kv_seq_len"])
    mask = random_masks.positional(draw, case["heads"], 3, reach)
    if case["kind"] == "mask":
        return dict(mask=mask), repr(mask)
    return dict(score_mod=masks.as_score_mod(mask)), repr(mask)


def _programs(keywords):
    """[forward, derivative] programs of the score_mod cuDNN would run, or None."""
    from jax_sdpa.score_mod.program import UnsupportedScoreMod, translate  # noqa: PLC0415

    fn = keywords.get("score_mod")
    if fn is None:
        return None
    try:
        program = translate(fn)
    except UnsupportedScoreMod:
        return None
    return [program.forward, program.backward]


def describe(case) -> tuple[dict, dict]:
    """(the case's keywords, what the record says of them: text, programs, node counts)."""
    from jax_sdpa.score_mod.program import graph_nodes  # noqa: PLC0415

    keywords, text = _keywords(case)
    programs = _programs(keywords)
    nodes = None if programs is None else [graph_nodes(p) for p in programs]
    return keywords, dict(text=text, programs=programs, nodes=nodes)


def run_case(case, keywords, result) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from conftest import random_qkv, relative_error  # noqa: PLC0415

    import jax_sdpa  # noqa: PLC0415

    q, k, v, d_out = random_qkv(case["index"], case["batch"], case["q_seq_len"],
                                case["kv_seq_len"], case["heads"], case["kv_heads"],
                                case["head_dim"], jnp.bfloat16)

    def run(implementation, cast):
        def fn(q, k, v):
            return jax_sdpa.dot_product_attention(cast(q), cast(k), cast(v),
                                                  implementation=implementation, **keywords)
        if not case.get("grad", True):
            return [jax.jit(fn)(q, k, v)]
        out, vjp = jax.vjp(jax.jit(fn), q, k, v)
        return [out, *vjp(cast(d_out).astype(out.dtype))]
    try:
        ours = run("cudnn", lambda x: x)
        ours = [jax.device_get(x) for x in ours]
    except NotImplementedError as error:
        return dict(result, outcome="refused", message=str(error)[:400])
    except Exception as error:  # noqa: BLE001 - what came back from cuDNN or from us
        outcome = "cudnn" if "cudnn" in str(error).lower() else "error"
        return dict(result, outcome=outcome, message=f"{type(error).__name__}: {error}"[:600])
    if case["q_seq_len"] * case["kv_seq_len"] > REFERENCE_SCORES:
        return dict(result, outcome="matched", message="ran (too large for the reference)")
    with jax.default_matmul_precision("float32"):
        ref = run("xla", lambda x: x.astype(jnp.float32))
    errors = {}
    for name, a, b in zip(("output", "dq", "dk", "dv"), ours, ref):
        try:
            errors[name] = relative_error(a, b)
        except AssertionError:  # non-finite values
            errors[name] = float("inf")
    bound = lambda name: OUT_TOLERANCE if name == "output" else GRADIENT_TOLERANCE  # noqa: E731
    matched = all(error < bound(name) for name, error in errors.items())
    return dict(result, outcome="matched" if matched else "mismatch",
                errors={name: float(f"{e:.3g}") for name, e in errors.items()})


def child(seed, indices, crash_at, probe, node_limit):
    import faulthandler  # noqa: PLC0415

    faulthandler.enable()  # a crash's Python stack on stderr, which the parent keeps
    sys.path.insert(0, str(ROOT / "tests"))
    if node_limit is not None:  # to learn where cuDNN fails, past the limit we run it to
        from jax_sdpa.limits import dense  # noqa: PLC0415
        dense.MAX_SCORE_MOD_INSTRUCTIONS = node_limit
    for index in indices:
        case = draw_case(seed, index, probe)
        keywords, described = describe(case)
        print(f"begin {index} {json.dumps(described)}", flush=True)
        if index == crash_at:  # the harness's own test: a child that dies mid-case
            os.abort()
        started = time.perf_counter()
        result = run_case(case, keywords, described)
        result["seconds"] = round(time.perf_counter() - started, 2)
        print(f"end {index} {json.dumps(result)}", flush=True)


# --- the parent -----------------------------------------------------------------------------

def _child_command(args, indices):
    return [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", "--seed",
            str(args.seed), "--indices", ",".join(map(str, indices)),
            "--crash-at", str(args.crash_at)] + (["--probe"] if args.probe else []) + (
                [] if args.node_limit is None else ["--node-limit", str(args.node_limit)])


def _worker(args, indices, results: queue.Queue):
    """Runs `indices` in children, a new child after each crash or hang."""
    pending = list(indices)
    while pending:
        process = subprocess.Popen(_child_command(args, pending), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT)
        lines: queue.Queue = queue.Queue()
        stderr_tail = collections.deque(maxlen=30)
        threading.Thread(target=_drain, args=(process.stdout, lines.put, True),
                         daemon=True).start()
        threading.Thread(target=_drain, args=(process.stderr, stderr_tail.append, False),
                         daemon=True).start()
        begun, described, waited = None, {}, 0.0
        while True:
            if time.monotonic() > args.deadline:  # out of time: the rest stays unrun
                process.kill()
                process.wait()
                return
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                if waited < args.case_timeout:
                    continue
                process.kill()
                process.wait()
                _lost(args, begun, described, "hang", process, stderr_tail, results)
                break
            waited = 0.0
            if line is None:  # the child's stdout closed: it ended or died
                process.wait()
                if begun is not None:
                    _lost(args, begun, described, "crash", process, stderr_tail, results)
                break
            word, _, rest = line.rstrip("\n").partition(" ")
            if word == "begin":
                index, _, payload = rest.partition(" ")
                begun, described = int(index), json.loads(payload)
            elif word == "end":
                index, _, payload = rest.partition(" ")
                results.put(dict(draw_case(args.seed, int(index), args.probe), **json.loads(payload)))
                pending.remove(int(index))
                begun = None
        if begun is not None:
            pending.remove(begun)
        elif process.returncode not in (0, None) and pending:
            # died between cases (at start, say): the next case is not to blame, but recorded
            index = pending.pop(0)
            _lost(args, index, {}, "crash", process, stderr_tail, results)


def _drain(stream, put, then_none):
    for line in stream:
        put(line)
    if then_none:
        put(None)


def _lost(args, index, described, outcome, process, stderr_tail, results):
    results.put(dict(draw_case(args.seed, index, args.probe), **described, outcome=outcome,
                     returncode=process.returncode,
                     message="".join(stderr_tail)[-1500:]))


def _summary(records, every=False) -> str:
    counts = collections.Counter(r["outcome"] for r in records)
    by_kind = collections.defaultdict(collections.Counter)
    for r in records:
        by_kind[r["kind"]][r["outcome"]] += 1
    outcomes = ("matched", "mismatch", "refused", "cudnn", "error", "crash", "hang")
    lines = ["| kind | " + " | ".join(outcomes) + " |", "|---" * (len(outcomes) + 1) + "|"]
    for kind in sorted(by_kind):
        lines.append(f"| {kind} | " + " | ".join(str(by_kind[kind][o]) for o in outcomes) + " |")
    lines.append("| all | " + " | ".join(str(counts[o]) for o in outcomes) + " |")
    bad = [r for r in records if every or r["outcome"] in ("mismatch", "cudnn", "error", "crash",
                                                           "hang")]
    for r in sorted(bad, key=lambda r: r["index"]):
        message = "".join(line for line in r.get("message", "").splitlines(True)
                          if not line.startswith("Extension modules"))
        detail = r.get("errors") or message[-300:]
        lines.append(f"- case {r['index']} {r['outcome']} {r['kind']} B={r['batch']} "
                     f"T={r['q_seq_len']} S={r['kv_seq_len']} N={r['heads']}/{r['kv_heads']} "
                     f"H={r['head_dim']} nodes={r.get('nodes')}: {r.get('text', '')[:200]} "
                     f"-> {detail}")
    return "\n".join(lines)


def parent(args):
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = len(PROBES) if args.probe else args.cases
    indices = list(range(args.first, args.first + cases))
    results: queue.Queue = queue.Queue()
    workers = [threading.Thread(target=_worker, args=(args, indices[w::args.workers], results))
               for w in range(min(args.workers, len(indices)))]
    started = time.perf_counter()
    args.deadline = time.monotonic() + args.budget
    for worker in workers:
        worker.start()
    records = []
    with open(out / "fuzz.jsonl", "w") as log:
        while any(w.is_alive() for w in workers) or not results.empty():
            try:
                record = results.get(timeout=1.0)
            except queue.Empty:
                continue
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            if record["outcome"] not in ("matched", "refused"):
                print(f"case {record['index']}: {record['outcome']}", flush=True)
    summary = _summary(records, every=args.probe)
    text = (f"{len(records)} of {len(indices)} {'probes' if args.probe else 'cases'} (seed "
            f"{args.seed}, first {args.first}) in "
            f"{time.perf_counter() - started:.0f} s, {args.workers} children at a time\n\n"
            f"{summary}\n")
    (out / "fuzz.md").write_text(text)
    print(text)
    bad = sum(r["outcome"] not in ("matched", "refused") for r in records)
    return 1 if bad else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--case-timeout", type=float, default=240.0)
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds: then the children are stopped and the cases run so far "
                             "summed up")
    parser.add_argument("--out", default="/tmp/fuzz")
    parser.add_argument("--probe", action="store_true",
                        help="run the named cases (PROBES) instead of random ones")
    parser.add_argument("--node-limit", type=int, default=None,
                        help="run score_mods up to this many nodes on cuDNN (default: "
                             "limits/dense.MAX_SCORE_MOD_INSTRUCTIONS): to learn where it fails")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--indices", default="", help=argparse.SUPPRESS)
    parser.add_argument("--crash-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.seed, [int(i) for i in args.indices.split(",") if i], args.crash_at,
              args.probe, args.node_limit)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
