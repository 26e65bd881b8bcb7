"""The package's layers, read from the modules' own imports (docs/ARCHITECTURE.md).

Every ``import`` / ``from ... import`` of an ``icqs_fast`` module anywhere in a module (top level
or inside a function: a lazy import is still a dependency) must go to a lower layer or stay in
the module's own room (its sub-package); no module imports another module's private ``_name``;
and the graph of modules has no cycle. A new violation fails here, naming the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Low to high. A room is a module or a sub-package (prefix); the longest matching prefix wins.
LAYERS: list[tuple[str, ...]] = [
    ("icqs_fast.version", "icqs_fast.options", "icqs_fast.types", "icqs_fast.kernels",
     "icqs_fast._C", "icqs_fast.model_files"),
    ("icqs_fast.backends",),
    ("icqs_fast.ops", "icqs_fast.exact_forwards"),
    ("icqs_fast.torch_ops", "icqs_fast.metrics", "icqs_fast.progress", "icqs_fast.models",
     "icqs_fast.threads", "icqs_fast.io"),
    ("icqs_fast.engine",),
    ("icqs_fast.features", "icqs_fast.data"),
    ("icqs_fast.jobs", "icqs_fast.evals", "icqs_fast.report", "icqs_fast.allure",
     "icqs_fast.compat", "icqs_fast.serve"),
    ("icqs_fast.benchmarks", "icqs_fast.info"),
    ("icqs_fast.cli",),
    ("icqs_fast",),  # the package facade
]
# Upward imports still to remove, each with its reason; the list only shrinks.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()
# Compiled modules (no .py file): the optional pybind11 extension.
EXTENSIONS = {"icqs_fast._C"}
# io holds no torch and no argparse (it is read by tools that never load a model).
FORBIDDEN = {"icqs_fast.io": ("torch", "argparse", "transformers")}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in sorted((ROOT / "icqs_fast").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    for p in sorted((ROOT / "kernels").glob("*.py")):
        name = "icqs_fast.kernels" + ("" if p.stem == "__init__" else "." + p.stem)
        out[name] = (p, p.stem == "__init__")
    return out


MODULES = _modules()


def _room(mod: str) -> tuple[int, str]:
    best = None
    for level, rooms in enumerate(LAYERS):
        for r in rooms:
            if (mod == r or mod.startswith(r + ".")) and (best is None or len(r) > len(best[1])):
                best = (level, r)
    assert best is not None, f"{mod}: in no layer of tests/test_layers.py"
    return best


def _imports(mod: str) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) of every icqs_fast import in ``mod``."""
    path, is_pkg = MODULES[mod]
    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            for a in node.names:
                sub = f"{full}.{a.name}"
                if sub in MODULES or sub in EXTENSIONS:
                    out.append((node.lineno, sub, None))
                else:
                    out.append((node.lineno, full, a.name))
    return out


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for _, target, _ in _imports(m):
            if target in MODULES and target != m:
                edges[m].add(target)
    return edges


# A module that grows past this holds more than one thing: split it into files named for them.
MAX_MODULE_LINES = 800


def test_no_module_is_a_grab_bag():
    files = [*sorted((ROOT / "icqs_fast").rglob("*.py")), *sorted((ROOT / "kernels").glob("*.py"))]
    assert len(files) > 50
    big = {str(p.relative_to(ROOT)): n for p in files
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_every_module_is_in_a_layer():
    for m in MODULES:
        _room(m)


def test_imports_go_down_the_layers():
    bad = []
    for m in MODULES:
        level, room = _room(m)
        for line, target, _ in _imports(m):
            if not (target == "icqs_fast" or target.startswith("icqs_fast.")):
                continue
            if (m, target) in KNOWN_EXCEPTIONS:
                continue
            t_level, t_room = _room(target)
            if t_room == room or t_level < level:
                continue
            bad.append(f"{MODULES[m][0].name}:{line}: {m} (layer {level}, {room}) "
                       f"imports {target} (layer {t_level}, {t_room})")
    assert not bad, "imports that do not go down:\n" + "\n".join(bad)


def test_nothing_imports_the_cli_but_the_cli():
    bad = [f"{m} imports {t}" for m in MODULES for _, t, _ in _imports(m)
           if t.startswith("icqs_fast.cli") and not m.startswith("icqs_fast.cli")
           and (m, t) not in KNOWN_EXCEPTIONS]
    assert not bad, bad


def test_no_private_name_crosses_modules():
    bad = []
    for m in MODULES:
        for line, target, name in _imports(m):
            if name and name.startswith("_") and not name.startswith("__") and target != m \
                    and target.startswith("icqs_fast") and target != "icqs_fast":
                bad.append(f"{MODULES[m][0].relative_to(ROOT)}:{line}: {target}.{name}")
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_no_import_cycle():
    edges = _edges()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                cyc = visit(t)
                if cyc:
                    return cyc
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            cyc = visit(m)
            assert cyc is None, "import cycle: " + " -> ".join(cyc)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_forbidden_imports(room):
    bad = []
    for m, (path, _) in MODULES.items():
        if not (m == room or m.startswith(room + ".")):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad += [f"{m}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] in FORBIDDEN[room]]
    assert not bad, bad


def test_the_layer_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a fake engine module importing the CLI is reported."""
    fake = tmp_path / "fake.py"
    fake.write_text("from icqs_fast.cli import main\n")
    monkeypatch.setitem(MODULES, "icqs_fast.engine.fake", (fake, False))
    with pytest.raises(AssertionError, match="icqs_fast.engine.fake"):
        test_imports_go_down_the_layers()
