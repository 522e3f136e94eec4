"""The layering of jax_sdpa/: each module imports only modules at its own layer or below, so
the code reads top-down (entry points, the call's description and plan, the custom_vjp, the
sharding rules, the kernel switch, packing, our FFI targets and the reference, each feature's
limits) with no arrow running back up; and each sub-package says what it holds."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_sdpa"

# Top to bottom, by module path within jax_sdpa ("ring" is ring/__init__.py). A new module
# gets a place here.
LAYERS = [
    {"__init__", "flax", "fp8", "ring"},                    # entry points
    {"fp8_delayed"},                                        # FP8 delayed scaling
    {"ring.all_gather"},                                    # ring attention's strategies
    {"ring.blocks"},                                        # one block and the merge
    {"api.varlen", "api.paged", "api.explain"},             # the other public functions
    {"api.attention"},                                      # dot_product_attention
    {"call.inputs"},                                        # a call's kernel inputs
    {"call.planning"},                                      # cuDNN or not, and the CallSpec
    {"kernels.vjp"},                                        # forward + backward as custom_vjp
    {"kernels.sharding"},                                   # custom_partitioning, custom_vmap
    {"kernels.dispatch"},                                   # the kernel switch
    {"packing.ragged", "kernels.fp8", "kernels.pieces"},    # packed rows, FP8, pieces
    {"packing.fallback", "packing.grids", "reference.kernel"},
    {"cudnn.dense", "cudnn.ragged", "cudnn.paged", "cudnn.fp8",  # one module per FFI job
     "packing.documents", "reference.paged", "reference.fp8", "reference.empty_rows",
     "kernels.sink_softmax"},
    {"cudnn.call", "call.validation", "limits.pieces"},     # the FFI call; the arrays checked
    {"limits.dense", "limits.paged"},                       # each feature's limits
    {"limits.packed", "limits.fp8"},
    {"limits.device"},
    {"call.spec", "cudnn.targets", "cudnn.extension", "cudnn.command_buffers",  # leaves
     "reference.attention", "reference.fp8_scaling", "common.warn", "common.versions",
     "common.varying", "score_mod.program", "masks", "pieces.plan", "pieces.intervals", "api",
     "call", "limits", "kernels", "packing", "cudnn", "reference", "common", "score_mod",
     "pieces"},
]


def module_name(path):
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer_of(name):
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def imported_modules(path):
    """The jax_sdpa modules a file imports, by module path."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jax_sdpa" or node.module.startswith("jax_sdpa."):
                prefix = node.module.removeprefix("jax_sdpa").removeprefix(".")
                for alias in node.names:
                    candidate = f"{prefix}.{alias.name}" if prefix else alias.name
                    found.add(candidate if candidate in MODULES else prefix)
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("jax_sdpa.") for alias in node.names
                      if alias.name.startswith("jax_sdpa.")}
    return found & set(MODULES)


def test_every_module_has_a_layer():
    placed = set().union(*LAYERS)
    assert set(MODULES) == placed, (f"unplaced: {set(MODULES) - placed}, "
                                    f"gone: {placed - set(MODULES)}")


def test_no_module_imports_one_above_it():
    upward = []
    for name, path in sorted(MODULES.items()):
        for imported in imported_modules(path):
            if layer_of(imported) < layer_of(name):
                upward.append(f"{name} imports {imported}")
    assert not upward, upward


def test_every_module_says_what_it_holds():
    """Each module, sub-packages' __init__ included, opens with a docstring."""
    bare = [name for name, path in MODULES.items()
            if ast.get_docstring(ast.parse(path.read_text())) is None]
    assert not bare, bare


def test_no_file_is_over_600_lines():
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(root / "ffi").rglob("*.h"), *(root / "ffi").rglob("*.cc"),
             *(root / "tests").glob("*.py"), *(root / "benchmarks").glob("*.py")]
    long = {str(path.relative_to(root)): n for path in files
            if (n := len(path.read_text().splitlines())) > 600}
    assert not long, long
