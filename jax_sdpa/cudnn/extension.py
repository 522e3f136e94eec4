"""The C++ extension: loading it (after cuDNN), registering its XLA FFI targets, and what it
reports (cuDNN's version, the graph cache's counters, the target names)."""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os

import jax

from jax_sdpa.cudnn.targets import TARGETS

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


def target_names() -> list:
    """Every FFI target's name, and its command-buffer twin's (jax_sdpa/cudnn/targets.py)."""
    return [name for target in TARGETS for name in (target.name, target.command_buffer_name)]


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

    return [export.DisabledSafetyCheck.custom_call(name) for name in target_names()]


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
