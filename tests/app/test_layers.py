"""The one-way imports of docs/developers.md's "where things live" map, read from the source (every
import, also those inside functions), and no import cycle between modules."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("models", "audio", "app")

# layer -> the project layers it must not import
FORBIDDEN = {
    "models": ("audio", "app"),
    "audio": ("app", "models"),
    "app.runtime": ("app.commands", "app.offline", "app.gui", "app.cli", "app.serve"),
    "app.offline": ("app.commands", "app.gui", "app.cli", "app.bench"),
    "app.checkpoint": ("app.runtime", "app.offline", "app.gui", "app.serve", "app.bench", "app.commands", "app.cli"),
    "app.gui": ("app.commands", "app.offline", "app.cli", "app.serve"),
    "app.serve": ("app.commands", "app.offline", "app.gui", "app.cli"),
    "app.commands": ("app.cli",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Project modules ``path`` imports (relative imports resolved)."""
    me = module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    names = {module_name(p) for p in files}
    return {module_name(p): {m for m in imports(p) if m in names and m != module_name(p)} for p in files}


# third-party stacks -> the only package that may import them
CONFINED = {"PySide6": "app.gui", "pyqtgraph": "app.gui", "fastapi": "app.serve", "starlette": "app.serve",
            "uvicorn": "app.serve", "websockets": "app.serve"}


def test_qt_and_the_web_stack_stay_in_their_rooms():
    bad = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            mod = module_name(path)
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for name in names:
                    home = CONFINED.get(name.split(".")[0])
                    if home and not (mod == home or mod.startswith(home + ".")):
                        bad.append(f"{mod} imports {name}")
    assert not bad, bad


def test_layers_import_one_way():
    bad = []
    for mod, deps in graph().items():
        for layer, banned in FORBIDDEN.items():
            if mod == layer or mod.startswith(layer + "."):
                bad += [f"{mod} -> {d}" for d in deps if any(d == b or d.startswith(b + ".") for b in banned)]
    assert not bad, bad


def test_no_import_cycles():
    g = graph()
    # a package's __init__ importing its own submodules is how packages work; not a cycle
    edges = {m: {d for d in deps if not (d.startswith(m + ".") and (ROOT / m.replace(".", "/")).is_dir())}
             for m, deps in g.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in edges.get(m, ()):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"
    for m in edges:
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long


def test_ray_is_imported_only_with_ray(tmp_path):
    """`extract` without --ray (every command module loaded) never imports Ray."""
    import subprocess
    import sys

    import numpy as np
    import soundfile as sf
    (tmp_path / "g").mkdir()
    sf.write(tmp_path / "g" / "blues.00000.wav", 0.1 * np.sin(np.arange(16000) / 5.0), 16000)
    code = ("import sys; from app.cli import main; "
            f"code = main(['extract', '--gtzan', {str(tmp_path / 'g')!r}, '--out', {str(tmp_path / 't.npz')!r}, "
            "'--random-vggish']); print(code, 'ray' in sys.modules, 'ray.data' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["0", "False", "False"], r.stdout + r.stderr[-2000:]
