"""Mask descriptions cut into pieces (jax_sdpa/pieces/, jax_sdpa/kernels/pieces.py): the plan
covers exactly the description's kept scores, and the pieces' results equal the boolean mask's
on the reference path, forward and every gradient pattern, at odd lengths, B = 1, T != S, GQA,
rows that keep no key, under vmap and the sharding rules. On a GPU our dense target runs the
pieces; without one, tests/ragged_emulator.py stands in for its calls (its backward computes
from the output and lse it is given, as cuDNN's does)."""

import gc
import random
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_sdpa
import ragged_emulator
import random_masks
from conftest import gradient_patterns, random_qkv, reference_gradients, relative_error
from jax_sdpa import masks
from jax_sdpa.call.spec import Piece
from jax_sdpa.limits import device
from jax_sdpa.pieces import intervals
from jax_sdpa.pieces import plan as pieces_plan

DESCRIPTIONS = {
    "prefix_lm": lambda t: masks.prefix_lm(t // 3),
    "global | causal window": lambda t: masks.global_tokens(2) | (
        masks.causal() & masks.sliding_window(4)),
    "symmetric window": lambda t: masks.sliding_window(3, 5),
    "keys ahead (a right bound alone)": lambda t: masks.sliding_window(0, 4),
    "causal window, rows past the keys see none": lambda t: masks.sliding_window(1, 1) &
    masks.causal(),
    "union of windows": lambda t: masks.sliding_window(1, 0) | masks.sliding_window(0, 6),
    "global | prefix": lambda t: masks.global_tokens(3) | masks.prefix_lm(5),
    "block table": lambda t: masks.block_table(
        np.array([[1, 0, 0, 0, 1], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [1, 0, 1, 1, 0],
                  [0, 0, 1, 1, 1]], bool), 8, 8),
    "from_boolean rectangles": lambda t: masks.from_boolean(np.tile(
        np.arange(40)[None, :] % 10 < 6, (40, 1))),
}
SHAPES = {"T=S=13": (1, 13, 13, 4, 2), "T=7 S=20": (2, 7, 20, 4, 4),
          "T=20 S=7": (1, 20, 7, 2, 1), "T=1 S=9": (1, 1, 9, 2, 2), "T=S=33": (2, 33, 33, 4, 1)}


@pytest.fixture
def cudnn(monkeypatch):
    """Our cuDNN kernels: on a GPU the real ones, else the emulated calls."""
    if device.device_reason() is not None:
        monkeypatch.setattr(device, "device_reason", lambda: None)
        ragged_emulator.emulate(monkeypatch)


def _covered(pieces, q_seq_len, kv_seq_len, heads):
    """int [N, T, S]: how many pieces hold each score."""
    count = np.zeros((heads, q_seq_len, kv_seq_len), int)
    for p in pieces:
        rows = np.arange(p.q_stop - p.q_start)[:, None]
        keys = np.arange(p.kv_stop - p.kv_start)[None, :]
        offset = (p.kv_stop - p.kv_start) - (p.q_stop - p.q_start) if p.bottom_right else 0
        keep = np.ones(rows.shape[:1] + keys.shape[1:], bool)
        if p.window_left >= 0:
            keep &= keys >= rows + offset - p.window_left
        if p.window_right >= 0:
            keep &= keys <= rows + offset + p.window_right
        count[p.head_start:p.head_stop or heads, p.q_start:p.q_stop,
              p.kv_start:p.kv_stop] += keep
    return count


@pytest.mark.parametrize("seed", range(40))
def test_pieces_cover_the_kept_scores_once(seed):
    draw = random.Random(seed)
    heads, kv_heads = 4, draw.choice([1, 2, 4])
    t, s = draw.choice([1, 9, 40, 64]), draw.choice([1, 9, 40, 64])
    mask = random_masks.positional(draw, heads, 3, max(t, s))
    kept_keys = intervals.of_mask(mask, t, s)
    keep = np.broadcast_to(np.asarray(mask.to_boolean(t, s))[0], (heads, t, s))
    for kept in (kept_keys, pieces_plan.at_diagonal(kept_keys)):  # either cut
        pieces = pieces_plan.cut(kept, heads, kv_heads)
        if pieces is None:
            continue  # past the bound
        count = _covered(pieces, t, s, heads)
        np.testing.assert_array_equal(count, keep.astype(int), err_msg=repr(mask))
        for p in pieces:  # a band with a left bound needs its queries no more than its keys
            assert p.window_left < 0 or p.q_stop - p.q_start <= p.kv_stop - p.kv_start


def test_the_issue_masks_cut_into_few_pieces():
    t = s = 8192
    prefix = pieces_plan.plan(masks.prefix_lm(2048), t, s, 16, 16)
    assert len(prefix.forward) == 2 and 0.531 <= prefix.forward_share < 0.56  # copies counted
    union = pieces_plan.plan(masks.global_tokens(64) | (masks.causal() &
                                                        masks.sliding_window(1024)), t, s, 16, 16)
    assert len(union.forward) == 4 and union.backward_share < 0.16  # copies counted
    window = pieces_plan.plan(masks.sliding_window(2048, 2048), t, s, 16, 16)
    assert len(window.forward) == 1 and window.forward[0].window_right == 2048  # native
    assert all(p.window_right in (-1, 0) for p in window.backward)
    # backward: cut at the diagonal, each half a band on it (not a band across it: 0.594)
    assert window.backward_share < 0.51
    # prefix_lm: the whole causal square, then the prefix's keys right of the diagonal
    assert prefix.forward[0] == Piece(0, t, 0, s, window_right=0)
    assert isinstance(pieces_plan.plan(masks.causal() & masks.sliding_window(1024), t, s, 16, 16),
                      str)  # cuDNN's own band does it
    # a causal window per head: one piece per head (the band clips its own first rows)
    per_head = pieces_plan.plan(masks.sliding_window(tuple(range(0, 1600, 100))) &
                                masks.causal(), t, s, 16, 16)
    assert len(per_head.forward) == len(per_head.backward) == 16
    assert all((p.q_start, p.q_stop, p.kv_start, p.kv_stop) == (0, t, 0, s)
               for p in per_head.forward)
    assert "more than" in pieces_plan.plan(
        masks.sliding_window(tuple(range(0, 3200, 100))) & masks.causal(), t, s, 32, 32)


def _run(description, shape, dtype=jnp.bfloat16):
    batch, t, s, heads, kv_heads = shape
    q, k, v, d_out = random_qkv(t + s, batch, t, s, heads, kv_heads, 64, dtype)
    mask = description(max(t, s))
    boolean = mask.to_boolean(t, s)

    def ours(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")

    def reference(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, mask=boolean, implementation="xla")
    return ours, reference, (q, k, v, d_out)


def _check(name, shape):
    description = DESCRIPTIONS[name]
    ours, reference, (q, k, v, d_out) = _run(description, shape)
    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    got = (out, *vjp(d_out))
    want = reference_gradients(reference, q, k, v, d_out)
    for what, a, b in zip(("output", "dq", "dk", "dv"), got, want):
        assert relative_error(a, b) < (1e-2 if what == "output" else 2e-2), what


ARRAYS = ("block table", "from_boolean rectangles")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(set(DESCRIPTIONS) - set(ARRAYS)))
def test_pieces_equal_the_boolean_mask(cudnn, name, shape):
    _check(name, SHAPES[shape])


@pytest.mark.parametrize("name", ARRAYS)
def test_arrays_with_few_rectangles_take_pieces(cudnn, name):
    _check(name, (2, 40, 40, 4, 1))


@pytest.mark.parametrize("name", sorted(set(DESCRIPTIONS) - {
    "causal window, rows past the keys see none"}))
def test_descriptions_take_pieces(cudnn, name):
    # (the arrays are 40 x 40; the descriptions at a length where copying a slice costs less
    # than the dense rows it saves: at T = 40 a window bounded on both sides runs as cuDNN's
    # own band both ways)
    length = 40 if name in ARRAYS else 1024
    q = jax.ShapeDtypeStruct((1, length, 4, 64), jnp.bfloat16)
    assert "the mask cut into" in jax_sdpa.explain(q, q, q, mask=DESCRIPTIONS[name](length),
                                                   implementation="cudnn")


def test_a_call_takes_pieces_and_explain_names_them(cudnn):
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    text = jax_sdpa.explain(q, q, q, mask=masks.prefix_lm(64), implementation="cudnn")
    assert "forward: cuDNN, our dense target, the mask cut into 2 pieces" in text
    boolean = jax_sdpa.explain(q, q, q, mask=masks.prefix_lm(64), bias=jnp.zeros((1, 1, 256, 256)),
                               implementation="cudnn")
    assert "pieces" not in boolean  # a bias: the description's other routes


@pytest.mark.parametrize("pattern", range(4))
def test_every_gradient_pattern(cudnn, pattern):
    ours, reference, (q, k, v, d_out) = _run(DESCRIPTIONS["global | causal window"],
                                             (1, 29, 29, 4, 2))
    name, fn = gradient_patterns(ours)[pattern]
    got = fn(q, k, v, d_out)
    want = reference_gradients(reference, q, k, v, d_out)
    for a, b in zip(got, want):
        assert relative_error(a, b) < 2e-2, name


def test_the_call_keywords_join_the_description(cudnn):
    """is_causal and local_window_size with a description: their intersection, in pieces."""
    q, k, v, d_out = random_qkv(3, 1, 21, 21, 2, 2, 64, jnp.bfloat16)
    mask = masks.global_tokens(3) | masks.sliding_window(2, 4)
    ours = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=(6, 6), implementation="cudnn"))
    boolean = (mask & masks.causal() & masks.sliding_window(6, 6)).to_boolean(21, 21)
    ref = jax_sdpa.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                         mask=boolean, implementation="xla")
    assert relative_error(ours(q, k, v), ref) < 1e-2


