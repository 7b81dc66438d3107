"""The package's structure: every module imports on its own in a fresh interpreter (no
import circle hides behind an import order), and the imports form no circle."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import lora_graph

PACKAGE = Path(lora_graph.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages(lora_graph.__path__, "lora_graph."))


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """In one fresh interpreter (torch and the other libraries imported once), each module
    of the package imported with no other module of the package loaded before it."""
    code = (
        "import importlib, sys, torch, transformers\n"
        "bad = []\n"
        f"for m in {MODULES!r}:\n"
        "    for k in [k for k in sys.modules if k.split('.')[0] == 'lora_graph']:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        bad.append((m, repr(e)))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    assert "lora_graph.models.llama" in MODULES and "lora_graph.compile.cache" in MODULES


def _module_imports(path: Path, name: str) -> set[str]:
    """The project modules ``path`` imports, anywhere in it (an import deferred into a
    function is still a dependency: deferring it only hides a circle)."""
    found: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            if n.module.startswith("lora_graph"):
                found.add(n.module)
                found.update(f"{n.module}.{a.name}" for a in n.names)
        elif isinstance(n, ast.Import):
            found.update(a.name for a in n.names if a.name.startswith("lora_graph"))
    return found & set(MODULES) - {name}


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        rel = name.removeprefix("lora_graph.").replace(".", "/")
        path = PACKAGE / f"{rel}.py"
        if not path.exists():
            path = PACKAGE / rel / "__init__.py"
        graph[name] = _module_imports(path, name)
    # a module importing from its own package (``lora_graph.server.app`` from
    # ``lora_graph.server.protocol``) does not go through the package's __init__ here
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_models_and_lower_floors_import_nothing_from_the_runner():
    """The modules of ``lora_graph.models`` (plain ``nn.Module`` and configs), the kernels
    and the compile cache reach nothing above them, even through another module: not the
    runner, the LoRA manager, the engine, the server or the command line."""
    graph = _import_graph()
    above = {
        "lora_graph.pipeline",
        "lora_graph.architectures",
        "lora_graph.manager",
        "lora_graph.engine",
        "lora_graph.scheduler",
        "lora_graph.server",
        "lora_graph.launch",
        "lora_graph.cli",
    }
    below = [m for m in MODULES if m.startswith(("lora_graph.models", "lora_graph.kernels"))]
    below += ["lora_graph.compile.cache", "lora_graph.memory", "lora_graph.loading.model_files"]
    assert len(below) > 10
    for name in below:
        reached = _reachable(graph, name)
        bad = {d for d in reached if any(d == a or d.startswith(a + ".") for a in above)}
        assert not bad, f"{name} reaches {sorted(bad)}"


def test_imports_form_no_circle():
    graph = _import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in graph[node]:
            if state.get(dep) == 1:
                circle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)
