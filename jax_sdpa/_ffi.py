"""Loading the C++ extension, registering its XLA FFI targets, and the ffi_call wrappers."""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os

import jax
import jax.numpy as jnp



COMMAND_BUFFERS_VARIABLE = "JAX_SDPA_COMMAND_BUFFERS"
# By default a call is recorded into XLA's command buffers (CUDA graphs) when its work is at
# most this many FLOPs (2 * query rows * keys * (H + Hv), masks ignored): ~0.1 ms of kernel time
# or less on an H200, where launching and dispatching are a visible share of a call. Above it
# recording gained nothing measurable (benchmarks.attention, benchmarks.plans), so larger calls
# keep the plain targets.
# Either way the workspace is XLA's (_call_with_workspace), so a recorded call holds no memory.
COMMAND_BUFFER_MAX_FLOPS = 2 ** 36


def command_buffers() -> bool | None:
    """Whether our calls use the FFI targets XLA may record into its command buffers:
    JAX_SDPA_COMMAND_BUFFERS=1 all of them, =0 none, unset None (each call by its work,
    COMMAND_BUFFER_MAX_FLOPS); read when a call is traced."""
    text = os.environ.get(COMMAND_BUFFERS_VARIABLE, "")
    if text not in ("", "0", "1"):
        raise ValueError(f"{COMMAND_BUFFERS_VARIABLE} must be 0 or 1, got {text!r}")
    return None if not text else text == "1"


def call_flops(query, keys: int, head_dim_v: int) -> float:
    """A call's work as if dense: 2 * query rows * keys * (H + Hv) (Q K^T and P V)."""
    rows = 1
    for size in query.shape[:-1]:
        rows *= int(size)
    return 2.0 * rows * keys * (int(query.shape[-1]) + head_dim_v)


def records_into_command_buffers(config, flops: float) -> bool:
    """The mode a call with this config and work runs in (command_buffers())."""
    if config.command_buffer is not None:
        return config.command_buffer
    return flops <= COMMAND_BUFFER_MAX_FLOPS


GRAPH_CACHE_SIZE_VARIABLE = "JAX_SDPA_GRAPH_CACHE_SIZE"


def _check_graph_cache_size() -> None:
    text = os.environ.get(GRAPH_CACHE_SIZE_VARIABLE, "")
    if text and not (text.isdigit() and int(text) >= 1):
        raise ValueError(f"{GRAPH_CACHE_SIZE_VARIABLE} must be a whole number >= 1 (graphs the "
                         f"cache keeps), got {text!r}")


def _preload_cudnn() -> None:
    """Load the nvidia-cudnn wheel's libcudnn.so.9 unless the process already has a libcudnn.

    jaxlib's CUDA plugin loads the same file; whichever comes first, one copy serves both, so
    our graphs and JAX's use the same cuDNN.
    """
    try:
        with open("/proc/self/maps") as maps:
            if "libcudnn.so.9" in maps.read():
                return
    except OSError:
        pass
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except ModuleNotFoundError:  # no nvidia wheels at all: the extension's load says so
        return
    for location in (spec.submodule_search_locations or []) if spec else []:
        for library in glob.glob(os.path.join(location, "lib", "libcudnn.so.9")):
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
            return


@functools.lru_cache(maxsize=None)
def _load():
    """(module, None) or (None, reason it could not be loaded)."""
    _check_graph_cache_size()
    try:
        _preload_cudnn()
        from jax_sdpa import _sdpa_ffi  # noqa: PLC0415 - loaded lazily, after JAX's backend
    except (ImportError, OSError) as error:
        return None, (f"the jax_sdpa C++ extension could not be loaded ({error}); cuDNN comes "
                      "with pip install 'jax_sdpa[cuda13]' (or [cuda12])")
    return _sdpa_ffi, None


def extension():
    """The loaded extension module; raises ImportError naming the cause if it cannot load."""
    module, reason = _load()
    if module is None:
        raise ImportError(reason)
    return module


def extension_load_error() -> str | None:
    return _load()[1]


CALL_STATE_TYPE = "jax_sdpa_call_state"


def target_names() -> dict:
    """Our FFI targets by role (forward, backward, and their command-buffer twins), as the
    extension registers them."""
    return dict(extension().target_names())


@functools.lru_cache(maxsize=None)
def _register_targets() -> None:
    # Each target has an instantiate stage creating a per-call state (ffi/call_state.h) that
    # holds the call's cuDNN graphs as long as the executable lives; its type comes first.
    jax.ffi.register_ffi_type(CALL_STATE_TYPE, extension().call_state_type(), platform="CUDA")
    for name, stages in extension().registrations().items():
        jax.ffi.register_ffi_target(name, stages, platform="CUDA")


