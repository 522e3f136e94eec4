"""The one place a call's description becomes an FFI call of one of our targets
(jax_sdpa/cudnn/targets.py): its operands in the target's declared order, its attributes (the
CallSpec's graph options, then the target's own) typed as the handler decodes them, the
command-buffer twin where XLA may record it, and the cuDNN workspace as one more result that
XLA allocates."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdpa.call.spec import graph_options
from jax_sdpa.common.varying import varying_like
from jax_sdpa.cudnn import extension
from jax_sdpa.cudnn.targets import Target

_TYPES = {"bool": bool, "int": np.int64, "float": np.float32, "str": str}


def attribute_names(target: Target) -> tuple[str, ...]:
    """Every attribute the target's handler decodes, in its order: the graph options it takes,
    then its own."""
    return (*graph_options(target.handler), *(name for name, _ in target.attributes))


def _typed_attributes(target: Target, spec, own: dict) -> dict:
    options = graph_options(target.handler)
    kinds = {**options, **dict(target.attributes)}
    values = {**{name: getattr(spec, name) for name in options}, **own}
    if set(values) != set(kinds):
        raise ValueError(f"{target.name} takes the attributes {sorted(kinds)}, got "
                         f"{sorted(values)}")
    return {name: _TYPES[kinds[name]](value) for name, value in values.items()}


def _ordered_operands(target: Target, operands: dict, attributes: dict) -> list:
    ordered = [operands[name] for name in target.operands]
    for names, presence in target.optional:
        if attributes[presence]:
            ordered += [operands[name] for name in names]
    return ordered


def gpu_ordinal() -> int | None:
    """CUDA ordinal of this process's first GPU; None without one (lowering for CUDA on a
    CPU-only host, jax.export)."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:
        return None
    return devices[0].local_hardware_id if devices else None


@functools.lru_cache(maxsize=4096)
def planned_workspace_bytes(handler, device, operands, attributes) -> int:
    try:
        planner = extension.extension().workspace_bytes
        return int(planner(handler, device, list(operands), dict(attributes)))
    except RuntimeError:
        # The graph does not build (cuDNN refuses the config): the call itself reports that,
        # with cuDNN's message, when it runs, as it does for a call planned without a GPU.
        return 0


def ffi_call(target: Target, spec, operands: dict, own_attributes: dict, result_types, *,
             vmap_method="broadcast_all", plan_workspace=True):
    """Our FFI call of `target`: operands by name (the optional ones its attributes leave out
    may be absent), own_attributes the target's own but command_buffer and workspace_result,
    which this adds (the spec says the first). With a GPU, its cuDNN workspace is sized while
    tracing, from the call's graph (built here on this process's first GPU and cached for the
    call), and becomes one more result, a uint8 buffer XLA allocates: XLA reuses that memory
    like any temporary, and orders it like any buffer inside a command buffer (CUDA graph), so
    no call holds memory of its own. Without a GPU, a graph that needs none, or
    plan_workspace=False (calls that seldom run: no graph built while tracing), the handler
    takes scratch memory. vmap_method="broadcast_all": under vmap every operand gains the same
    leading axes, which the handler folds into the batch. Returns the call's results."""
    extension.register_ffi_targets()
    own = dict(own_attributes, command_buffer=spec.command_buffer, workspace_result=False)
    attributes = _typed_attributes(target, spec, own)
    ordered = _ordered_operands(target, operands, attributes)
    device = gpu_ordinal()
    workspace = 0
    if device is not None and plan_workspace:
        described = tuple((jnp.dtype(x.dtype).name, tuple(int(d) for d in x.shape))
                          for x in ordered)
        values = tuple(sorted((name, value if isinstance(value, str) else float(value))
                              for name, value in attributes.items()))
        # By its handler: a target may be registered under another name (tests' poisoned twins).
        workspace = planned_workspace_bytes(target.handler, device, described, values)
    result_types = tuple(result_types)
    if workspace > 0:
        attributes["workspace_result"] = True
        result_types = (*result_types, jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    name = target.command_buffer_name if spec.command_buffer else target.name
    call = jax.ffi.ffi_call(name, result_types, vmap_method=vmap_method)
    results = _apart(call(*_apart(ordered), **attributes))
    return varying_like(results[:len(results) - (workspace > 0)], ordered)


def _apart(values):
    """values behind an optimization barrier: XLA's GPU dynamic-slice fusion folds a slice that
    feeds a custom call, and a dynamic_update_slice of its result, into the call's addresses,
    and where a program chains several such calls (pieces of a mask, a model's layers) it builds
    a cycle or a fusion whose update target is another call's result, an XLA internal error
    (docs/DEVELOPING.md, "Our calls kept apart from XLA's slices"). The barrier keeps slices
    and updates as XLA's own ops; XLA removes it after scheduling."""
    return list(jax.lax.optimization_barrier(tuple(values)))


def tails(inputs):
    """int32 [B, 2]: each row's query and key tokens cuDNN writes, the handler zero-filling
    past them: the lengths, or 0 where the other side has none."""
    q_lengths, kv_lengths = inputs["q_lengths"], inputs["kv_lengths"]
    return jnp.stack([jnp.where(kv_lengths > 0, q_lengths, 0),
                      jnp.where(q_lengths > 0, kv_lengths, 0)], axis=-1).astype(jnp.int32)


def zero_fill_attributes(fill: str) -> dict:
    """zero_outputs and zero_tails of a CallSpec.zero_fill answer."""
    return dict(zero_outputs=fill == "all", zero_tails=fill == "tails")


def segment_ids(inputs) -> dict:
    """The queries' and keys' int32 ids (the keys' the queries' where they share them)."""
    q_ids = inputs["q_segment_ids"].astype(jnp.int32)
    return dict(q_segment_ids=q_ids,
                kv_segment_ids=inputs.get("kv_segment_ids", q_ids).astype(jnp.int32))


def output_type(query, value):
    """[batch..., T, N, Hv] in the query's dtype."""
    return jax.ShapeDtypeStruct((*query.shape[:-1], value.shape[-1]), query.dtype)


def stats_type(query, token_major=False):
    """float32 [batch..., N, T], or [batch..., T, N] token-major."""
    *batch, q_seq_len, q_heads, _ = query.shape
    shape = (*batch, q_seq_len, q_heads) if token_major else (*batch, q_heads, q_seq_len)
    return jax.ShapeDtypeStruct(shape, jnp.float32)
