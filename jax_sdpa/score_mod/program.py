"""A score modifier as cuDNN builds it: the user's `score_mod(score, batch, head, q_index,
kv_index)` traced once to a jaxpr and written as a pointwise program, and its derivative with
respect to the score (JAX's own vjp of the same function) as a second one.

Values that depend only on the batch and head (a closed-over per-head table indexed by head, a
slope times a constant) are computed here, in JAX, as *tables*: float32 [B, P, N], one column
of N heads per table and batch row, which cuDNN reads as [B, N, 1, 1] tensors. Everything that
depends on the score or the query and key positions becomes pointwise nodes. A program is text
that ffi/graph/score_mod.cc reads, one instruction per ';'-separated item:

    <type> <MODE> <operand>...     type f (float32) or b (bool); MODE a cuDNN PointwiseMode_t
    =<operand>                     the result (the last item)

Operands: s (the score; in the derivative, the forward's score), g (the derivative's incoming
gradient), q and k (the query's and key's position, cuDNN's GEN_INDEX), %n (the n-th
instruction's value), t<n> (table n), c<float> (a constant, float.hex). Integers are carried as
float32 (exact below 2^24, far beyond any position) and bools as cuDNN booleans.

cuDNN's pointwise nodes need one input that is a graph intermediate ("virtual"): constants and
tables are not, so an operation whose first operand is one gets it copied into the graph first
(added to a zero), or its operands swapped where the operation allows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

INDEX_BOUND = 1 << 24  # positions and integer values float32 carries exactly


class UnsupportedScoreMod(ValueError):
    """A score_mod cuDNN's score-modifier graph cannot express; the message names why."""


@dataclasses.dataclass(frozen=True)
class ScoreModProgram:
    """The forward's program, the derivative's, and the tables both read."""

    forward: str
    backward: str
    table_count: int
    # (batch, heads) -> float32 [batch, table_count, heads], computed in JAX (differentiable
    # in the closed-over arrays it reads)
    tables: Callable = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(eq=False)
class _Fold:
    """A value of the batch and head only: computed in JAX, then a table or a constant."""

    compute: Callable  # (env, batch, head) -> value; env memoizes one evaluation
    deps: frozenset
    dtype: np.dtype

    def value(self, env, batch, head):
        if self not in env:
            env[self] = self.compute(env, batch, head)
        return env[self]


@dataclasses.dataclass(frozen=True)
class _Node:
    """A value in cuDNN's graph: its operand token and JAX dtype (float32, int32 or bool)."""

    token: str
    dtype: np.dtype
    virtual: bool = True


_UNARY = {"neg": "NEG", "exp": "EXP", "log": "LOG", "tanh": "TANH_FWD",
          "logistic": "SIGMOID_FWD", "abs": "ABS", "sqrt": "SQRT", "rsqrt": "RSQRT",
          "sin": "SIN", "cos": "COS", "tan": "TAN", "floor": "FLOOR", "ceil": "CEIL",
          "erf": "ERF"}
_COMMUTATIVE = {"add": "ADD", "add_any": "ADD", "mul": "MUL", "max": "MAX", "min": "MIN"}
_COMPARISONS = {"eq": "CMP_EQ", "ne": "CMP_NEQ", "lt": "CMP_LT", "le": "CMP_LE",
                "gt": "CMP_GT", "ge": "CMP_GE"}
_MIRRORED = {"CMP_EQ": "CMP_EQ", "CMP_NEQ": "CMP_NEQ", "CMP_LT": "CMP_GT", "CMP_GT": "CMP_LT",
             "CMP_LE": "CMP_GE", "CMP_GE": "CMP_LE"}
_SHAPE_ONLY = {"broadcast_in_dim", "reshape", "squeeze", "copy", "copy_p", "expand_dims"}
_SUBJAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_BOOL, _INT, _FLOAT = np.dtype(bool), np.dtype(np.int32), np.dtype(np.float32)


