"""Put a carried cuDNN (zstd-compressed libraries) in place of this Python's own, on the GPU machine.

    python3 scripts/install_carried_cudnn.py .cudnn

The GPU machine has no registry access and one device call carries at most 64 MiB, so another
cuDNN (e.g. 9.28, what a fresh install gets) travels as `lib*.so.9.zst` files spread over
several folders under one ignored directory (`.cudnn/p1`, `.cudnn/p2`, ...; made by
scripts/pack_cudnn_parts.py from a venv that has the wheel; its headers in the last folder's
`include/`). This decompresses every one of them over the files in `nvidia/cudnn/lib` of the
running Python and copies the headers over `nvidia/cudnn/include` (the machine is discarded
afterwards), so jaxlib and jax_sdpa load it and a build afterwards compiles against it. Needs
the `zstandard` package (carry its cp312 wheel in one of the folders: it is installed from
there). Recipe: shared/DEVICE.md, docs/DEVELOPING.md.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys


def _zstandard(root):
    try:
        import zstandard  # noqa: PLC0415
    except ImportError:
        wheels = glob.glob(os.path.join(root, "**", "zstandard-*.whl"), recursive=True)
        if not wheels:
            sys.exit(f"no zstandard module and no zstandard wheel under {root}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", "/tmp/zstandard", wheels[0]], check=True)
        sys.path.insert(0, "/tmp/zstandard")
        import zstandard  # noqa: PLC0415
    return zstandard


def main(root):
    import nvidia.cudnn  # noqa: PLC0415 - the package whose libraries jaxlib loads

    target = os.path.join(list(nvidia.cudnn.__path__)[0], "lib")
    parts = sorted(glob.glob(os.path.join(root, "**", "*.so.9.zst"), recursive=True))
    if not parts:
        sys.exit(f"no *.so.9.zst files under {root}")
    decompressor = _zstandard(root).ZstdDecompressor(max_window_size=2**31)
    for path in parts:
        name = os.path.basename(path)[:-len(".zst")]
        with open(path, "rb") as source, open(os.path.join(target, name), "wb") as out:
            decompressor.copy_stream(source, out)
        print(f"{name}: {os.path.getsize(os.path.join(target, name)) / 2**20:.0f} MiB -> {target}")
    # Its headers over the machine's, so an extension built afterwards compiles against the
    # version it loads (the frontend checks features against the lower of the two).
    headers = glob.glob(os.path.join(root, "**", "include", "*.h"), recursive=True)
    include = os.path.join(os.path.dirname(target), "include")
    for path in headers:
        shutil.copy(path, include)
    print(f"{len(headers)} headers -> {include}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".cudnn")
