"""The layering of jax_sdpa/: each module imports only modules at its own layer or below, so
the code reads top-down (public entry points, the call's plan, the custom_vjp, the sharding
rules, the kernels, the FFI and the reference) with no arrow running back up."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_sdpa"

# Top to bottom. A new module gets a place here.
LAYERS = [
    {"__init__", "flax", "ring", "varlen", "paged", "fp8"},  # entry points
    {"ring_all_gather", "ring_blocks"},                  # ring attention's strategies, blocks
    {"attention"},                                       # dot_product_attention
    {"fused_path"},                                      # a call's cuDNN pre/post-processing
    {"planning"},                                        # cuDNN or not, and the CallSpec
    {"kernel_vjp"},                                      # forward + backward as custom_vjp
    {"sharding_rules"},                                  # custom_partitioning / custom_vmap
    {"kernels"},                                         # the kernel switch, packed layout
    {"_ffi", "reference_kernel", "packing", "packed_fallback",  # FFI, reference, tables
     "sink_softmax", "fp8_kernels", "fp8_reference"},    # sinks; FP8 on cuDNN, its reference
    {"reference", "validation", "call_spec", "_warnings", "versions",  # leaves
     "_extension", "command_buffers", "varying", "fp8_scaling"},
]


def layer_of(name):
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def imported_modules(path):
    """The jax_sdpa modules a file imports (its own package's, by module name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jax_sdpa":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("jax_sdpa."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names
                      if alias.name.startswith("jax_sdpa.")}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return found & modules


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    placed = set().union(*LAYERS)
    assert modules == placed, f"unplaced: {modules - placed}, gone: {placed - modules}"


def test_no_module_imports_one_above_it():
    upward = []
    for path in sorted(PACKAGE.glob("*.py")):
        for name in imported_modules(path):
            if layer_of(name) < layer_of(path.stem):
                upward.append(f"{path.stem} imports {name}")
    assert not upward, upward
