"""Our calls' cuDNN workspace as a result XLA allocates (jax_sdpa/cudnn/call.py,
ffi/call/execution.cc): sized while the call is planned, used by the handler in either mode, and a missing or too small
one replaced by memory the handler finds itself, with the same answers. Skipped without a GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa.cudnn import call as cudnn_call
from conftest import calls_to, random_qkv, relative_error
from poisoning import poison_outputs

pytestmark = pytest.mark.gpu

MODES = pytest.mark.parametrize("mode", ["0", "1"], ids=["plain", "command_buffers"])


def make_step(d_out):
    """A new jitted fwd+bwd at the seed's size (a new function: traced in the current mode)."""
    def step(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=True, deterministic=True, implementation="cudnn"), q, k, v)
        return (out, *vjp(d_out))
    return jax.jit(step)


def workspace_results(text, role):
    """Sizes of the uint8 results of the lowered calls to our target of `role`."""
    lines = calls_to(text, role)
    assert lines, f"no {role} call"
    return [int(size) for line in lines
            for size in re.findall(r"tensor<(\d+)xui8>", line.split("->")[-1])]


@pytest.fixture(scope="module")
def seed_problem():
    """The seed's inputs (its backward needs a workspace) and its deterministic answers with the
    planned workspace, checked against the float32 reference."""
    q, k, v, d_out = random_qkv(51, 4, 1024, 1024, 12, 12, 64, jnp.float16)
    want = [np.asarray(x, np.float32) for x in make_step(d_out)(q, k, v)]
    reference = jax.vjp(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla"),
        *(x.astype(jnp.float32) for x in (q, k, v)))
    expected = (reference[0], *reference[1](d_out.astype(jnp.float32)))
    for got, ref in zip(want, expected):
        assert relative_error(got, ref) < 1e-2
    return (q, k, v, d_out), want


@MODES
def test_backward_lowers_with_its_workspace_as_a_result(mode, monkeypatch):
    monkeypatch.setenv("JAX_SDPA_COMMAND_BUFFERS", mode)
    q, k, v, d_out = random_qkv(1, 4, 1024, 1024, 12, 12, 64, jnp.float16)
    text = make_step(d_out).lower(q, k, v).as_text()
    sizes = workspace_results(text, "backward")
    assert len(sizes) == 1 and sizes[0] > 0, sizes
    assert "workspace_result = true" in calls_to(text, "backward")[0]


@MODES
@pytest.mark.parametrize("given", ["planned", "too_small", "none"])
def test_every_workspace_gives_the_same_answers(given, mode, seed_problem, monkeypatch,
                                                fresh_traces):
    """The planned workspace, one too small (the handler must not use it) and none at all
    (planned without a GPU): bit-identical answers, with the workspace poisoned first."""
    (q, k, v, d_out), want = seed_problem
    monkeypatch.setenv("JAX_SDPA_COMMAND_BUFFERS", mode)
    if given != "planned":
        size = 256 if given == "too_small" else 0
        monkeypatch.setattr(cudnn_call, "planned_workspace_bytes", lambda *args: size)
    with poison_outputs():  # traced here: outputs and workspace poisoned first
        step = make_step(d_out)
        text = step.lower(q, k, v).as_text()
        answers = [[np.asarray(x, np.float32) for x in step(q, k, v)] for _ in range(3)]
    sizes = workspace_results(text, "backward")
    if given == "planned":
        assert len(sizes) == 1 and sizes[0] > 256, sizes  # the seed's backward: MiBs
    else:
        assert sizes == ([256] if given == "too_small" else []), sizes
    for got in answers:  # the first call, and replays (command buffers record the first)
        for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
            np.testing.assert_array_equal(a, b, err_msg=name)
