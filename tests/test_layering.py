"""The package's imports point down its floors, its folders form no loop, and no function imports a
loraserve module (or a dependency that is not optional or deferred on purpose).

Floors, top to bottom (docs/structures.md draws them): an import may point to its own floor or below.
"""
import ast
import pathlib


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "loraserve"

FLOORS = (  # top to bottom; a module belongs to the floor of its longest matching prefix
    ("entrypoints", ("loraserve", "loraserve.entrypoints")),  # the package's __init__ is the user-facing top
    ("engine", ("loraserve.engine",)),
    ("worker", ("loraserve.worker",)),
    ("lora", ("loraserve.lora",)),
    ("models", ("loraserve.models",)),
    ("ground", ("loraserve.forward_context", "loraserve.sequence", "loraserve.sampling_params",
                "loraserve.outputs", "loraserve.distributed", "loraserve.peer_all_reduce")),
    ("base", ("loraserve.kernels", "loraserve.config", "loraserve.errors")),
)

# function-local imports that are allowed, and why
DEFERRED = {
    "transformers": "configs and tokenizers only; importing it costs seconds",
    "transformers.integrations.gguf": "GGUF tokenizers only (built from the header already read)",
    "huggingface_hub": "a repo id's snapshot in the local cache only; importing it costs a third of a second",
    "huggingface_hub.errors": "a repo id's snapshot in the local cache only",
    "gguf": "GGUF files only; not installed on every machine",
    "gguf.quants": "GGUF files only; not installed on every machine",
    "uvicorn": "the server only",
    "loraserve.entrypoints.server": "needs fastapi, which `loraserve generate` and `bench` do not",
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    best, floor = -1, None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), index
    assert floor is not None, f"{module} belongs to no floor: add it to FLOORS"
    return floor


def _unit(module: str) -> str:
    """The folder (loraserve.engine) or top-level module (loraserve.config) a module lives in."""
    return ".".join(module.split(".")[:2])


def _imports(path: pathlib.Path):
    """(imported module, line, whether inside a function or class) for each loraserve/third-party import."""
    tree = ast.parse(path.read_text())
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            local.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "loraserve" or node.module.startswith("loraserve."):  # from pkg import submodule
                names = [f"{node.module}.{a.name}" if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")
                                                       ).with_suffix(".py").exists() else node.module
                         for a in node.names]
            for name in names:
                yield name, node.lineno, id(node) in local
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in local


MODULES = sorted(PACKAGE.rglob("*.py"))


def _edges():
    for path in MODULES:
        source = _module_name(path)
        for target, line, local in _imports(path):
            yield path, source, target, line, local


def upward(edges) -> list[str]:
    """The (source, target) module pairs that point up a floor."""
    return sorted({f"{source} ({FLOORS[_floor(source)][0]}) imports {target} ({FLOORS[_floor(target)][0]})"
                   for source, target in edges if target.startswith("loraserve") and _floor(target) < _floor(source)})


def loops(edges) -> list[str]:
    """Cycles between folders (units) in the (source, target) module pairs."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        if target.startswith("loraserve") and _unit(target) != _unit(source):
            graph.setdefault(_unit(source), set()).add(_unit(target))
    found = set()

    def visit(unit, stack):
        for nxt in sorted(graph.get(unit, ())):
            if nxt in stack:
                found.add(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            else:
                visit(nxt, stack + [nxt])

    for unit in sorted(graph):
        visit(unit, [unit])
    return sorted(found)


def test_imports_point_down_the_floors():
    bad = upward((source, target) for _, source, target, _, _ in _edges())
    assert not bad, "imports that point up a floor:\n" + "\n".join(bad)


def test_folders_form_no_loop():
    bad = loops((source, target) for _, source, target, _, _ in _edges())
    assert not bad, "folders that import each other:\n" + "\n".join(bad)


def test_no_function_local_imports_but_deferred_ones():
    local = [f"{path.relative_to(PACKAGE.parent)}:{line}: {target}" for path, _, target, line, is_local in _edges()
             if is_local and target not in DEFERRED]
    assert not local, "function-local imports (import at the top of the module):\n" + "\n".join(local)


def test_the_checks_catch_what_they_are_for():
    """The rules themselves, on made-up imports: up a floor, down a floor, and a loop between folders."""
    assert upward([("loraserve.models.llama", "loraserve.worker.forward_context")])
    assert upward([("loraserve.kernels.fused", "loraserve.sequence")])
    assert not upward([("loraserve.worker.model_runner", "loraserve.sequence"), ("loraserve", "loraserve.engine")])
    assert loops([("loraserve.engine.engine", "loraserve.worker.model_runner"),
                  ("loraserve.worker.model_runner", "loraserve.engine.scheduler")])
    assert not loops([("loraserve.engine.engine", "loraserve.worker.model_runner"),
                      ("loraserve.engine.scheduler", "loraserve.worker.step_inputs")])
