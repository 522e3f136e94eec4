"""Runs a score-modifier program (jax_sdpa/score_mod/program.py) in NumPy, with the meaning
ffi/graph/score_mod.cc gives each cuDNN pointwise mode, so that CPU tests check a program
against the function it was written from."""

import numpy as np

_UNARY = {"NEG": np.negative, "EXP": np.exp, "LOG": np.log, "TANH_FWD": np.tanh,
          "SIGMOID_FWD": lambda x: 1 / (1 + np.exp(-x)), "ABS": np.abs, "SQRT": np.sqrt,
          "RSQRT": lambda x: 1 / np.sqrt(x), "SIN": np.sin, "COS": np.cos, "TAN": np.tan,
          "FLOOR": np.floor, "CEIL": np.ceil, "IDENTITY": lambda x: x}
_BINARY = {"ADD": np.add, "SUB": np.subtract, "MUL": np.multiply, "DIV": np.divide,
           "MAX": np.maximum, "MIN": np.minimum, "POW": np.power, "CMP_EQ": np.equal,
           "CMP_NEQ": np.not_equal, "CMP_LT": np.less, "CMP_LE": np.less_equal,
           "CMP_GT": np.greater, "CMP_GE": np.greater_equal, "LOGICAL_AND": np.logical_and,
           "LOGICAL_OR": np.logical_or}
_COMPUTE = {"f": np.float32, "i": np.int32, "b": bool}  # an instruction's type letter


def run(program: str, score, tables, gradient=None):
    """score (and gradient) float32 [B, N, T, S]; tables float32 [B, P, N]."""
    batch, heads, q_len, kv_len = score.shape
    named = {"s": score, "g": gradient,
             "q": np.arange(q_len, dtype=np.int32)[:, None],
             "k": np.arange(kv_len, dtype=np.int32)[None, :]}
    values = []

    def value(token):
        if token.startswith("%"):
            return values[int(token[1:])]
        if token.startswith("t"):
            return np.asarray(tables)[:, int(token[1:]), :, None, None]
        if token.startswith("c"):
            return np.float32(float.fromhex(token[1:]))
        if token.startswith("n"):
            return np.int32(token[1:])
        return named[token]
    *items, result = program.split(";")
    with np.errstate(all="ignore"):
        for item in items:
            out_type, mode, *operands = item.split()
            args = [value(t) for t in operands]
            if mode == "BINARY_SELECT":
                out = np.where(args[2], args[0], args[1])
            elif mode == "ERF":
                from scipy.special import erf
                out = erf(args[0])
            elif mode in _UNARY:
                out = _UNARY[mode](np.asarray(args[0], _COMPUTE[out_type]))
            elif out_type == "b":  # comparisons and logic: on the operands' own types
                out = _BINARY[mode](*args)
            else:
                out = _BINARY[mode](*(np.asarray(a, _COMPUTE[out_type]) for a in args))
            values.append(np.asarray(out, _COMPUTE[out_type]))
    assert result.startswith("=")
    return np.broadcast_to(value(result[1:]), score.shape).astype(np.float32)
