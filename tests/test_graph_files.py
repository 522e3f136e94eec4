"""The graph files directory (ffi/graph/graph_files.h) on its own, without a GPU: what is written is
read back under its key; missing, foreign, stale, truncated or corrupt files read as absent
(the graph is then built again, tests/test_gpu_graph_files.py), never as a wrong graph."""

import os
import pathlib

import pytest

from jax_sdpa.cudnn import extension
from poisoning import devtools_extension


@pytest.fixture(scope="module")
def files():
    extension.extension()  # the product extension loads cuDNN first
    return devtools_extension()


KEY = "config 0,1,4,1024,1024,12,12,64,64, cudnn 91900 frontend 11800 gpu NVIDIA H200 sm90 x132"
PAYLOAD = bytes(range(256)) * 40 + b"\x00tail"


def test_written_graph_reads_back_and_the_directory_is_created(files, tmp_path):
    directory = str(tmp_path / "made" / "here")
    assert files.read_graph_file(directory, KEY) is None
    assert files.write_graph_file(directory, KEY, PAYLOAD)
    assert files.read_graph_file(directory, KEY) == PAYLOAD
    path = pathlib.Path(files.graph_file_path(directory, KEY))
    assert path.parent == pathlib.Path(directory)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    assert files.write_graph_file(directory, KEY, b"second")  # rewritten in place
    assert files.read_graph_file(directory, KEY) == b"second"


def damaged(data, how):
    if how == "garbage":
        return os.urandom(len(data))
    if how == "empty":
        return b""
    if how == "truncated":
        return data[:-7]
    if how == "trailing bytes":
        return data + b"x"
    if how == "payload bit flipped":
        return data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]
    if how == "older format":
        return data.replace(b"graph v2", b"graph v0", 1)
    raise ValueError(how)


@pytest.mark.parametrize("how", ["garbage", "empty", "truncated", "trailing bytes",
                                 "payload bit flipped", "older format"])
def test_damaged_files_read_as_absent(files, tmp_path, how):
    directory = str(tmp_path)
    assert files.write_graph_file(directory, KEY, PAYLOAD)
    path = pathlib.Path(files.graph_file_path(directory, KEY))
    path.write_bytes(damaged(path.read_bytes(), how))
    assert files.read_graph_file(directory, KEY) is None
    assert files.write_graph_file(directory, KEY, PAYLOAD)  # the next build replaces it
    assert files.read_graph_file(directory, KEY) == PAYLOAD


def test_a_file_under_another_key_is_foreign(files, tmp_path):
    """Another config's (or another cuDNN's, GPU's) file in this key's place is not taken."""
    directory = str(tmp_path)
    other = KEY.replace("cudnn 91900", "cudnn 92800")
    assert files.write_graph_file(directory, other, PAYLOAD)
    os.replace(files.graph_file_path(directory, other), files.graph_file_path(directory, KEY))
    assert files.read_graph_file(directory, KEY) is None


def test_an_unwritable_directory_is_no_error(files, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert not files.write_graph_file(str(blocker / "cache"), KEY, PAYLOAD)
    assert files.read_graph_file(str(blocker / "cache"), KEY) is None
