"""The cuDNN path lowers to our own FFI custom calls (never JAX's __cudnn$fmha), under grad,
vmap and checkpoint. Lowering for CUDA needs no GPU, so this runs in CI."""

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest

import jax_sdpa
from jax_sdpa.call.spec import CallSpec, graph_options
from jax_sdpa.cudnn import call as cudnn_call
from jax_sdpa.cudnn import extension
from jax_sdpa.cudnn.targets import BY_NAME, TARGETS
from conftest import calls_to, kernel_attention, twins

FORWARD, BACKWARD = "forward", "backward"  # our targets' roles (either twin: conftest.calls_to)


def test_extension_registers_every_declared_target():
    """The extension registers exactly jax_sdpa/cudnn/targets.py's targets (and their
    command-buffer twins), each decoding exactly the attributes Python sends it."""
    module = extension.extension()
    assert set(module.registrations()) == set(extension.target_names())
    assert len(extension.target_names()) == 2 * len(TARGETS)
    decoded = module.target_attributes()
    for target in TARGETS:
        assert decoded[target.name] == list(cudnn_call.attribute_names(target))
    assert module.cudnn_header_version() >= 90000


def backend_config(text, role, job=None):
    """(target name, attribute names) of the first call to our target of `role` (and job) in
    lowered StableHLO."""
    line = calls_to(text, role, job)[0]
    name = re.search(r"custom_call @(\w+)\(", line).group(1).removesuffix("_cmdbuf")
    config = line[line.index("mhlo.backend_config = {") + len("mhlo.backend_config = {"):]
    return name, set(re.findall(r"(\w+) = ", config.split("}")[0]))


def assert_decoded(text, role, job):
    """The call of our `job` target of `role` sends exactly the attributes its handler decodes."""
    name, attributes = backend_config(text, role, job)
    assert name == f"jax_sdpa_{job}_{role}"
    assert attributes == set(extension.extension().target_attributes()[name])


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_python_attributes_are_what_the_handlers_decode(packed, monkeypatch):
    """Every attribute Python sends is one the C++ handler of that target decodes, and none is
    missing; a packed call lowers to the ragged targets, a dense one to the dense targets."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
    ids = jnp.zeros((2, 64), jnp.int32) if packed else None
    grad = jax.grad(lambda q: jax_sdpa.dot_product_attention(
        q, q, q, is_causal=True, query_segment_ids=ids,
        implementation="cudnn").astype(jnp.float32).sum())
    text = jax.jit(grad).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    job = "ragged" if packed else "dense"
    for role in (FORWARD, BACKWARD):
        assert_decoded(text, role, job)
    assert lowers_to_job(text, "dense") != packed


def test_poisoned_twins_replace_our_targets_only_while_asked(monkeypatch):
    """Inside tests/poisoning.py's poison_outputs() a call lowers to the devtools' poisoned
    twins of our targets (what proves, on a GPU, that every result element is written), and
    after it to the product's own again."""
    from poisoning import poison_outputs

    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)

    def names():
        return custom_call_names(jax.grad(lambda q: jax_sdpa.dot_product_attention(
            q, q, q, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()), q)
    product = names()
    assert product <= {name for role in (FORWARD, BACKWARD) for name in twins(role)}
    with poison_outputs():
        assert names() == {re.sub(r"_(forward|backward)", r"_\1_poisoned", name)
                           for name in product}
    assert names() == product


def dense_twins():
    """({the dense forward and backward}, {their command-buffer twins})."""
    plain, buffered = zip(twins(FORWARD, "dense"), twins(BACKWARD, "dense"))
    return set(plain), set(buffered)


def lowers_to_job(text, job):
    return bool(calls_to(text, FORWARD, job) or calls_to(text, BACKWARD, job))


def custom_call_names(fn, *args):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "cudnn$fmha" not in text
    return set(re.findall(r"custom_call @([\w$]+)", text))


def custom_calls(fn, *args):
    """The custom calls fn lowers to: ours by role (either twin), others by name."""
    roles = {name: role for role in (FORWARD, BACKWARD) for name in twins(role)}
    return {roles.get(name, name) for name in custom_call_names(fn, *args)}


def loss(q, k, v):
    output, _ = kernel_attention(q, k, v, CallSpec(0.125, window_right=0))
    return output.astype(jnp.float32).sum()


@pytest.mark.parametrize("transform", ["plain", "grad", "vmap_grad", "checkpoint_grad"])
def test_lowers_to_our_targets(transform):
    q = jnp.zeros((2, 128, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 96, 2, 64), jnp.bfloat16)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    fn, args = {
        "plain": (loss, (q, kv, kv)),
        "grad": (grad, (q, kv, kv)),
        "vmap_grad": (jax.vmap(grad), (q[None], kv[None], kv[None])),
        "checkpoint_grad": (jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)), (q, kv, kv)),
    }[transform]
    expected = {FORWARD} if transform == "plain" else {
        FORWARD, BACKWARD}
    assert expected <= custom_calls(fn, *args)