def _kind(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype == _BOOL:
        return _BOOL
    if np.issubdtype(dtype, np.integer):
        return _INT
    if dtype == _FLOAT:
        return _FLOAT
    raise UnsupportedScoreMod(f"score_mod computes in {dtype}: on cuDNN it computes in "
                              f"float32, int32 and bool only")


def _constant_token(value) -> str:
    return "c" + float(value).hex()


_ZERO = _Node(_constant_token(0), _FLOAT, virtual=False)
_ONE = _Node(_constant_token(1), _FLOAT, virtual=False)


class _Writer:
    """Writes one program by evaluating a jaxpr over _Fold and _Node values."""

    def __init__(self, tables: list):
        self.items: list[str] = []
        self.tables = tables  # shared by the forward and the derivative
        self.zero = None

    # -- emitting -----------------------------------------------------------------------------
    def emit(self, out_type: str, mode: str, *operands: str) -> str:
        self.items.append(" ".join((out_type, mode, *operands)))
        return f"%{len(self.items) - 1}"

    def operand(self, x) -> _Node:
        """x as a node (a table or a constant where it is a _Fold)."""
        if isinstance(x, _Node):
            return x
        if not x.deps:
            with jax.ensure_compile_time_eval():
                value = x.value({}, None, None)
            if not isinstance(value, jax.core.Tracer):
                value = np.asarray(value)
                if value.shape != ():
                    raise UnsupportedScoreMod(
                        f"score_mod combines an array of shape {value.shape} with the score: "
                        f"index closed-over arrays by batch or head")
                if x.dtype == _BOOL:
                    return self.bool_constant(bool(value))
                return _Node(_constant_token(value), x.dtype, virtual=False)
        index = next((i for i, t in enumerate(self.tables) if t is x), None)
        if index is None:
            index = len(self.tables)
            self.tables.append(x)
        table = _Node(f"t{index}", x.dtype, virtual=False)
        if x.dtype == _BOOL:  # stored as 0.0 / 1.0
            return _Node(self.emit("b", "CMP_NEQ", self.virtual(table).token, _ZERO.token),
                         _BOOL)
        return table

    def bool_constant(self, value: bool) -> _Node:
        # q >= 0 always holds, q < 0 never: a virtual True or False.
        return _Node(self.emit("b", "CMP_GE" if value else "CMP_LT", "q", _ZERO.token), _BOOL)

    def virtual(self, node: _Node) -> _Node:
        """node as a graph intermediate: a constant or table added to a virtual zero."""
        if node.virtual:
            return node
        if self.zero is None:
            self.zero = self.emit("f", "MUL", "q", _ZERO.token)
        return _Node(self.emit("f", "ADD", self.zero, node.token), node.dtype)

    def float_of(self, node: _Node) -> _Node:
        if node.dtype == _BOOL:
            return _Node(self.emit("f", "IDENTITY", node.token), _FLOAT)
        return node

    def trunc(self, node: _Node) -> _Node:
        """Rounded toward zero (C's integer conversion and division)."""
        negative = self.emit("b", "CMP_LT", node.token, _ZERO.token)
        up = self.emit("f", "CEIL", node.token)
        down = self.emit("f", "FLOOR", node.token)
        return _Node(self.emit("f", "BINARY_SELECT", up, down, negative), node.dtype)

    def binary(self, mode: str, a: _Node, b: _Node, dtype, commutative=False) -> _Node:
        if not a.virtual:
            if commutative and b.virtual:
                a, b = b, a
            else:
                a = self.virtual(a)
        out_type = "b" if dtype == _BOOL else "f"
        return _Node(self.emit(out_type, mode, a.token, b.token), dtype)

    def unary(self, mode: str, a: _Node, dtype) -> _Node:
        a = self.virtual(a)
        return _Node(self.emit("b" if dtype == _BOOL else "f", mode, a.token), dtype)

    def sign(self, a: _Node) -> _Node:
        positive = self.float_of(self.binary("CMP_GT", a, _ZERO, _BOOL))
        negative = self.float_of(self.binary("CMP_LT", a, _ZERO, _BOOL))
        return _Node(self.emit("f", "SUB", positive.token, negative.token), a.dtype)

    # -- evaluating ---------------------------------------------------------------------------
    def run(self, jaxpr, consts, args):
        env = {}

        def read(var):
            if isinstance(var, jax_core.Literal):
                return _fold_constant(var.val)
            return env[var]
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = value
        for var, value in zip(jaxpr.invars, args):
            env[var] = value
        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            for var, value in zip(eqn.outvars, outs):
                env[var] = value
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins):
        name = eqn.primitive.name
        for aval in (v.aval for v in eqn.outvars):
            if getattr(aval, "shape", ()) and math.prod(aval.shape) != 1:
                if all(isinstance(x, _Fold) for x in ins):
                    break  # a table's own computation (e.g. slicing a per-head array)
                raise UnsupportedScoreMod(
                    f"score_mod is not elementwise: `{name}` makes shape {aval.shape}")
        if all(isinstance(x, _Fold) for x in ins):
            return _fold_equation(eqn, ins)
        sub = next((eqn.params[p] for p in _SUBJAXPR_PARAMS if p in eqn.params), None)
        if sub is not None:
            closed = sub if hasattr(sub, "consts") else None
            jaxpr = closed.jaxpr if closed is not None else sub
            consts = [_fold_constant(c) for c in (closed.consts if closed is not None else ())]
            return self.run(jaxpr, consts, ins)
        nodes = [self.operand(x) for x in ins]
        dtype = _kind(eqn.outvars[0].aval.dtype)
        return [self.elementwise(name, eqn, nodes, dtype)]

    def elementwise(self, name, eqn, x, dtype) -> _Node:
        if name in _SHAPE_ONLY:
            return x[0]
        if name in _COMMUTATIVE:
            if dtype == _BOOL:
                raise UnsupportedScoreMod(f"score_mod takes `{name}` of bools")
            return self.binary(_COMMUTATIVE[name], x[0], x[1], dtype, commutative=True)
        if name in ("and", "or"):
            if dtype != _BOOL:
                raise UnsupportedScoreMod(f"score_mod uses bitwise `{name}` on integers")
            return self.binary("LOGICAL_AND" if name == "and" else "LOGICAL_OR", x[0], x[1],
                               _BOOL, commutative=True)
        if name == "not":
            if dtype != _BOOL:
                raise UnsupportedScoreMod("score_mod uses bitwise `not` on integers")
            return self.unary("LOGICAL_NOT", x[0], _BOOL)
        if name in _COMPARISONS:
            mode = _COMPARISONS[name]
            a, b = x
            if not a.virtual:
                a, b, mode = b, a, _MIRRORED[mode]
            return _Node(self.emit("b", mode, a.token, b.token), _BOOL)
        if name == "sub":
            return self.binary("SUB", x[0], x[1], dtype)
        if name == "div":
            quotient = self.binary("DIV", x[0], x[1], dtype)
            return self.trunc(quotient) if dtype == _INT else quotient
        if name == "rem":
            quotient = self.trunc(self.binary("DIV", x[0], x[1], dtype))
            product = self.binary("MUL", quotient, x[1], dtype, commutative=True)
            return self.binary("SUB", x[0], product, dtype)
        if name == "pow":
            return self.binary("POW", x[0], x[1], dtype)
        if name == "integer_pow":
            y = eqn.params["y"]
            if y == 1:
                return x[0]
            if y in (2, 3):
                square = self.binary("MUL", x[0], x[0], dtype, commutative=True)
                return square if y == 2 else self.binary("MUL", square, x[0], dtype,
                                                         commutative=True)
            return self.binary("POW", x[0], _Node(_constant_token(y), _FLOAT, False), dtype)
        if name == "square":
            return self.binary("MUL", x[0], x[0], dtype, commutative=True)
        if name == "exp2":
            scaled = self.binary("MUL", x[0], _Node(_constant_token(math.log(2)), _FLOAT,
                                                    False), dtype, commutative=True)
            return self.unary("EXP", scaled, dtype)
        if name == "log1p":
            return self.unary("LOG", self.binary("ADD", x[0], _ONE, dtype, True), dtype)
        if name == "expm1":
            return self.binary("SUB", self.unary("EXP", x[0], dtype), _ONE, dtype)
        if name == "sign":
            return self.sign(x[0])
        if name == "one_minus_square":  # JAX 0.12's tanh derivative: 1 - x^2
            square = self.binary("MUL", x[0], x[0], dtype, commutative=True)
            return self.binary("ADD", self.unary("NEG", square, dtype), _ONE, dtype, True)
        if name in _UNARY:
            return self.unary(_UNARY[name], x[0], dtype)
        if name == "clamp":  # clamp(low, x, high)
            low = self.binary("MAX", x[1], x[0], dtype, commutative=True)
            return self.binary("MIN", low, x[2], dtype, commutative=True)
        if name == "select_n":
            return self.select(x, dtype)
        if name == "convert_element_type":
            return self.convert(x[0], dtype)
        raise UnsupportedScoreMod(f"score_mod uses `{name}`, which cuDNN's score-modifier "
                                  f"graphs cannot express")

    def select(self, x, dtype) -> _Node:
        predicate, *cases = x
        if len(cases) != 2:
            raise UnsupportedScoreMod("score_mod selects among more than two cases")
        if predicate.dtype != _BOOL:
            predicate = self.binary("CMP_NEQ", predicate, _ZERO, _BOOL)
        if_false, if_true = cases
        if not if_true.virtual and if_false.virtual:
            predicate = self.unary("LOGICAL_NOT", predicate, _BOOL)
            if_true, if_false = if_false, if_true
        if_true = self.virtual(if_true)
        out_type = "b" if dtype == _BOOL else "f"
        return _Node(self.emit(out_type, "BINARY_SELECT", if_true.token, if_false.token,
                               predicate.token), dtype)

    def convert(self, node: _Node, dtype) -> _Node:
        if dtype == node.dtype:
            return node
        if dtype == _BOOL:
            return self.binary("CMP_NEQ", node, _ZERO, _BOOL)
        if node.dtype == _BOOL:
            return dataclasses.replace(self.float_of(node), dtype=dtype)
        if dtype == _INT:  # from float32: toward zero
            return dataclasses.replace(self.trunc(self.virtual(node)), dtype=_INT)
        return dataclasses.replace(node, dtype=dtype)  # int32 to float32: the same float

    def result(self, value, masked_fill=None) -> list[str]:
        """The live instructions (those the result reads), renumbered, then the result; with
        masked_fill, a -inf result becomes that value (a mask's fill: the reference's rule)."""
        node = self.virtual(self.float_of(self.operand(value)))
        if masked_fill is not None and any("c-inf" in item.split() for item in self.items):
            finite = self.emit("b", "CMP_NEQ", node.token, "c-inf")
            node = _Node(self.emit("f", "BINARY_SELECT", node.token,
                                   _constant_token(masked_fill), finite), _FLOAT)
        live, pending = set(), [node.token]
        while pending:
            token = pending.pop()
            if token.startswith("%") and int(token[1:]) not in live:
                live.add(int(token[1:]))
                pending += self.items[int(token[1:])].split()[2:]
        numbers = {f"%{old}": f"%{new}" for new, old in enumerate(sorted(live))}
        kept = [" ".join(numbers.get(t, t) for t in self.items[i].split()) for i in sorted(live)]
        return [*kept, "=" + numbers.get(node.token, node.token)]


