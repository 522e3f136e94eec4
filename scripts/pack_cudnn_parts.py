"""Pack a cuDNN's libraries into parts the device tool can carry, one part per call.

    python3 scripts/pack_cudnn_parts.py [--lib DIR] [--out .cudnn] [--zstandard-wheel WHL]

Compresses the libraries SDPA needs (`zstd --long=27`, level 12, or 19 where 12 leaves a file
past one call's carry) from DIR (default: this Python's nvidia/cudnn/lib, e.g. a venv with
`nvidia-cudnn-cu13==9.28.*`) and spreads them over OUT/p1, OUT/p2, ... of at most 63 MiB each
(a call carries 64 MiB in all: .whl/, ~28 MiB, goes with whichever part leaves room, or alone).
The headers go with the last part. Carry the parts in consecutive calls less than ~30 s apart,
then run scripts/install_carried_cudnn.py there (docs/DEVELOPING.md). Needs the `zstd` program here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess

# SDPA needs these; engines_precompiled and adv were not needed (shared/DEVICE.md).
LIBRARIES = ("libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_engines_runtime_compiled.so.9",
             "libcudnn_heuristic.so.9", "libcudnn_engines_tensor_ir.so.9", "libcudnn_ops.so.9",
             "libcudnn_cnn.so.9", "libcudnn_ext.so.9")
PART_BYTES = 63 * 2**20  # a call carries 64 MiB


def compress(source, target):
    for level in (12, 19):
        subprocess.run(["zstd", "-q", f"-{level}", "-T0", "--long=27", "-f", source, "-o",
                        target], check=True)
        if os.path.getsize(target) <= PART_BYTES:
            return
    raise SystemExit(f"{source} is {os.path.getsize(target)} bytes compressed: past one part")


def parts(sizes, capacity=PART_BYTES):
    """Files (name -> bytes) into bins of at most `capacity`, largest first (first fit)."""
    bins = []
    for name, size in sorted(sizes.items(), key=lambda item: -item[1]):
        for part in bins:
            if part["bytes"] + size <= capacity:
                part["files"].append(name)
                part["bytes"] += size
                break
        else:
            bins.append({"files": [name], "bytes": size})
    return bins


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", default=None)
    parser.add_argument("--out", default=".cudnn")
    parser.add_argument("--zstandard-wheel", default=None,
                        help="the zstandard cp312 wheel the machine installs from (pip download "
                             "--only-binary=:all: --python-version 3.12 zstandard)")
    args = parser.parse_args(argv)
    if args.lib is None:
        import nvidia.cudnn  # noqa: PLC0415

        args.lib = os.path.join(list(nvidia.cudnn.__path__)[0], "lib")
    staging = os.path.join(args.out, "staging")
    os.makedirs(staging, exist_ok=True)
    sizes = {}
    for name in LIBRARIES:
        target = os.path.join(staging, name + ".zst")
        compress(os.path.join(args.lib, name), target)
        sizes[target] = os.path.getsize(target)
    if args.zstandard_wheel:
        sizes[args.zstandard_wheel] = os.path.getsize(args.zstandard_wheel)
    for index, part in enumerate(parts(sizes), start=1):
        directory = os.path.join(args.out, f"p{index}")
        os.makedirs(directory, exist_ok=True)
        for path in part["files"]:
            shutil.copy(path, directory)
        print(f"{directory}: {part['bytes'] / 2**20:.1f} MiB, "
              f"{', '.join(os.path.basename(f) for f in part['files'])}")
    # The headers too (~1.2 MiB, in the last, smallest part): the frontend's support checks take
    # the lower of the compiled and the loaded cuDNN version, so a build against the machine's
    # own headers sees the old version (frontend 1.32's unified SDPA refused 9.28 that way).
    headers = os.path.join(args.lib, os.pardir, "include")
    shutil.copytree(headers, os.path.join(directory, "include"), dirs_exist_ok=True)
    shutil.rmtree(staging)


if __name__ == "__main__":
    main()
