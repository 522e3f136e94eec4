"""The README's parameter table of dot_product_attention names exactly the function's parameters,
in order (a keyword added to the code but not to the README, or the reverse, fails here)."""

import inspect
import pathlib

import jax_sdpa

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_parameters():
    text = README.read_text()
    assert "<!-- parameters:start -->" in text, "the README has no parameter table"
    table = text.split("<!-- parameters:start -->")[1].split("<!-- parameters:end -->")[0]
    return [line.strip("|").split("|")[0].strip() for line in table.strip().splitlines()[2:]]


def test_readme_parameter_table_names_every_parameter_in_order():
    code = list(inspect.signature(jax_sdpa.dot_product_attention).parameters)
    assert readme_parameters() == code
