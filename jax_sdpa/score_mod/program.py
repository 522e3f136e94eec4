"""A score modifier as cuDNN builds it: the user's `score_mod(score, batch, head, q_index,
kv_index)` traced once to a jaxpr and written as a pointwise program, and its derivative with
respect to the score (JAX's own vjp of the same function) as a second one.

Values that depend only on the batch and head (a closed-over per-head table indexed by head, a
slope times a constant) are computed here, in JAX, as *tables*: float32 [B, P, N], one column
of N heads per table and batch row, which cuDNN reads as [1, N, 1, 1] tensors (its kernels
read a modifier's tensor wrongly where it varies by batch: such tables stay off cuDNN).
Everything that depends on the score or the query and key positions becomes pointwise nodes. A
program is text that ffi/graph/score_mod.cc reads, one instruction per ';'-separated item:

    <type> <MODE> <operand>...     type f (float32), i (int32) or b (bool): what it computes
                                   in and gives; MODE a cuDNN PointwiseMode_t
    =<operand>                     the result (the last item)

Operands: s (the score; in the derivative, the forward's score), g (the derivative's incoming
gradient), q and k (the query's and key's int32 position, cuDNN's GEN_INDEX), %n (the n-th
instruction's value), t<n> (table n, float32), c<float> (a float32 constant, float.hex), n<int>
(an int32 constant). Types follow the jaxpr's, as XLA's own score-modifier lowering does: cuDNN
generates positions only as int32 and computes on them in int32; IDENTITY converts. Its kernels
compare int32 values only: a comparison of float32 values is refused (UnsupportedScoreMod).

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
    # whether some table differs between batch rows (cuDNN reads one row for every batch:
    # ffi/graph/score_mod.h)
    by_batch: bool
    # (batch, heads) -> float32 [batch, table_count, heads], computed in JAX (differentiable
    # in the closed-over arrays it reads)
    tables: Callable = dataclasses.field(compare=False, repr=False)

    @property
    def instructions(self) -> int:
        """The pointwise nodes cuDNN's backward graph holds for the modifier, the most any graph
        of the call holds: the forward's program, the derivative's, and the int32 conversion
        ffi/graph/score_mod.cc puts before each boolean operand of LOGICAL_AND / LOGICAL_OR."""
        return sum(graph_nodes(program) for program in (self.forward, self.backward))


def passes_the_gradient_on(derivative: str) -> bool:
    """Whether a derivative program only passes the incoming gradient g on: as it is (a score
    plus a term), masked (selected against 0), or sums of those (a select's two cases)."""
    items = [item.split() for item in derivative.split(";")]
    carried = {"g"}  # g, masked
    for index, (_, mode, *operands) in enumerate(items[:-1]):
        if not carried.intersection(operands):
            continue  # a predicate's computation
        first, rest = operands[0], operands[1:]
        masked = (mode == "BINARY_SELECT" and first in carried and rest[0] == _ZERO.token and
                  rest[1] not in carried)
        summed = mode == "ADD" and all(operand in carried for operand in operands)
        if not (masked or summed):
            return False
        carried.add(f"%{index}")
    return items[-1][0][1:] in carried


def graph_nodes(program: str) -> int:
    """The pointwise nodes one program becomes in cuDNN's graph (its instructions and the
    conversions of logical operations' boolean operands)."""
    items = [item.split() for item in program.split(";")[:-1]]
    converted = sum(1 for item in items if item[1] in ("LOGICAL_AND", "LOGICAL_OR")
                    for operand in item[2:]
                    if operand.startswith("%") and items[int(operand[1:])][0] == "b")
    return len(items) + converted


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
_OPPOSITE = {"CMP_EQ": "CMP_NEQ", "CMP_NEQ": "CMP_EQ", "CMP_LT": "CMP_GE", "CMP_GE": "CMP_LT",
             "CMP_LE": "CMP_GT", "CMP_GT": "CMP_LE"}
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


def _constant_token(value, dtype=_FLOAT) -> str:
    return f"n{int(value)}" if dtype == _INT else "c" + float(value).hex()


def _type(dtype) -> str:
    """An instruction's type letter for a JAX dtype."""
    return {_BOOL: "b", _INT: "i"}.get(np.dtype(dtype), "f")


_ZERO = _Node(_constant_token(0), _FLOAT, virtual=False)
_ONE = _Node(_constant_token(1), _FLOAT, virtual=False)
_INT_ZERO = _Node(_constant_token(0, _INT), _INT, virtual=False)


class _Writer:
    """Writes one program by evaluating a jaxpr over _Fold and _Node values."""

    def __init__(self, tables: list):
        self.items: list[str] = []
        self.tables = tables  # shared by the forward and the derivative
        self.zeros = {}  # a virtual zero per type

    # -- emitting -----------------------------------------------------------------------------
    def emit(self, out_type: str, mode: str, *operands: str) -> str:
        item = " ".join((out_type, mode, *operands))
        if item in self.items:  # instructions are pure: one node per distinct computation
            return f"%{self.items.index(item)}"
        self.items.append(item)
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
                return _Node(_constant_token(value, x.dtype), x.dtype, virtual=False)
        index = next((i for i, t in enumerate(self.tables) if t is x), None)
        if index is None:
            index = len(self.tables)
            self.tables.append(x)
        table = _Node(f"t{index}", _FLOAT, virtual=False)  # stored as float32
        if x.dtype == _FLOAT:
            return table
        as_int = self.cast(table, _INT)
        if x.dtype == _BOOL:  # 0.0 / 1.0
            return self.compare("CMP_NEQ", as_int, _INT_ZERO)
        return as_int

    def bool_constant(self, value: bool) -> _Node:
        # q >= 0 always holds, q < 0 never: a virtual True or False.
        return _Node(self.emit("b", "CMP_GE" if value else "CMP_LT", "q", _INT_ZERO.token),
                     _BOOL)

    def virtual(self, node: _Node) -> _Node:
        """node as a graph intermediate: a constant or table added to a virtual zero."""
        if node.virtual:
            return node
        kind = _type(node.dtype)
        if kind not in self.zeros:  # q times zero, in the node's type
            self.zeros[kind] = self.emit(kind, "MUL", "q", self.zero_like(node).token)
        return _Node(self.emit(kind, "ADD", self.zeros[kind], node.token), node.dtype)

    def cast(self, node: _Node, dtype) -> _Node:
        """node converted by cuDNN's IDENTITY (exact from int32 or bool)."""
        if node.dtype == dtype:
            return node
        return _Node(self.emit(_type(dtype), "IDENTITY", self.virtual(node).token), dtype)

    def compare(self, mode: str, a: _Node, b: _Node) -> _Node:
        # Measured on cuDNN 9.19 (H100): a comparison of float32 values finds no engine.
        if _FLOAT in (a.dtype, b.dtype):
            raise UnsupportedScoreMod(
                "score_mod compares float32 values (a comparison, sign, or a conversion to "
                "bool); cuDNN's score-modifier kernels compare int32 values only")
        if not a.virtual:
            a, b, mode = b, a, _MIRRORED[mode]
        return _Node(self.emit("b", mode, a.token, b.token), _BOOL)

    def negate(self, predicate: _Node) -> _Node:
        """not predicate: the opposite comparison where it is one, else predicate == 0."""
        token = predicate.token
        item = self.items[int(token[1:])].split() if token.startswith("%") else []
        if item and item[1] in _OPPOSITE:
            return _Node(self.emit("b", _OPPOSITE[item[1]], *item[2:]), _BOOL)
        return self.compare("CMP_EQ", self.cast(predicate, _INT), _INT_ZERO)

    def binary(self, mode: str, a: _Node, b: _Node, dtype, commutative=False) -> _Node:
        if commutative and not a.virtual and b.virtual:
            a, b = b, a
        identity = {"ADD": 0, "SUB": 0, "MUL": 1, "DIV": 1}.get(mode)
        if (identity is not None and a.virtual and _type(a.dtype) == _type(dtype) and
                b.token in (_constant_token(identity), _constant_token(identity, _INT))):
            return dataclasses.replace(a, dtype=dtype)  # x + 0, x * 1: x itself
        return _Node(self.emit(_type(dtype), mode, self.virtual(a).token, b.token), dtype)

    def unary(self, mode: str, a: _Node, dtype) -> _Node:
        a = self.virtual(a)
        return _Node(self.emit(_type(dtype), mode, a.token), dtype)

    @staticmethod
    def zero_like(a: _Node) -> _Node:
        return _INT_ZERO if a.dtype == _INT else _ZERO

    def sign(self, a: _Node) -> _Node:
        positive = self.cast(self.compare("CMP_GT", a, self.zero_like(a)), a.dtype)
        negative = self.cast(self.compare("CMP_LT", a, self.zero_like(a)), a.dtype)
        return self.binary("SUB", positive, negative, a.dtype)

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
        if name == "not":  # XLA's lowering has no LOGICAL_NOT either
            if dtype != _BOOL:
                raise UnsupportedScoreMod("score_mod uses bitwise `not` on integers")
            return self.negate(x[0])
        if name in _COMPARISONS:
            return self.compare(_COMPARISONS[name], *x)
        if name == "sub":
            return self.binary("SUB", x[0], x[1], dtype)
        if name == "div":  # int32: toward zero, as C (and XLA's lowering, which maps it so)
            return self.binary("DIV", x[0], x[1], dtype)
        if name == "rem":
            quotient = self.binary("DIV", x[0], x[1], dtype)
            if dtype == _FLOAT:  # toward zero, through int32
                quotient = self.cast(self.truncate(quotient), _FLOAT)
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
            if dtype == _INT:
                raise UnsupportedScoreMod(f"score_mod raises an integer to the power {y}")
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
        if predicate.dtype != _BOOL:  # select_n's integer case index: 0 or 1
            predicate = self.compare("CMP_NEQ", predicate, self.zero_like(predicate))
        if_false, if_true = cases
        if dtype != _BOOL and if_false.virtual:
            if not if_true.virtual:  # its constant or table second, as below
                return self.pick(if_false, if_true, self.negate(predicate), dtype)
            # Measured on cuDNN 9.19 (H100): a select of two computed values runs ~9x slower
            # than one of a computed value and a constant; so each case against zero, added.
            zero = self.zero_like(if_true)
            return self.binary("ADD", self.pick(if_true, zero, predicate, dtype),
                               self.pick(if_false, zero, self.negate(predicate), dtype), dtype)
        return self.pick(if_true, if_false, predicate, dtype)

    def pick(self, if_true: _Node, if_false: _Node, predicate: _Node, dtype) -> _Node:
        return _Node(self.emit(_type(dtype), "BINARY_SELECT", self.virtual(if_true).token,
                               if_false.token, predicate.token), dtype)

    def convert(self, node: _Node, dtype) -> _Node:
        if dtype == node.dtype:
            return node
        if dtype == _BOOL:
            return self.compare("CMP_NEQ", node, self.zero_like(node))
        if dtype == _INT and node.dtype == _FLOAT:
            return self.truncate(node)
        return self.cast(node, dtype)

    def truncate(self, x: _Node) -> _Node:
        """float32 x to int32 toward zero, as JAX converts. cuDNN's IDENTITY to int32 rounds
        otherwise (measured on 9.19): floor(|x|), exact as an integer, times the sign of x
        rounded however cuDNN rounds (0 only where |x| < 1, where floor(|x|) is 0 too), so
        that no float32 value is compared."""
        magnitude = self.cast(self.unary("FLOOR", self.unary("ABS", x, _FLOAT), _FLOAT), _INT)
        return self.binary("MUL", magnitude, self.sign(self.cast(x, _INT)), _INT, True)

    def result(self, value, masked_fill=None) -> list[str]:
        """The live instructions (those the result reads), renumbered, then the result; with
        masked_fill, a -inf result becomes that value (a mask's fill: the reference's rule; as a
        maximum, which no finite score is below)."""
        node = self.virtual(self.cast(self.operand(value), _FLOAT))
        if masked_fill is not None and any("c-inf" in item.split() for item in self.items):
            node = self.binary("MAX", node, _Node(_constant_token(masked_fill), _FLOAT, False),
                               _FLOAT)
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
    return ScoreModProgram(programs[0], programs[1], len(frozen),
                           any("batch" in table.deps for table in frozen), table_values)