def register_ffi_targets() -> None:
    """Registers our FFI targets with XLA (done on first use; call it before running a
    deserialized jax.export module in a process that has not traced our attention)."""
    _register_targets()


def export_disabled_checks() -> list:
    """jax.export's `disabled_checks` for functions that use our cuDNN custom calls:
    jax.export.export(jax.jit(f), disabled_checks=jax_sdpa.export_disabled_checks())."""
    from jax import export  # noqa: PLC0415

    return [export.DisabledSafetyCheck.custom_call(name) for name in target_names().values()]


def cudnn_version() -> int | None:
    """cuDNN version of the libcudnn in this process, e.g. 91900 for 9.19.0; None where the
    extension cannot load (no cuDNN installed: pip install "jax_sdpa[cuda13]")."""
    if extension_load_error() is not None:
        return None
    return int(extension().cudnn_version())


def graph_cache_stats() -> dict:
    """The process-wide cuDNN graph cache's counters: entries (graphs cached), capacity, builds,
    hits (calls that found their graph, in their executable or the cache), evictions, retired
    (graphs let go whose queued GPU work may still be running), and with a graph files
    directory (JAX_SDPA_GRAPH_CACHE_DIR) disk_loads, disk_writes, disk_rejects (files that
    could not be used, writes that failed). Empty where the extension cannot load."""
    if extension_load_error() is not None:
        return {}
    return dict(extension().graph_cache_stats())


def _varying_like(results, operands):
    """Inside shard_map, marks our results as varying over every mesh axis an operand varies
    over (ffi_call leaves them unmarked), so they type-check like any other per-device value
    (lax.switch branches, out_specs)."""
    axes = set()
    for x in operands:
        axes |= varying_axes(x)
    if not axes:
        return tuple(results)

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # JAX < 0.9
    return tuple(cast(x) for x in results)


def varying_axes(x) -> set:
    """The manual mesh axes x varies over (JAX >= 0.10 keeps them in aval.mat.varying, earlier
    releases in aval.vma)."""
    aval = jax.typeof(x)
    varying = getattr(getattr(aval, "mat", None), "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", ())
    return set(varying or ())


def _optional_operands(inputs, ragged_operands, config, poison_rows):
    """The FFI's optional operands, in its order: [bias], [q_lengths, kv_lengths] (per document
    when ragged), [offsets], [dropout_seed], [poison_rows]."""
    operands = [inputs["bias"]] if config.has_bias else []
    if ragged_operands is not None:
        operands += list(ragged_operands)
    elif config.has_lengths:
        operands += [inputs["q_lengths"], inputs["kv_lengths"]]
    if config.has_seed:
        operands.append(inputs["dropout_seed"])
    if poison_rows is not None:
        operands.append(poison_rows.astype(jnp.int32))
    return operands


