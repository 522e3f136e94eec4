"""Random score modifiers for the program tests: elementwise functions of the float32 score,
the int32 positions, the batch and head indices and a per-head table, drawn from a seeded
grammar of what users write (arithmetic, tanh/sigmoid/exp, integer division and remainder,
comparisons of integers, boolean logic, selects, casts). Denominators are kept away from zero so
that float32 rounding cannot blow up near a pole."""

import random

import jax  # noqa: F401  (the sources name jax.nn)
import jax.numpy as jnp


def function(seed: int, table):
    """(source, score_mod) for one seed; `TAB` in the source is `table`, indexed by head.
    Every function is one cuDNN's pointwise nodes express."""
    draw = random.Random(seed)
    source = _float(draw.randint(1, 4), draw)
    return source, eval(f"lambda s, b, h, q, k: {source}",  # noqa: S307 (our own grammar)
                        {"jax": jax, "jnp": jnp, "TAB": table})


def _float(depth, draw):
    if depth == 0:
        return draw.choice(["s", "s", f"{draw.uniform(-2, 2):.2f}", "TAB[h]"])
    sub = lambda: _float(depth - 1, draw)  # noqa: E731
    choice = draw.randrange(10)
    if choice == 3:
        x = sub()
        return f"({sub()} / (1.5 + {x} * {x}))"
    return [lambda: f"({sub()} + {sub()})", lambda: f"({sub()} - {sub()})",
            lambda: f"({sub()} * {sub()})", None,
            lambda: f"jnp.tanh({sub()})", lambda: f"jax.nn.sigmoid({sub()})",
            lambda: f"jnp.exp(jnp.tanh({sub()}))",
            lambda: f"jnp.where({_bool(depth - 1, draw)}, {sub()}, {sub()})",
            lambda: f"({_int(depth - 1, draw)}).astype(jnp.float32)",
            lambda: f"({sub()} * {_int(depth - 1, draw)})"][choice]()


def _int(depth, draw):
    if depth == 0:
        return draw.choice(["q", "k", "h", "b", f"jnp.int32({draw.randint(-3, 5)})"])
    sub = lambda: _int(depth - 1, draw)  # noqa: E731
    return [lambda: f"({sub()} + {sub()})", lambda: f"({sub()} - {sub()})",
            lambda: f"({sub()} * {draw.randint(-3, 3)})",
            lambda: f"({sub()} // {draw.randint(1, 4)})",
            lambda: f"({sub()} % {draw.randint(1, 4)})", lambda: f"jnp.abs({sub()})",
            lambda: f"jnp.minimum({sub()}, {sub()})",
            lambda: f"jnp.where({_bool(depth - 1, draw)}, {sub()}, {sub()})",
            ][draw.randrange(8)]()


def _bool(depth, draw):
    if depth <= 0:
        return f"({_int(0, draw)} < {_int(0, draw)})"
    return [lambda: f"({_int(depth - 1, draw)} < {_int(depth - 1, draw)})",
            lambda: f"({_int(depth - 1, draw)} == {_int(depth - 1, draw)})",
            lambda: f"({_bool(depth - 1, draw)} & {_bool(depth - 1, draw)})",
            lambda: f"({_bool(depth - 1, draw)} | {_bool(depth - 1, draw)})",
            lambda: f"(~{_bool(depth - 1, draw)})"][draw.randrange(5)]()
