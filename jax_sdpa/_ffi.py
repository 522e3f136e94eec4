"""Loading the C++ extension, registering its XLA FFI targets, and the ffi_call wrappers."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

FORWARD_TARGET = "jax_sdpa_forward"
BACKWARD_TARGET = "jax_sdpa_backward"
# The same handlers, marked command-buffer compatible (XLA may record them into CUDA graphs):
# opt-in with JAX_SDPA_COMMAND_BUFFERS=1, read when a function is traced (docs/PERFORMANCE.md).
# Each call of an executable then owns its cuDNN workspace for the executable's life
# (ffi/call_state.h) instead of taking scratch memory from XLA per call.
COMMAND_BUFFER_SUFFIX = "_cmdbuf"


def command_buffers() -> bool:
    return os.environ.get("JAX_SDPA_COMMAND_BUFFERS", "") == "1"

# Test-only: when set, the handlers fill their outputs with NaN before cuDNN runs, so a test can
# prove every element was written. Read at trace time.
_poison_outputs = False


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
    spec = importlib.util.find_spec("nvidia.cudnn")
    for location in (spec.submodule_search_locations or []) if spec else []:
        for library in glob.glob(os.path.join(location, "lib", "libcudnn.so.9")):
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
            return


@functools.lru_cache(maxsize=None)
def _load():
    """(module, None) or (None, reason it could not be loaded)."""
    try:
        _preload_cudnn()
        from jax_sdpa import _sdpa_ffi  # noqa: PLC0415 - loaded lazily, after JAX's backend
    except (ImportError, OSError) as error:
        return None, f"the jax_sdpa C++ extension could not be loaded ({error})"
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

    return [export.DisabledSafetyCheck.custom_call(name + suffix)
            for name in (FORWARD_TARGET, BACKWARD_TARGET)
            for suffix in ("", COMMAND_BUFFER_SUFFIX)]


def cudnn_version() -> int:
    """cuDNN version of the libcudnn in this process, e.g. 91900 for 9.19.0."""
    return int(extension().cudnn_version())


def graph_cache_stats() -> dict:
    """The process-wide cuDNN graph cache's counters: entries (graphs cached), capacity, builds,
    hits (calls that found their graph, in their executable or the cache), evictions, retired
    (graphs let go whose queued GPU work may still be running)."""
    return dict(extension().graph_cache_stats())


@contextlib.contextmanager
def poison_outputs():
    """Test helper: functions traced inside this block NaN-fill outputs before cuDNN writes."""
    global _poison_outputs
    previous, _poison_outputs = _poison_outputs, True
    try:
        yield
    finally:
        _poison_outputs = previous


def _varying_like(results, operands):
    """Inside shard_map, marks our results as varying over every mesh axis an operand varies
    over (ffi_call leaves them unmarked), so they type-check like any other per-device value
    (lax.switch branches, out_specs)."""
    axes = set()
    for x in operands:
        axes |= _varying_axes(x)
    if not axes:
        return tuple(results)

    def cast(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # JAX < 0.9
    return tuple(cast(x) for x in results)


def _varying_axes(x) -> set:
    """The manual mesh axes x varies over (JAX >= 0.10 keeps them in aval.mat.varying, earlier
    releases in aval.vma)."""
    aval = jax.typeof(x)
    varying = getattr(getattr(aval, "mat", None), "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", ())
    return set(varying or ())


def _attributes(options, *, has_bias: bool, has_lengths: bool,
                dump_dropout_mask: bool = False) -> dict:
    return dict(scale=np.float32(options.scale), window_left=np.int64(options.window_left),
                window_right=np.int64(options.window_right),
                bottom_right=bool(options.bottom_right), has_bias=has_bias,
                has_lengths=has_lengths, bias_grad=bool(options.bias_grad),
                deterministic=bool(options.deterministic),
                dropout=np.float32(options.dropout), dump_dropout_mask=dump_dropout_mask,
                poison_outputs=bool(_poison_outputs), command_buffer=command_buffers())


def _target(name):
    return name + COMMAND_BUFFER_SUFFIX if command_buffers() else name


def _optional_operands(bias, q_lengths, kv_lengths, dropout_seed, options):
    operands = [] if bias is None else [bias]
    if q_lengths is not None:
        operands += [q_lengths, kv_lengths]
    if options.dropout > 0:
        if dropout_seed is None:
            raise ValueError("dropout > 0 needs a dropout seed")
        operands.append(dropout_seed)
    return operands


def sdpa_forward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed, options, *,
                 dump_dropout_mask=False):
    """cuDNN forward: (output [batch..., T, N, Hv], stats float32 [batch..., heads, q_seq]).

    bias: None or [1|B, 1|N, T, S] in the query's dtype; q_lengths/kv_lengths: None or int32
    [B] (both or neither); dropout_seed: uint32 [4] when options.dropout > 0; options: a
    CudnnOptions. dump_dropout_mask (tests): also return cuDNN's keep mask, float32
    [batch..., N, T, S] of 0 and 1.
    """
    _register_targets()
    *batch, q_seq_len, q_heads, _ = query.shape
    kv_seq_len = key.shape[-3]
    result_types = [
        jax.ShapeDtypeStruct((*batch, q_seq_len, q_heads, value.shape[-1]), query.dtype),
        jax.ShapeDtypeStruct((*batch, q_heads, q_seq_len), jnp.float32),
    ]
    dump = bool(dump_dropout_mask and options.dropout > 0)
    if dump:
        result_types.append(
            jax.ShapeDtypeStruct((*batch, q_heads, q_seq_len, kv_seq_len), jnp.float32))
    # broadcast_all: under vmap every operand gains the same leading axes, which the handler
    # folds into the batch.
    call = jax.ffi.ffi_call(_target(FORWARD_TARGET), tuple(result_types),
                            vmap_method="broadcast_all")
    operands = (query, key, value,
                *_optional_operands(bias, q_lengths, kv_lengths, dropout_seed, options))
    results = _varying_like(call(*operands, **_attributes(
        options, has_bias=bias is not None, has_lengths=q_lengths is not None,
        dump_dropout_mask=dump)), operands)
    return results if dump else results[:2]


def sdpa_backward(query, key, value, bias, q_lengths, kv_lengths, dropout_seed, output, stats,
                  d_output, options):
    """cuDNN backward: (dq, dk, dv, dbias); dbias is None unless options.bias_grad."""
    _register_targets()
    result_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (query, key, value)]
    with_dbias = bias is not None and options.bias_grad
    if with_dbias:
        result_types.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    call = jax.ffi.ffi_call(_target(BACKWARD_TARGET), tuple(result_types),
                            vmap_method="broadcast_all")
    operands = (query, key, value, output, stats, d_output.astype(output.dtype),
                *_optional_operands(bias, q_lengths, kv_lengths, dropout_seed, options))
    results = _varying_like(call(*operands, **_attributes(
        options, has_bias=bias is not None, has_lengths=q_lengths is not None)), operands)
    return (*results[:3], results[3] if with_dbias else None)
