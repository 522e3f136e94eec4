"""The README's signature block of dot_product_attention names exactly the function's parameters,
in order (a keyword added to the code but not to the README, or the reverse, fails here)."""

import inspect
import pathlib
import re

import jax_sdpa

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_parameters():
    text = README.read_text()
    match = re.search(r"```python\njax_sdpa\.dot_product_attention\((.*?)\)\n```", text, re.S)
    assert match, "the README has no dot_product_attention signature block"
    names = []
    for part in match.group(1).split(","):
        part = part.strip()
        if part and part != "*":
            names.append(part.split("=")[0].strip())
    return names


def test_readme_signature_names_every_parameter_in_order():
    code = list(inspect.signature(jax_sdpa.dot_product_attention).parameters)
    assert readme_parameters() == code
