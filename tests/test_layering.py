"""The package's import graph: every import runs downward through the layers, and there is no circle.

The layers, bottom to top (README "How it works" maps them):

0. ``env``, ``spec``, ``models``: the version and knobs, the vocabulary of sites, the example models;
1. ``kernels``: the candidates, the reference computation and its tolerance (the exactness contract);
2. ``selection``: the selector, shape keys, trials, the tuning cache, distributed agreement;
3. ``runtime``: the modules a rewritten graph calls (sites, guards, dispatch, the KV-cache site);
4. ``passes``: graph analyses and rewrites over captured graphs;
5. ``config``: the validated options;
6. ``pipeline``: the routes (optimize, rewrite, KV cache, profiling brackets) as lists of passes;
7. ``api``, ``generation``: the public functions;
8. ``profiling``, ``demo``: ``attnopt profile`` and the Quick-start demo, built on the public functions;
9. the package face (``attnopt/__init__.py``) and the command line (``__main__``).

An import may only name a module of a lower layer, or of its own package (``attnopt.passes.masks`` may
import ``attnopt.passes.canon``); imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attnopt"

LAYERS = {
    "attnopt.env": 0, "attnopt.spec": 0, "attnopt.models": 0,
    "attnopt.kernels": 1,
    "attnopt.selection": 2,
    "attnopt.runtime": 3,
    "attnopt.passes": 4,
    "attnopt.config": 5,
    "attnopt.pipeline": 6,
    "attnopt.api": 7, "attnopt.generation": 7,
    "attnopt.profiling": 8, "attnopt.demo": 8, "attnopt.cache_cli": 8,
    "attnopt": 9, "attnopt.__main__": 9,
}

#: Imports against the layering that stay, each with its reason. Keep this list at most two long.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def group(module: str) -> str:
    """The entry of ``LAYERS`` a module belongs to: itself, or its nearest listed package."""
    parts = module.split(".")
    while parts:
        name = ".".join(parts)
        if name in LAYERS:
            return name
        parts.pop()
    raise KeyError(module)


def imports(path: Path) -> list[tuple[str, int]]:
    """The attnopt modules ``path`` imports (for ``from X import y``: ``X.y`` when that is a module), with lines."""
    me = module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "attnopt" and not target.startswith("attnopt."):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (PACKAGE.parent / Path(*sub.split("."))).is_dir()
                out.append((sub if is_module else target, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "attnopt"]
    return out


def graph() -> dict[str, list[tuple[str, int]]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer() -> None:
    missing = [m for m in graph() if not any(m == g or m.startswith(g + ".") for g in LAYERS)]
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_imports_run_downward() -> None:
    upward = []
    for module, deps in graph().items():
        for dep, line in deps:
            src, dst = group(module), group(dep)
            same_package = src == dst or dep.startswith(module + ".")
            if same_package or LAYERS[dst] < LAYERS[src] or (module, dep) in ALLOWED_UPWARD:
                continue
            upward.append(f"{module}:{line} imports {dep} (layer {LAYERS[src]} -> {LAYERS[dst]})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)
    assert len(ALLOWED_UPWARD) <= 2


def test_no_import_circle() -> None:
    full = graph()
    g = {m: sorted({d for d, _ in deps if d in full}) for m, deps in full.items()}
    # a package's __init__ importing its own submodules is how packages are built, not a circle
    edges = {m: [d for d in ds if not d.startswith(m + ".")] for m, ds in g.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in edges.get(m, []):
            if state.get(d) == 1:
                pytest.fail("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_no_private_names_imported_across_modules() -> None:
    crossing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("attnopt")):
                crossing += [f"{module_name(path)}:{node.lineno} imports {a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossing, "private names imported from another module (make them public or move them):\n" + \
        "\n".join(crossing)
