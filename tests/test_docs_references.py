"""The docs name files that exist, and docs/runs/ holds only what the docs cite."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A backticked file name: `ffi/call_plan.cc`, `sdpa_config.*`, `scripts/gpu_check.sh`.
EXTERNAL = {"cudnn_frontend.h"}  # the cuDNN frontend's header, from its wheel
FILE_NAME = re.compile(r"`([\w./-]+\.(?:py|cc|h|sh|md|toml|json|png|txt|\*))`")


def _exists(name):
    pattern = name if "/" in name else f"**/{name}"
    return any(path.is_file() and ".venv" not in path.parts and "build" not in path.parts
               for path in ROOT.glob(pattern))


def test_every_file_the_docs_name_exists():
    missing = [(doc.name, name) for doc in DOCS for name in FILE_NAME.findall(doc.read_text())
               if name not in EXTERNAL and not name.startswith(("runs/", "$")) and not _exists(name)]
    assert not missing, missing


def test_every_run_log_is_cited():
    text = "".join(doc.read_text() for doc in DOCS)
    uncited = [path.name for path in (ROOT / "docs/runs").iterdir() if path.name not in text]
    assert not uncited, uncited
