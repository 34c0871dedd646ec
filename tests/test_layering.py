"""The layers of DESIGN.md: imports point down only, and no file or function grows past
the limits the project set itself (500 lines a file, 120 a function, in ``src/``).

Every import statement of every module is read (top-level, inside functions, and under
``TYPE_CHECKING``), so a late import that reaches up is caught like any other.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import attnlab

SRC = Path(attnlab.__file__).parent

#: Lower number = lower layer (DESIGN.md, "The layers").
LAYERS = {
    "functional": 0,
    "counting": 0,
    "_validate": 0,
    "_files": 0,
    "errors": 0,
    "backend_traits": 0,
    "backends": 1,
    "cache": 2,
    "modules": 3,
    "models": 4,
    "interop": 5,
    "generation": 5,
    "analysis": 6,
    "viz": 6,
    "train": 6,
    "serving": 7,
    "experiments": 7,
    "cli": 8,
}

#: Upward references that are names, not dependencies of the layer, each with its reason.
ALLOWED = {
    # a model's generate()/stream() methods are the generation loop's, called on the model
    ("attnlab.models.lm_shell", "attnlab.generation.generate"),
    ("attnlab.models.seq2seq", "attnlab.generation.generate"),
}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "attnlab" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def _modules() -> list[tuple[str, Path]]:
    out = []
    for f in sorted(SRC.rglob("*.py")):
        name = "attnlab." + ".".join(f.relative_to(SRC).with_suffix("").parts)
        out.append((name.removesuffix(".__init__"), f))
    return out


def test_every_package_is_placed_in_a_layer() -> None:
    unplaced = {m.split(".")[1] for m, _ in _modules() if m != "attnlab" and _layer(m) is None}
    assert not unplaced, f"packages missing from LAYERS (and DESIGN.md): {sorted(unplaced)}"


def test_imports_point_down_only() -> None:
    upward = set()
    for name, path in _modules():
        mine = _layer(name)
        if mine is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                theirs = _layer(target)
                if theirs is not None and theirs > mine and (name, target) not in ALLOWED:
                    upward.add((name, target))
    assert not upward, f"imports that point up a layer: {sorted(upward)}"


def _import_time(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements run when the module is imported: at module level or in a
    class body, inside ``if``/``try``/``with`` blocks, never in a function or under
    ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            else:
                visit([n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)])

    visit(tree.body)
    return found


def _package_graph() -> dict[str, set[str]]:
    """``attnlab.X -> {attnlab.Y, ...}``: the packages (or top-level modules) each one
    imports at import time, relative imports resolved."""
    modules = dict(_modules())
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _import_time(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                # ``from attnlab import x`` imports the package attnlab.x
                targets = [f"{base}.{a.name}" for a in node.names] if base == "attnlab" else [base]
            for target in targets:
                mine, theirs = name.split(".")[:2], target.split(".")[:2]
                if theirs[0] == "attnlab" and len(theirs) == 2 and mine != theirs:
                    graph.setdefault(".".join(mine), set()).add(".".join(theirs))
    return graph


def test_no_import_cycle_between_packages() -> None:
    """Importing any package never needs a package that (directly or not) needs it back.

    The upward names that :data:`ALLOWED` lists are looked up at call time (inside a
    function, or PEP 562's module ``__getattr__``), so they are no edge of this graph.
    """
    graph = _package_graph()
    assert "attnlab.backends" not in graph.get("attnlab.functional", set())
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def cycle_from(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := cycle_from(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = cycle_from(start)
            assert cycle is None, f"import cycle between packages: {' -> '.join(cycle)}"


def test_public_attention_name_lives_at_the_root() -> None:
    """``attnlab.functional`` imports none of the backends and no longer names the public
    call: reading the old name says where it went. The root resolves it on first use to
    the backends' function, ``from attnlab import ...`` too, and ``import attnlab`` alone
    loads no torch."""
    code = (
        "import sys\n"
        "import attnlab\n"
        "assert 'torch' not in sys.modules\n"
        "import attnlab.functional as F\n"
        "assert 'attnlab.backends' not in sys.modules, sorted(sys.modules)\n"
        "try:\n"
        "    F.scaled_dot_product_attention\n"
        "except AttributeError as e:\n"
        "    assert 'attnlab.scaled_dot_product_attention' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('the old name still resolves')\n"
        "assert 'attnlab.backends' not in sys.modules\n"
        "from attnlab import scaled_dot_product_attention as sdpa\n"
        "from attnlab.backends.api import scaled_dot_product_attention\n"
        "import attnlab.backends\n"
        "assert sdpa is scaled_dot_product_attention is attnlab.scaled_dot_product_attention\n"
        "assert sdpa is attnlab.backends.scaled_dot_product_attention\n"
        "assert 'scaled_dot_product_attention' in dir(attnlab)\n"
        "for mod in (attnlab, F):\n"
        "    try:\n"
        "        mod.no_such_name\n"
        "    except AttributeError as e:\n"
        "        assert 'no_such_name' in str(e)\n"
        "    else:\n"
        "        raise AssertionError('no AttributeError')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr


#: The limits the project set itself: no file in ``src/`` over 500 lines and no function
#: over 120. Every file and function once over them has been split; none may grow back.
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 120


def test_no_file_over_500_lines_and_no_function_over_120() -> None:
    too_long = []
    for _, path in _modules():
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_long.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}: {node.name}() {n} lines")
    assert not too_long, f"over the size limits (split them): {too_long}"
