"""Several processes, as a multi-host run has them: one JAX process per host (here per GPU, or
per group of host devices), jax.distributed.initialize with a coordinator on localhost, and one
global mesh over every process's devices.

    python scripts/multiprocess_check.py --platform gpu                 # one process per GPU
    python scripts/multiprocess_check.py --platform cpu --processes 2   # host devices (CI)

Each process runs the checks on global arrays (jax.make_array_from_callback: it holds only its
own shards) and compares the gathered answers with the one it computes alone on one local
device:
- sharding: jax_sdpa's kernels (cuDNN on GPUs, the reference kernel on CPU) under jit with q/k/v
  sharded over batch ("data") and heads ("model") across the processes: the compiled program has
  no collective (but the all-reduce of a broadcast bias's gradient), every result matches;
- ring: jax_sdpa.ring.ring_attention over all devices (strategies ring and all_gather, zigzag
  and contiguous, causal and full, GQA), output, lse and gradients;
- example: examples/sharded_training.py in both modes, a few steps, the loss falling.
Exit status 0 only if every process passed every check.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = ("sharding", "ring", "example")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", choices=["cpu", "gpu"], default="gpu")
    parser.add_argument("--processes", type=int, default=None,
                        help="default: one per visible GPU (gpu), 2 (cpu)")
    parser.add_argument("--devices-per-process", type=int, default=2,
                        help="host devices per process (cpu)")
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _gpu_count():
    result = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True)
    return len([line for line in result.stdout.splitlines() if line.startswith("GPU")])


def launch(args):
    processes = args.processes or (_gpu_count() if args.platform == "gpu" else 2)
    if processes < 2:
        print(f"needs two processes, got {processes}")
        return 1
    coordinator = f"localhost:{_free_port()}"
    children = []
    for index in range(processes):
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
        if args.platform == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        else:
            env["JAX_PLATFORMS"] = "cpu"
            flags = [f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            flags.append(f"--xla_force_host_platform_device_count={args.devices_per_process}")
            env["XLA_FLAGS"] = " ".join(flags)
        command = [sys.executable, os.path.abspath(__file__), "--platform", args.platform,
                   "--processes", str(processes), "--checks", args.checks,
                   "--worker", str(index), "--coordinator", coordinator]
        children.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + args.timeout
    status = 0
    for index, child in enumerate(children):
        try:
            output, _ = child.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for other in children:
                other.kill()
            output, _ = child.communicate()
            output += "\nTIMEOUT"
        print(f"--- process {index} (exit {child.returncode})\n{output.rstrip()}")
        status = status or (child.returncode != 0)
    print("multiprocess check:", "passed" if status == 0 else "FAILED")
    return int(status)


def main(argv=None):
    args = parse_args(argv)
    if args.worker is None:
        return launch(args)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from multiprocess_worker import run  # noqa: PLC0415 - scripts/, next to this file

    return run(args.worker, args.processes, args.coordinator, args.platform,
               args.checks.split(","))


if __name__ == "__main__":
    sys.exit(main())
