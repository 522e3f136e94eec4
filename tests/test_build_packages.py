"""cmake/find_cuda_packages.py, which tells CMake where the wheels' headers and libraries are:
another frontend's headers by environment variable, and NVRTC only for frontends that need it."""

import importlib.util
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]  # paths from the repository, not the cwd


def finder():
    spec = importlib.util.spec_from_file_location("find_cuda_packages",
                                                  ROOT / "cmake" / "find_cuda_packages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_frontend(root, includes_nvrtc):
    (root / "cudnn_frontend").mkdir(parents=True)
    (root / "cudnn_frontend.h").write_text('#include "cudnn_frontend/graph.h"\n')
    (root / "cudnn_frontend" / "graph.h").write_text(
        "#include <nvrtc.h>\n" if includes_nvrtc else "#include <cuda_runtime.h>\n")
    return root


def test_nvrtc_is_needed_only_by_frontends_that_include_it(tmp_path):
    module = finder()
    assert module.uses_nvrtc(str(fake_frontend(tmp_path / "new", True)))
    assert not module.uses_nvrtc(str(fake_frontend(tmp_path / "pinned", False)))


def test_another_frontends_headers_by_environment(tmp_path, monkeypatch, capsys):
    module = finder()
    headers = fake_frontend(tmp_path / "include", True)
    nvrtc = tmp_path / "site" / "nvidia" / "cu13"
    (nvrtc / "include").mkdir(parents=True)
    (nvrtc / "lib").mkdir()
    (nvrtc / "include" / "nvrtc.h").write_text("")
    (nvrtc / "lib" / "libnvrtc.so.13").write_text("")
    monkeypatch.setenv("JAX_SDPA_FRONTEND_INCLUDE_DIR", str(headers))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    module.main()
    lines = capsys.readouterr().out.splitlines()
    assert f'set(JAX_SDPA_FRONTEND_INCLUDE_DIR "{headers}")' in lines
    assert f'set(JAX_SDPA_NVRTC_INCLUDE_DIR "{nvrtc / "include"}")' in lines
    assert f'set(JAX_SDPA_NVRTC_LIBRARY "{nvrtc / "lib" / "libnvrtc.so.13"}")' in lines


def test_the_pinned_frontend_builds_without_nvrtc(monkeypatch, capsys):
    monkeypatch.delenv("JAX_SDPA_FRONTEND_INCLUDE_DIR", raising=False)
    module = finder()
    module.main()
    lines = capsys.readouterr().out.splitlines()
    frontend = next(line for line in lines if line.startswith("set(JAX_SDPA_FRONTEND_INCLUDE_DIR"))
    directory = frontend.split('"')[1]
    assert os.path.exists(os.path.join(directory, "cudnn_frontend.h"))
    # The pin (1.18) needs no NVRTC. A newer pin fails here on purpose: nvidia-cuda-nvrtc must
    # then join the project's dependencies.
    assert not module.uses_nvrtc(directory)
    assert 'set(JAX_SDPA_NVRTC_LIBRARY "")' in lines