def _fold_constant(value) -> _Fold:
    dtype = _kind(np.result_type(value) if not hasattr(value, "dtype") else value.dtype)
    return _Fold(lambda env, batch, head: value, frozenset(), dtype)


def _fold_equation(eqn, ins):
    """An equation over batch-and-head values: folded into one _Fold per output."""
    deps = frozenset().union(*(x.deps for x in ins))

    sub = next((eqn.params[p] for p in _SUBJAXPR_PARAMS if p in eqn.params), None)

    def compute(env, batch, head):
        values = [x.value(env, batch, head) for x in ins]
        if sub is not None:  # the call's own jaxpr (custom rules are for differentiation)
            closed = sub if hasattr(sub, "consts") else jax_core.ClosedJaxpr(sub, ())
            return jax_core.jaxpr_as_fun(closed)(*values)
        return eqn.primitive.bind(*values, **eqn.params)
    whole = _Fold(compute, deps, _FLOAT)
    if eqn.primitive.multiple_results or sub is not None:
        return [_Fold(lambda env, b, h, i=i: whole.value(env, b, h)[i], deps,
                      _kind_or_float(v.aval.dtype)) for i, v in enumerate(eqn.outvars)]
    whole.dtype = _kind_or_float(eqn.outvars[0].aval.dtype)
    return [whole]


