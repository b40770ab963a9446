"""The package's shape: stages import only the stages below them, and no module imports itself
back through others (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specrt"
# What each stage may import from specrt (besides itself). The runtime is what services embed,
# so it stays below export (torch) and above nothing but backends and the bundle contract.
BASE = {
    "specrt",
    "specrt.errors",
    "specrt.bundle",
    "specrt.prompts",
    "specrt.staging",
    "specrt.validation",
    "specrt.json_text",  # JSON a user wrote, read with one line for what Python cannot hold
    "specrt.checksums",
    "specrt.chat",  # chat templates, for the server's chat route and batch jobs' chat lines
    "specrt.openai_shapes",  # OpenAI's bodies, for the server and batch jobs' OpenAI output
    "specrt.openai_structured",  # ... their structured-output fields
    "specrt.openai_tools",  # ... and their tools (the server's chat route)
    "specrt.openai_token_ids",  # ... and vLLM's token-id fields
    "specrt.structured",  # what a structured output asks for (a config's value)
}
ALLOWED = {
    "base": BASE,
    "backends": BASE,
    "runtime": BASE | {"backends"},
    "export": BASE | {"backends"},
    "distill": BASE | {"export"},  # the draft is read and written as export reads checkpoints
    "bench": BASE | {"backends", "runtime"},
    "jobs": BASE | {"backends", "runtime"},
    "serve": BASE | {"backends", "runtime"},
    "cli": BASE | {"backends", "runtime", "export", "distill", "bench", "jobs", "serve"},
}
# Third-party packages a stage must not import (they belong to extras).
EXTRAS = {"torch", "transformers", "optimum", "onnx", "ray", "fastapi", "starlette", "uvicorn"}
FORBIDDEN = {"backends": EXTRAS, "runtime": EXTRAS}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "cli" if module in ("specrt.cli", "specrt.__main__") else "base"


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def specrt_imports(module: str) -> set[str]:
    return {m for m in imports(MODULES[module]) if m in MODULES and m != module}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_stages_import_only_lower_stages(module):
    own = stage(module)
    allowed = ALLOWED[own] | {own}
    for imported in specrt_imports(module):
        target = stage(imported)
        assert target in allowed or imported in BASE, f"{module} imports {imported}"
    third_party = {m.split(".")[0] for m in imports(MODULES[module])}
    assert not third_party & FORBIDDEN.get(own, set()), module


def test_no_import_cycles():
    graph = {module: specrt_imports(module) for module in MODULES}
    # A package's __init__ importing its own submodules is how Python packages work, not a cycle.
    for module in graph:
        graph[module] = {m for m in graph[module] if not m.startswith(module + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                cycle = path[path.index(imported) :] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_checks_see_a_violation(tmp_path):
    """The walker finds imports inside functions (how circles used to be closed)."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from specrt.export.pipeline import export_bundle\n")
    assert "specrt.export.pipeline" in imports(source)
    assert stage("specrt.runtime.generator") == "runtime"
    assert "export" not in ALLOWED["runtime"]


def test_the_public_api_is_at_the_package_root():
    """`from specrt import ...` for what a user needs, each name its module's own object, and
    `import specrt` alone loads none of it (no onnxruntime for the export commands' start)."""
    import subprocess
    import sys

    import specrt
    from specrt.runtime.batching import Request
    from specrt.runtime.generator import SpeculativeGenerator

    wanted = {"SpeculativeGenerator", "GenerationConfig", "Request", "Service", "run_batch"}
    assert wanted <= set(specrt.__all__)
    for name in specrt.__all__:
        assert getattr(specrt, name) is not None, name
    assert specrt.SpeculativeGenerator is SpeculativeGenerator and specrt.Request is Request
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        specrt.nothing  # noqa: B018
    probe = "import specrt, sys; print('onnxruntime' in sys.modules, 'numpy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split() == ["False", "False"], done.stderr


MAX_MODULE_LINES = 450
# Modules still over the ceiling, to be split: the set may only shrink (empty now).
OVERSIZE: set[str] = set()


def test_modules_stay_small():
    """A module holds one thing: none of specrt/ runs past MAX_MODULE_LINES lines."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    over = {name for name, size in sizes.items() if size > MAX_MODULE_LINES}
    assert over <= OVERSIZE, {name: sizes[name] for name in over - OVERSIZE}
    assert not {name for name in OVERSIZE if sizes.get(name, 0) <= MAX_MODULE_LINES}, (
        "split already: take it off OVERSIZE"
    )