@pytest.mark.parametrize("option", ["bias", "mask", "lengths", "window", "dropout",
                                    "bottom_right", "segments", "everything"])
def test_options_lower_to_our_targets(option, monkeypatch):
    """Every option reaches our custom calls; dbias only where the user's bias needs it."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    b, t, s, n, h = 2, 48, 64, 4, 64
    q = jnp.zeros((b, t, n, h), jnp.float16)
    kv = jnp.zeros((b, s, 2, h), jnp.float16)
    kwargs = {}
    if option in ("bias", "everything"):
        kwargs["bias"] = jnp.zeros((1, n, t, s), jnp.float32)
    if option in ("mask", "everything"):
        kwargs["mask"] = jnp.ones((b, 1, 1, s), bool)
    if option in ("lengths", "everything"):
        kwargs["query_seq_lengths"] = jnp.array([t, 5], jnp.int32)
    if option in ("window", "everything"):
        kwargs["local_window_size"] = (8, 0)
    if option in ("dropout", "everything"):
        kwargs.update(dropout_rate=0.25, dropout_rng=jax.random.key(0))
    if option == "bottom_right":  # with the window of "everything" it needs the reference
        kwargs.update(is_causal=True, causal_alignment="bottom_right")
    if option in ("segments", "everything"):
        kwargs.update(query_segment_ids=jnp.zeros((b, t), jnp.int32),
                      kv_segment_ids=jnp.zeros((b, s), jnp.int32))

    def grad_loss(q, kv, bias=None):
        extra = dict(kwargs, bias=bias) if bias is not None else kwargs
        out = jax_sdpa.dot_product_attention(q, kv, kv, implementation="cudnn", **extra)
        return out.astype(jnp.float32).sum()
    argnums = (0, 1, 2) if "bias" in kwargs else (0, 1)
    args = (q, kv, kwargs["bias"]) if "bias" in kwargs else (q, kv)
    # Segment ids beside a bias or mask take the dense path, which warns (a speed cliff).
    dense = (pytest.warns(RuntimeWarning, match="segment ids take the dense path")
             if option == "everything" else contextlib.nullcontext())
    with dense:
        text = jax.jit(jax.grad(grad_loss, argnums=argnums)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "cudnn$fmha" not in text
    backward = calls_to(text, BACKWARD)[0]
    assert ("bias_grad = true" in backward) == ("bias" in kwargs)
    # The forward and the backward get the same dropout probability (and seed operand).
    dropout = "dropout = 2.500000e-01" if "dropout_rate" in kwargs else "dropout = 0.0"
    assert dropout in backward
    forward = calls_to(text, FORWARD)[0]
    assert dropout in forward


def test_value_head_dim_lowers_with_its_own_output_shape(monkeypatch):
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    q = jnp.zeros((2, 64, 4, 192), jnp.bfloat16)
    k = jnp.zeros((2, 64, 4, 192), jnp.bfloat16)
    v = jnp.zeros((2, 64, 4, 128), jnp.bfloat16)
    fn = lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, implementation="cudnn")  # noqa
    out = jax.eval_shape(fn, q, k, v)
    assert out.shape == (2, 64, 4, 128)
    grads = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    assert {FORWARD, BACKWARD} <= custom_calls(grads, q, k, v)


def test_export_with_the_declared_custom_calls(monkeypatch):
    """jax.export for CUDA of a training step's attention: our targets are the only custom
    calls, declared through jax_sdpa.export_disabled_checks(); it serializes and reads back."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)

    def step(q, k, v):
        return jax.grad(lambda q: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True).astype(jnp.float32).sum())(q)
    with pytest.raises(ValueError, match="custom call"):  # undeclared: jax.export refuses
        jax.export.export(jax.jit(step), platforms=["cuda"])(q, q, q)
    exported = jax.export.export(jax.jit(step), platforms=["cuda"],
                                 disabled_checks=jax_sdpa.export_disabled_checks())(q, q, q)
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("cuda",)
    text = restored.mlir_module()
    assert calls_to(text, FORWARD) and calls_to(text, BACKWARD)
    assert "cudnn$fmha" not in text


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_with_cudnn_blocks_lowers_inside_shard_map(layout, monkeypatch):
    """Our custom calls inside shard_map type-check as per-device values (lax.switch branches,
    out_specs) and the ring's fwd+bwd lowers to them for CUDA."""
    from jax.sharding import Mesh, PartitionSpec as P  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax_sdpa import ring as ring_module  # noqa: PLC0415
    from jax_sdpa.ring import ring_attention  # noqa: PLC0415
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    monkeypatch.setattr(ring_module, "_mesh_platform", lambda x: "gpu")  # host devices here
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    ring = jax.shard_map(lambda q, k, v: ring_attention(
        q, k, v, axis_name="seq", is_causal=True, layout=layout, implementation="cudnn"),
        mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    x = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
    grad = jax.grad(lambda q, k, v: ring(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    monkeypatch.setenv("JAX_SDPA_COMMAND_BUFFERS", "1")  # the ring's blocks follow the variable
    plain, buffered = dense_twins()
    assert buffered <= custom_call_names(grad, x, x, x)
    assert not plain & custom_call_names(grad, x, x, x)


def test_command_buffer_targets_follow_the_variable(monkeypatch):
    """JAX_SDPA_COMMAND_BUFFERS=1 (read when a call is planned) lowers every call, small or
    large, to the command-buffer compatible twins of our targets; unset or =0 none; anything
    else is refused by name."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    small = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    large = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16)

    def grad():  # a new function each time: jit caches traces by function
        return jax.grad(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum(),
            argnums=(0, 1, 2))
    plain, buffered = dense_twins()
    for value, names in (("0", plain), ("1", buffered), ("", plain)):
        monkeypatch.setenv("JAX_SDPA_COMMAND_BUFFERS", value)
        for shape in (small, large):
            found = custom_call_names(grad(), shape, shape, shape)
            assert names <= found and not (plain | buffered) - names & found, (value, shape)
    monkeypatch.setenv("JAX_SDPA_COMMAND_BUFFERS", "yes")
    with pytest.raises(ValueError, match="JAX_SDPA_COMMAND_BUFFERS must be 0 or 1"):
        custom_calls(grad(), small, small, small)


def test_checked_packed_call_reads_its_grid_on_the_plain_targets(monkeypatch):
    """A checked packed call lowers to one ragged forward and one ragged backward, each with
    the device's grid as an int32 [3] operand (device_grid), on the plain targets even while
    every other call is recorded (its handler waits for the grid, which a command buffer cannot
    do). Self-attention without lengths sends the ids too, its handler running the exact
    fallback itself (no cond in the program); with lengths a cond chooses the fallback. The
    stated bound has no grid operand."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    monkeypatch.setenv("JAX_SDPA_COMMAND_BUFFERS", "1")
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 64)[None].repeat(2, axis=0)

    def lowered(**kwargs):
        grad = jax.grad(lambda q: jax_sdpa.dot_product_attention(
            q, q, q, is_causal=True, query_segment_ids=ids, implementation="cudnn",
            **kwargs).astype(jnp.float32).sum())
        return jax.jit(grad).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    lengths = jnp.array([256, 200], jnp.int32)
    for kwargs, in_handler in (({}, True), (dict(query_seq_lengths=lengths), False)):
        text = lowered(**kwargs)
        ragged = calls_to(text, FORWARD, "ragged") + calls_to(text, BACKWARD, "ragged")
        assert len(ragged) == 2
        for line in ragged:
            assert "device_grid = true" in line and "_cmdbuf" not in line
            assert re.search(r"tensor<3xi32>", line.split("->")[0])
            assert f"fallback_ids = {str(in_handler).lower()}" in line
            # the ids [2, 256] go in beside the [2, 256, 4, 64] operands
            assert bool(re.search(r"tensor<2x256xi32>", line.split("->")[0])) == in_handler
        assert ("stablehlo.case" in text or "stablehlo.if" in text) != in_handler, kwargs
    stated = lowered(max_segments=4, max_document_length=64)
    assert "device_grid = true" not in stated and "device_grid = false" in stated


@pytest.mark.parametrize("transform", ["plain", "vmap"])
def test_paged_attention_lowers_to_our_forward(transform, monkeypatch):
    """paged_attention's cuDNN path: our paged target with exactly the attributes its handler
    decodes; under vmap, one call per element."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    q = jnp.zeros((3, 2, 8, 64), jnp.bfloat16)
    cache = jnp.zeros((10, 16, 2, 64), jnp.bfloat16)
    table = jnp.zeros((3, 4), jnp.int32)
    lengths = jnp.full((3,), 40, jnp.int32)

    def attend(q, cache, table, lengths):
        return jax_sdpa.paged_attention(q, cache, cache, table, lengths, implementation="cudnn",
                                        local_window_size=8, sinks=jnp.zeros((8,)))
    args = (q, cache, table, lengths)
    if transform == "vmap":
        attend, args = jax.vmap(attend), tuple(x[None].repeat(2, 0) for x in args)
    text = jax.jit(attend).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "cudnn$fmha" not in text
    assert_decoded(text, FORWARD, "paged")


def planner_attributes(target, **changes):
    """A plain call's attributes as workspace_bytes takes them for a target (numbers, and
    strings, by name)."""
    declared = BY_NAME[target]
    kinds = {**graph_options(declared.handler), **dict(declared.attributes)}
    attributes = {name: "" if kinds[name] == "str" else 0.0
                  for name in cudnn_call.attribute_names(declared)}
    attributes.update(scale=0.125, window_left=-1.0, window_right=-1.0, **changes)
    return {name: value if isinstance(value, str) else float(value)
            for name, value in attributes.items()}


def test_workspace_planner_refuses_what_the_handlers_refuse():
    """The extension's workspace planner (what sizes a call's workspace result) checks the
    operands Python describes as each target's handler checks buffers, before any GPU is
    touched."""
    planner = extension.extension().workspace_bytes
    dense, backward = "jax_sdpa_dense_forward", "jax_sdpa_dense_backward"
    q = ("bfloat16", [2, 64, 4, 64])
    lengths = ("int32", [2])
    missing = planner_attributes(dense)
    del missing["scale"]
    with pytest.raises(RuntimeError, match="the attribute scale is missing"):
        planner(dense, 0, [q, q, q], missing)
    with pytest.raises(RuntimeError, match="no operand is of dtype float64"):
        planner(dense, 0, [("float64", [2, 64, 4, 64]), q, q], planner_attributes(dense))
    with pytest.raises(RuntimeError, match="do not form one attention problem"):
        planner(dense, 0, [q, ("bfloat16", [2, 64, 4, 32]), q], planner_attributes(dense))
    with pytest.raises(RuntimeError, match="expected 2 optional operands, got 0"):
        planner(dense, 0, [q, q, q], planner_attributes(dense, padding=True))
    with pytest.raises(RuntimeError, match="sequence lengths must be int32"):
        planner(dense, 0, [q, q, q, lengths, ("int32", [3])],
                planner_attributes(dense, padding=True))
    with pytest.raises(RuntimeError, match="expected at least 6 operands"):
        planner(backward, 0, [q, q, q], planner_attributes(backward))
    with pytest.raises(RuntimeError, match="no target is named jax_sdpa_paged_backward"):
        planner("jax_sdpa_paged_backward", 0, [q] * 6, planner_attributes(dense))
    with pytest.raises(RuntimeError, match="FP8 operands go to the FP8 targets"):
        e4m3 = ("float8_e4m3fn", [2, 64, 4, 64])
        planner(dense, 0, [e4m3] * 3, planner_attributes(dense))


def test_without_a_gpu_calls_lower_without_a_workspace_result(monkeypatch, fresh_traces):
    """Lowering for CUDA where no GPU can size the workspace (CI, jax.export on a CPU host):
    no uint8 result; the handlers then take scratch memory per call."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    monkeypatch.setattr(cudnn_call, "gpu_ordinal", lambda: None)
    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
    grad = jax.grad(lambda q: jax_sdpa.dot_product_attention(
        q, q, q, is_causal=True, implementation="cudnn").astype(jnp.float32).sum())
    text = jax.jit(grad).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @jax_sdpa" in line]
    assert len(calls) == 2 and all("workspace_result = false" in line for line in calls)
    assert not any("xui8>" in line for line in calls)