def test_vmap_and_sinks_and_soft_cap(cudnn):
    q, k, v, d_out = random_qkv(5, 1, 19, 19, 4, 2, 64, jnp.bfloat16)
    mask = masks.prefix_lm(6)
    sinks = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)

    def run(implementation, mask):
        def fn(q, k, v):
            return jax_sdpa.dot_product_attention(q, k, v, mask=mask, sinks=sinks,
                                                  logits_soft_cap=5.0,
                                                  implementation=implementation)
        return jax.jit(jax.vmap(fn, in_axes=(2, 2, 2), out_axes=2))
    stack = lambda x: jnp.stack([x, x[::-1]], axis=2)  # noqa: E731  (a vmapped axis of 2)
    args = [stack(x) for x in (q, k, v)]
    got = run("cudnn", mask)(*args)
    want = run("xla", mask.to_boolean(19, 19))(*(x.astype(jnp.float32) for x in args))
    assert relative_error(got, want) < 1e-2


def test_pieces_under_batch_and_head_sharding(cudnn):
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v, d_out = random_qkv(9, 2 * n, 17, 17, 4, 2, 64, jnp.bfloat16)
    mask = masks.global_tokens(2) | (masks.causal() & masks.sliding_window(3))

    def step(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, mask=mask, implementation="cudnn"), q, k, v)
        return (out, *vjp(d_out))
    spec = NamedSharding(mesh, P("data"))
    sharded = jax.jit(step, in_shardings=(spec,) * 4)(q, k, v, d_out)
    single = jax.jit(step)(q, k, v, d_out)
    for a, b in zip(sharded, single):  # bf16 rounds where XLA fuses differently per shard
        assert relative_error(a, b) < 5e-3