def _kind_or_float(dtype):
    try:
        return _kind(dtype)
    except UnsupportedScoreMod:
        return np.dtype(dtype)  # a table's intermediate in another float type: fine in JAX


def _inputs(derivative: bool):
    scalars = [_Node("s", _FLOAT),
               _Fold(lambda env, batch, head: batch, frozenset({"batch"}), _INT),
               _Fold(lambda env, batch, head: head, frozenset({"head"}), _INT),
               _Node("q", _INT), _Node("k", _INT)]
    return ([_Node("g", _FLOAT)] if derivative else []) + scalars


def _trace(fn, derivative: bool):
    score, index = jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
    if derivative:
        def traced(gradient, s, batch, head, q_index, kv_index):
            _, pullback = jax.vjp(lambda x: jnp.asarray(fn(x, batch, head, q_index, kv_index),
                                                        jnp.float32), s)
            return pullback(gradient)[0]
        args = (score, score, index, index, index, index)
    else:
        def traced(s, batch, head, q_index, kv_index):
            return jnp.asarray(fn(s, batch, head, q_index, kv_index))
        args = (score, index, index, index, index)
    try:
        closed = jax.make_jaxpr(traced)(*args)
    except UnsupportedScoreMod:
        raise
    except Exception as error:  # what JAX raised tracing the user's function
        raise UnsupportedScoreMod(f"score_mod could not be traced at scalar arguments (it "
                                  f"must be elementwise): {type(error).__name__}: {error}")
    out = closed.jaxpr.outvars[0].aval
    if out.shape != ():
        raise UnsupportedScoreMod(f"score_mod is not elementwise: a scalar score gives shape "
                                  f"{out.shape}")
    return closed