def _barrier_sides(text):
    """For each call of our targets in lowered StableHLO: (whether every operand comes out of an
    optimization barrier, whether every result goes into barriers only), per function (SSA
    names are the function's own)."""
    found = []
    for body in text.split("func.func")[1:]:
        defined = {}  # SSA name -> the op that defines it
        for line in body.splitlines():
            match = re.match(r"\s*(%[\w.]+)(?::\d+)? = (?:\"?)([\w.]+)", line)
            if match:
                defined[match.group(1)] = (match.group(2), line)
        for name, (op, line) in defined.items():
            if op != "stablehlo.custom_call" or "@jax_sdpa_" not in line:
                continue
            arguments = line[line.index("(") + 1:line.index(")")]
            operands = {token.split("#")[0] for token in re.findall(r"%[\w.#]+", arguments)}
            users = [other for _, other in defined.values()
                     if re.search(re.escape(name) + r"(#\d+)?\b", other) and other != line]
            users += [other for other in body.splitlines() if "return" in other and
                      re.search(re.escape(name) + r"(#\d+)?\b", other)]
            found.append((all(defined.get(x, ("",))[0] == "stablehlo.optimization_barrier"
                              for x in operands),
                          bool(users) and all("optimization_barrier" in u for u in users)))
    return found


@pytest.mark.parametrize("mode", ["forward", "grad"])
def test_our_calls_sit_between_optimization_barriers(mode, monkeypatch):
    """In a chain of mask pieces (slices of one call's output feeding the next call's pieces,
    each piece's result written into a buffer another call produced) every operand of our
    custom calls comes out of an optimization barrier and every result goes into one: XLA's
    GPU dynamic-slice fusion, which fails on such chains (docs/DEVELOPING.md, "Our calls kept
    apart from XLA's slices"), then finds no slice or update beside a call."""
    monkeypatch.setattr(jax_sdpa.limits.device, "device_reason", lambda: None)
    q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
    mask = jax_sdpa.masks.prefix_lm(64) | jax_sdpa.masks.sliding_window(0, 16)

    def chain(q):
        for _ in range(2):
            q = jax_sdpa.dot_product_attention(q, q, q, mask=mask, implementation="cudnn")
        return q.astype(jnp.float32).sum()
    fn = chain if mode == "forward" else jax.grad(chain)
    text = jax.jit(fn).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    sides = _barrier_sides(text)
    assert len(sides) >= (4 if mode == "forward" else 8)  # pieces of two calls
    assert all(operands and results for operands, results in sides), sides
