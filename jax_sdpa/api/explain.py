"""jax_sdpa.explain: how dot_product_attention would run a call here, without running it: the
kernels its forward and its backward take (which of our cuDNN targets, or the XLA reference)
and why, in the words of the limits and warnings that decide it (jax_sdpa/call/planning.py)."""

from __future__ import annotations

import inspect
import warnings

import jax
import numpy as np

from jax_sdpa.api import attention
from jax_sdpa.call import planning
from jax_sdpa.limits import device
from jax_sdpa.pieces import plan as pieces_plan

# dot_product_attention's arguments that shape its result, not its plan
_RESULT_ONLY = ("return_residual", "residual_dtype")


def explain(*args, **kwargs) -> str:
    """dot_product_attention's arguments (arrays or jax.ShapeDtypeStruct: only shapes and
    dtypes are read) -> lines "forward: ...", "backward: ..." and a "note: ..." per warning the call
    would give; "refused: ..." where implementation="cudnn" cannot run it."""
    bound = inspect.signature(attention.dot_product_attention).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = {name: value for name, value in bound.arguments.items()
                 if name not in _RESULT_ONLY}
    # The arrays traced, as under jit: their shapes and dtypes plan the call, no value is read.
    arrays = {name: value for name, value in arguments.items()
              if isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))}
    plan = {}

    def trace(**traced):
        plan["call"], plan["spec"] = attention.planned(**dict(arguments, **traced))
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            jax.eval_shape(trace, **arrays)
        except NotImplementedError as refusal:
            return f"refused: {refusal}"
    call, spec = plan["call"], plan["spec"]
    lines = [f"forward: {_forward(call, spec)}", f"backward: {_backward(call, spec)}"]
    return "\n".join(lines + [f"note: {warning.message}" for warning in caught])


def _target(spec) -> str:
    if spec.fp8:
        return "our FP8 target"
    if spec.segments:
        return "our packed target (cuDNN's ragged layout)"
    return "our dense target"


def _pieces(pieces, backward, call) -> str:
    if not pieces:
        return ""
    share = pieces_plan.share(pieces, backward, call.query.shape[1], call.key.shape[1],
                              call.query.shape[2], call.key.shape[2])
    return (f", the mask cut into {len(pieces)} piece{'s' * (len(pieces) > 1)} "
            f"({share:.0%} of the dense work, their copies counted)")


def _forward(call, spec) -> str:
    if spec.implementation == "cudnn":
        text = f"cuDNN, {_target(spec)}{_pieces(spec.pieces, False, call)}"
        if spec.score_mod:
            program = call.score_mod_program
            text += (f", the score_mod as {program.instructions} pointwise nodes reading "
                     f"{program.table_count} per-head tables")
        return text
    path = "the FP8 reference path" if spec.fp8 else "the XLA reference path"
    reason = device.device_reason() or planning.call_reason(call)
    return f"{path}, because {reason}" if reason else f"{path} (implementation='xla')"


def _backward(call, spec) -> str:
    if spec.implementation != "cudnn":
        return "the same path's (JAX's autodiff of the reference)"
    if spec.backward_kernel == "xla":
        return f"the XLA reference path, because {planning.backward_reason(call)}"
    if spec.half_backward:
        return (f"cuDNN in {call.query.dtype.name}, our dense target, from the FP8 forward's "
                f"output and statistics, because {planning.half_backward_reason(call)}")
    return f"cuDNN, {_target(spec)}{_pieces(spec.backward_pieces, True, call)}"
