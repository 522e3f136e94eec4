"""Prints pyproject.toml's [build-system] requires, one a line (Python 3.10 has no tomllib)."""

import pathlib
import re
import sys

text = pathlib.Path(__file__).resolve().parents[1].joinpath("pyproject.toml").read_text()
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the array of strings, read by hand
    section = re.search(r"^\[build-system\]$(.*?)(?=^\[)", text, re.S | re.M)
    block = re.search(r"^requires\s*=\s*\[(.*?)\]", section.group(1) if section else "",
                      re.S | re.M)
    if block is None:
        sys.exit("pyproject.toml has no [build-system] requires")
    requires = re.findall(r'"([^"]+)"', re.sub(r"#.*", "", block.group(1)))
else:
    requires = tomllib.loads(text)["build-system"]["requires"]
print("\n".join(requires))