def _gpu_ordinal() -> int | None:
    """CUDA ordinal of this process's first GPU; None without one (lowering for CUDA on a
    CPU-only host, jax.export)."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:
        return None
    return devices[0].local_hardware_id if devices else None


@functools.lru_cache(maxsize=4096)
def _planned_workspace_bytes(backward, device, operands, attributes) -> int:
    try:
        return int(extension().workspace_bytes(backward, device, list(operands),
                                               dict(attributes)))
    except RuntimeError:
        # The graph does not build (cuDNN refuses the config): the call itself reports that,
        # with cuDNN's message, when it runs, as it does for a call planned without a GPU.
        return 0


def _call_with_workspace(role, config, result_types, operands, attributes, vmap_method,
                         keys):
    """ffi_call of our target with the call's cuDNN workspace as one more result, a uint8 buffer
    XLA allocates: XLA reuses that memory like any temporary, and orders it like any buffer
    inside a command buffer (CUDA graph), so no call holds memory of its own. Its size comes
    from the call's graph, built here (on this process's first GPU) and cached for the call;
    without a GPU, or a graph that needs none, the handler takes scratch memory per call
    instead. keys: each query row's keys (for the call's work). Returns the call's other
    results."""
    query, value = operands[0], operands[2]
    buffered = records_into_command_buffers(config, call_flops(query, keys, value.shape[-1]))
    attributes = dict(attributes, command_buffer=buffered, workspace_result=False)
    device = _gpu_ordinal()
    workspace = 0
    if device is not None:
        described = tuple((jnp.dtype(x.dtype).name, tuple(int(d) for d in x.shape))
                          for x in operands)
        values = tuple(sorted((name, float(value)) for name, value in attributes.items()))
        workspace = _planned_workspace_bytes(role == "backward", device, described, values)
    if workspace > 0:
        attributes["workspace_result"] = True
        result_types = (*result_types, jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    target = target_names()[role + ("_command_buffer" if buffered else "")]
    call = jax.ffi.ffi_call(target, tuple(result_types), vmap_method=vmap_method)
    results = call(*operands, **attributes)
    return _varying_like(results[:len(results) - (workspace > 0)], operands)


def sdpa_forward(inputs, config, ragged_operands=None, max_document=(0, 0), poison_rows=None):
    """cuDNN forward: (output [batch..., T, N, Hv], stats float32 [batch..., N, T], or
    [batch..., T, N] token-major when ragged).

    inputs: the config's inputs by name (kernel_config.INPUTS); query, key, value in the
    [batch..., seq, heads, head_dim] layout. ragged_operands: None, or (q_lengths, kv_lengths
    per document, offsets) from jax_sdpa.packing.ragged_operands; max_document: (queries, keys)
    no document is longer than (0: the rows' lengths); poison_rows: None, or bool [batch...]:
    rows whose first output token comes back NaN.
    """
    _register_targets()
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    *batch, q_seq_len, q_heads, _ = query.shape
    stats_shape = ((*batch, q_seq_len, q_heads) if ragged_operands is not None
                   else (*batch, q_heads, q_seq_len))
    result_types = (
        jax.ShapeDtypeStruct((*batch, q_seq_len, q_heads, value.shape[-1]), query.dtype),
        jax.ShapeDtypeStruct(stats_shape, jnp.float32),
    )
    operands = (query, key, value,
                *_optional_operands(inputs, ragged_operands, config, poison_rows))
    attributes = config.ffi_attributes(ragged=ragged_operands is not None,
                                       max_document=max_document,
                                       poison_rows=poison_rows is not None)
    # broadcast_all: under vmap every operand gains the same leading axes, which the handler
    # folds into the batch.
    return _call_with_workspace("forward", config, result_types, operands, attributes,
                                "broadcast_all", key.shape[-3])


def sdpa_backward(inputs, output, stats, d_output, config, ragged_operands=None,
                  max_document=(0, 0), poison_rows=None):
    """cuDNN backward: (dq, dk, dv, dbias or None); dbias only for a user's bias. poison_rows:
    as sdpa_forward's, for dq, dk and dv."""
    _register_targets()
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    result_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (query, key, value)]
    with_dbias = config.has_bias and config.bias_grad
    if with_dbias:
        result_types.append(jax.ShapeDtypeStruct(inputs["bias"].shape, inputs["bias"].dtype))
    operands = (query, key, value, output, stats, d_output.astype(output.dtype),
                *_optional_operands(inputs, ragged_operands, config, poison_rows))
    attributes = config.ffi_attributes(ragged=ragged_operands is not None,
                                       max_document=max_document,
                                       poison_rows=poison_rows is not None)
    results = _call_with_workspace("backward", config, result_types, operands, attributes,
                                   "broadcast_all", key.shape[-3])
    return (*results[:3], results[3] if with_dbias else None)


def sdpa_paged_forward(query, key_cache, value_cache, q_lengths, kv_lengths, page_table, config):
    """cuDNN forward over a paged K/V cache: (output [B, T, N, Hv], stats float32 [B, N, T]).

    key_cache [P, page_size, K, H], value_cache [P, page_size, K, Hv]: the page pools;
    page_table int32 [B, max_pages]; q_lengths and kv_lengths int32 [B] (cuDNN's padding
    mask: the band is measured from each sequence's actual lengths)."""
    _register_targets()
    batch, q_seq_len, q_heads, _ = query.shape
    result_types = (
        jax.ShapeDtypeStruct((batch, q_seq_len, q_heads, value_cache.shape[-1]), query.dtype),
        jax.ShapeDtypeStruct((batch, q_heads, q_seq_len), jnp.float32),
    )
    operands = (query, key_cache, value_cache, q_lengths, kv_lengths, page_table)
    # The handler takes one problem: under vmap, one call per element.
    return _call_with_workspace("forward", config, result_types, operands,
                                config.ffi_attributes(paged=True), "sequential",
                                page_table.shape[-1] * key_cache.shape[1])
