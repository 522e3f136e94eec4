"""The versions jax_sdpa supports, checked when it is imported."""

from __future__ import annotations

import re

# The oldest JAX we have run (0.10.2 on CPU, 0.11.2 on GPU): the sharding rules (Shardy
# custom_partitioning rules, custom_vmap), shard_map's varying-axes types (aval.mat) and
# lax.pcast are recent APIs.
MIN_JAX = (0, 10, 0)


def parse_version(text: str) -> tuple[int, ...]:
    """'0.11.2' -> (0, 11, 2); suffixes such as '.dev20261129' or 'rc1' are ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def check_jax(version: str) -> None:
    if parse_version(version) < MIN_JAX:
        wanted = ".".join(map(str, MIN_JAX))
        raise ImportError(f"jax_sdpa needs jax >= {wanted}, found jax {version}: "
                          f"pip install -U 'jax>={wanted}'")
