"""Print, as CMake `set()` lines, where the packaged CUDA, cuDNN and cuDNN-frontend files are.

Headers and libraries come from pip wheels (nvidia-cudnn-cu1x, nvidia-cuda-runtime*,
nvidia-cudnn-frontend) found on this interpreter's sys.path; a CUDA toolkit is only a fallback
for the runtime. Run by CMakeLists.txt with the build's Python.
"""

import glob
import os
import sys


def first_existing(patterns):
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if os.path.exists(path):
                return path
    return ""


def search(relative_patterns):
    roots = [p for p in sys.path if p and os.path.isdir(p)]
    return first_existing(os.path.join(root, rel) for root in roots for rel in relative_patterns)


def uses_nvrtc(frontend_include_dir):
    """Whether these frontend headers include nvrtc.h (1.19 and later)."""
    for path in glob.glob(os.path.join(frontend_include_dir, "**", "*.h"), recursive=True):
        with open(path, errors="replace") as f:
            if "<nvrtc.h>" in f.read():
                return True
    return False


def main():
    cudnn_header = search(["nvidia/cudnn/include/cudnn.h"])
    cudnn_library = search(["nvidia/cudnn/lib/libcudnn.so.9"])
    # JAX_SDPA_FRONTEND_INCLUDE_DIR names another frontend's headers (benchmarks of a newer
    # frontend than the pinned one, docs/DEVELOPING.md); otherwise the installed wheel's.
    override = os.environ.get("JAX_SDPA_FRONTEND_INCLUDE_DIR", "")
    frontend_header = (os.path.join(override, "cudnn_frontend.h") if override else
                       search(["include/cudnn_frontend.h",
                               "cudnn_frontend/include/cudnn_frontend.h"]))
    # CUDA 13 wheels put everything under nvidia/cu13 (crt/ from nvidia-cuda-crt, nv/ from
    # nvidia-cuda-cccl, possibly installed to different roots); CUDA 12 ones each under their own
    # folder (nvidia-cuda-runtime-cu12, crt/ in nvidia-cuda-nvcc-cu12, nv/ in
    # nvidia-cuda-cccl-cu12). The toolkit fills in whatever the wheels lack.
    toolkit = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    include_dirs = []
    cuda12_folders = ("cuda_runtime", "cuda_nvcc", "cuda_cccl")
    for marker in ("cuda_runtime_api.h", "crt/host_defines.h", "nv/target"):
        found = search([f"nvidia/cu13/include/{marker}"] +
                       [f"nvidia/{folder}/include/{marker}" for folder in cuda12_folders])
        found = found or first_existing([os.path.join(toolkit, "include", marker)])
        directory = found[: -len(marker) - 1] if found else ""
        if not directory:
            include_dirs = []
            break
        if directory not in include_dirs:
            include_dirs.append(directory)
    runtime_static = search(["nvidia/cu13/lib/libcudart_static.a",
                             "nvidia/cuda_runtime/lib/libcudart_static.a"])
    if not runtime_static:
        runtime_static = first_existing([os.path.join(toolkit, "lib64/libcudart_static.a")])
    # Frontends from 1.19 on include nvrtc.h and call NVRTC (their runtime-compiled engines):
    # the nvidia-cuda-nvrtc wheel's header and library then join the build.
    nvrtc_header = nvrtc_library = ""
    if uses_nvrtc(os.path.dirname(frontend_header)):
        nvrtc_header = search(["nvidia/cu13/include/nvrtc.h", "nvidia/cuda_nvrtc/include/nvrtc.h"])
        nvrtc_library = search(["nvidia/cu13/lib/libnvrtc.so.13",
                                "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"])
        nvrtc_header = nvrtc_header or first_existing([os.path.join(toolkit, "include/nvrtc.h")])
        nvrtc_library = nvrtc_library or first_existing(
            [os.path.join(toolkit, "lib64/libnvrtc.so")])
    values = {
        "JAX_SDPA_CUDNN_INCLUDE_DIR": os.path.dirname(cudnn_header),
        "JAX_SDPA_CUDNN_LIBRARY": cudnn_library,
        "JAX_SDPA_FRONTEND_INCLUDE_DIR": os.path.dirname(frontend_header),
        "JAX_SDPA_CUDA_INCLUDE_DIRS": ";".join(include_dirs),
        "JAX_SDPA_CUDART_STATIC": runtime_static,
        "JAX_SDPA_NVRTC_INCLUDE_DIR": os.path.dirname(nvrtc_header),
        "JAX_SDPA_NVRTC_LIBRARY": nvrtc_library,
    }
    for name, value in values.items():
        print(f'set({name} "{value}")')


if __name__ == "__main__":
    main()