def translate(fn, masked_fill=None) -> ScoreModProgram:
    """fn's forward and derivative programs and their tables; UnsupportedScoreMod naming what
    cuDNN cannot express. masked_fill: what a -inf score of the forward becomes (the masks'
    fill, so that rows fn empties follow the masks' rule); None keeps -inf."""
    tables: list[_Fold] = []
    programs = []
    for derivative in (False, True):
        closed = _trace(fn, derivative)
        writer = _Writer(tables)
        consts = [_fold_constant(c) for c in closed.consts]
        (out,) = writer.run(closed.jaxpr, consts, _inputs(derivative))
        programs.append(writer.result(out, None if derivative else masked_fill))
    # The tables the live instructions read, renumbered in order of first use.
    used = [token for items in programs for item in items for token in item.split()
            if token.startswith("t")]
    order = list(dict.fromkeys(used))
    frozen = tuple(tables[int(token[1:])] for token in order)
    renumber = {token: f"t{i}" for i, token in enumerate(order)}
    programs = [";".join(" ".join(renumber.get(t, t) for t in item.split()) for item in items)
                for items in programs]

    def table_values(batch: int, heads: int):
        def row(b, h):
            env = {}
            return jnp.stack([jnp.asarray(t.value(env, b, h)).astype(jnp.float32)
                              for t in frozen]) if frozen else jnp.zeros((0,), jnp.float32)
        values = jax.vmap(jax.vmap(row, (None, 0)), (0, None))(
            jnp.arange(batch, dtype=jnp.int32), jnp.arange(heads, dtype=jnp.int32))
        return jnp.transpose(values, (0, 2, 1))  # [B, P, N]
    return ScoreModProgram(programs[0], programs[1], len(frozen), table_values)
