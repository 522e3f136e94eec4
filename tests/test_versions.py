import pytest

from jax_sdpa.common import versions


@pytest.mark.parametrize("text,expected", [("0.11.2", (0, 11, 2)), ("0.6.0.dev20250101", (0, 6, 0)),
                                           ("1.0.0rc1", (1, 0, 0)), ("0.10.2+cuda13", (0, 10, 2))])
def test_parse_version(text, expected):
    assert versions.parse_version(text) == expected


def test_old_jax_is_a_clear_import_error():
    with pytest.raises(ImportError, match=r"jax >= 0\.10\.0.*found jax 0\.9\.1"):
        versions.check_jax("0.9.1")
    versions.check_jax("0.10.0")