def _heads_kept_by_shard(heads, shards):
    """bool [N, 23, 23]: per-head keys, every head of the last shard keeping none."""
    keep = np.tril(np.ones((23, 23), bool))[None] & (
        np.arange(23)[None, None, :] >= np.arange(23)[None, :, None] -
        (2 + np.arange(heads) % 3)[:, None, None])
    keep[heads - heads // shards:] = False
    return keep


@pytest.mark.parametrize("mask_of", [
    lambda heads, n: masks.causal() & masks.sliding_window(
        tuple(2 + (h // 2) % 3 for h in range(heads))),
    lambda heads, n: masks.from_boolean(_heads_kept_by_shard(heads, n))],
    ids=["windows per head", "a shard's heads keep none"])
def test_pieces_by_head_under_head_sharding(cudnn, mask_of):
    """Pieces that cut the heads under head sharding: each device runs its own heads' pieces
    (no gather of the heads: the compiled program has no all-gather), heads that keep no key
    run no kernel, and the result is the single device's and the reference's."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    heads = 2 * n
    q, k, v, d_out = random_qkv(10, 1, 23, 23, heads, heads, 64, jnp.bfloat16)
    mask = mask_of(heads, n)
    assert "the mask cut into" in jax_sdpa.explain(q, k, v, mask=mask, implementation="cudnn")

    def step(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, mask=mask, implementation="cudnn"), q, k, v)
        return (out, *vjp(d_out))
    spec = NamedSharding(mesh, P(None, None, "model"))
    sharded_step = jax.jit(step, in_shardings=(spec,) * 4, out_shardings=(spec,) * 4)
    assert "all-gather" not in sharded_step.lower(q, k, v, d_out).compile().as_text()
    sharded = sharded_step(q, k, v, d_out)
    single = jax.jit(step)(q, k, v, d_out)
    ref = reference_gradients(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, mask=mask.to_boolean(23, 23), implementation="xla"), q, k, v, d_out)
    for a, b, r in zip(sharded, single, ref):
        assert relative_error(a, b) < 5e-3 and relative_error(a, r) < 2e-2


def test_one_piece_from_the_bottom_right_corner_backward(cudnn):
    """A description that is one piece over every row and key, causal from the bottom-right
    corner (T < S): its backward runs padded top-left too, as its forward does."""
    mask = masks.prefix_lm(0) | masks.sliding_window(3, 50)
    (piece,) = pieces_plan.plan(mask, 70, 120, 2, 2).backward
    assert piece.bottom_right and (piece.q_stop, piece.kv_stop) == (70, 120)
    ours, reference, (q, k, v, d_out) = _run(lambda t: mask, (1, 70, 120, 2, 2))
    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    for a, b in zip((out, *vjp(d_out)), reference_gradients(reference, q, k, v, d_out)):
        assert relative_error(a, b) < 2e-2


@pytest.mark.parametrize("seed", range(12))
def test_a_run_of_heads_keeps_their_pieces_scores(seed):
    """pieces_plan.on_heads: the pieces of a run of heads, numbered from its first, cover
    exactly those heads' scores of the whole plan."""
    draw = random.Random(seed)
    heads, shards = 8, draw.choice([2, 4, 8])
    mask = random_masks.positional(draw, heads, 3, 40)
    plan = pieces_plan.plan(mask, 40, 40, heads, heads)
    if isinstance(plan, str):
        return
    whole = _covered(plan.forward, 40, 40, heads)
    local = heads // shards
    for shard in range(shards):
        pieces = pieces_plan.on_heads(plan.forward, shard * local, (shard + 1) * local, heads)
        np.testing.assert_array_equal(_covered(pieces, 40, 40, local),
                                      whole[shard * local:(shard + 1) * local])


def test_plans_are_cached_by_the_descriptions_values():
    """The same values in another description find the same plan; a table changed in place
    after the first plan plans anew; the cache keeps no description's array and stays at its
    bound."""
    table = np.eye(5, dtype=bool)
    first = pieces_plan.plan(masks.block_table(table, 8, 8), 40, 40, 2, 2)
    assert pieces_plan.plan(masks.block_table(table.copy(), 8, 8), 40, 40, 2, 2) is first
    table[0, 4] = True  # in place: the same array object, other values
    changed = pieces_plan.plan(masks.block_table(table, 8, 8), 40, 40, 2, 2)
    assert changed != first
    assert _covered(changed.forward, 40, 40, 2)[:, :8, 32:].all()

    array = np.tril(np.ones((40, 40), bool))
    array[:, :3] = True
    watched = weakref.ref(array)
    pieces_plan.plan(masks.from_boolean(array), 40, 40, 2, 2)
    del array
    gc.collect()
    assert watched() is None  # the plan's cache holds a digest, not the array
    for width in range(pieces_plan.PLAN_CACHE_SIZE + 8):
        pieces_plan.plan(masks.sliding_window(width, 1), 40, 40, 2, 2)
    assert len(pieces_plan._plans) == pieces_plan.PLAN_CACHE_SIZE


def test_a_table_changed_in_place_gives_the_new_masks_results(cudnn):
    """dot_product_attention after the table a description holds changed in place computes
    the new mask (a stale plan would keep the old pieces)."""
    table = np.eye(3, dtype=bool)
    mask = masks.block_table(table, 8, 8)
    q, k, v, _ = random_qkv(3, 1, 24, 24, 2, 2, 64, jnp.bfloat16)

    def check():
        ours = jax_sdpa.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
        want = jax_sdpa.dot_product_attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), mask=mask.to_boolean(24, 24),
            implementation="xla")
        assert relative_error(ours, want) < 1e-2
    check()
    table[2, 0] = True
    check()
