"""The attention functions under test, each as f(q, k, v, causal) -> output, [B, S, N, H]."""

import contextlib
import os

import jax

import jax_sdpa


@contextlib.contextmanager
def _command_buffers(value):
    """Traces inside use jax_sdpa's command-buffer targets for every call ("1") or none ("0");
    outside, the variable as it was."""
    previous = os.environ.get("JAX_SDPA_COMMAND_BUFFERS")
    os.environ["JAX_SDPA_COMMAND_BUFFERS"] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ["JAX_SDPA_COMMAND_BUFFERS"]
        else:
            os.environ["JAX_SDPA_COMMAND_BUFFERS"] = previous


def _jax_nn(implementation):
    def attention(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                            implementation=implementation)
    return attention


def _jax_sdpa(q, k, v, causal):
    return jax_sdpa.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _jax_sdpa_fp8(q, k, v, causal):
    return jax_sdpa.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn",
                                          fp8=True)


def in_command_buffer_mode(attention, value):
    """attention, its calls traced under _command_buffers(value)."""
    def traced(*args):
        with _command_buffers(value):
            return attention(*args)
    return traced


def available(config, command_buffers=False):
    """{name: function} of the implementations that can run `config` here."""
    found = {"jax_sdpa": _jax_sdpa, "jax.nn cudnn": _jax_nn("cudnn")}
    if command_buffers:  # both forced modes (the default is plain)
        found["jax_sdpa cmdbuf"] = in_command_buffer_mode(_jax_sdpa, "1")
        found["jax_sdpa plain"] = in_command_buffer_mode(_jax_sdpa, "0")
    try:
        from flash_attn3_jax import flash_mha  # noqa: PLC0415 - optional peer
    except ImportError:
        flash_mha = None
    if flash_mha is not None and config.head_dim == 128:
        found["flash-attn3-jax"] = lambda q, k, v, causal: flash_mha(q, k, v, is_causal=causal)
    if config.head_dim % 16 == 0:  # cuDNN's FP8 forward (the backward in bf16 off d128)
        found["jax_sdpa fp8"] = _jax_sdpa_fp8
    if config.run_xla:
        found["jax.nn xla"] = _jax_nn("xla")
    return found
