"""The package layout docs/design.md describes: packages by role, imports pointing one way.

Read from the source (no imports run): every `import`/`from ... import` inside prefetchd/, at
module level or inside functions, is an edge.
"""
import ast
import collections
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "prefetchd"
# The face (daemon, handle, ops, config...) and foundations every package may import (errors,
# dtypes, limits, socket_dirs: control and the shared host tier both bind unix sockets).
TOP_LEVEL_MODULES_AT_MOST = 13


def _modules():
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("prefetchd",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name, path, modules):
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("prefetchd"):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    yield sub if sub in modules else target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("prefetchd"):
                    yield alias.name


def _graph():
    modules = _modules()
    return modules, {m: {t for t in _imports(m, p, modules) if t in modules and t != "prefetchd"}
                     for m, p in modules.items()}


def _role(module):
    """The package a module belongs to (prefetchd/core/x.py -> core), or the top-level module's name."""
    return module.split(".")[1] if module.count(".") else ""


def _cycles(graph):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_form_a_cycle():
    _, graph = _graph()
    assert _cycles(graph) == []


def test_packages_import_one_way():
    """Between roles (packages and top-level modules) the imports form a DAG: no role imports one
    that imports it back, so every import points down one order."""
    _, graph = _graph()
    roles = collections.defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            if _role(a) and _role(b) and _role(a) != _role(b):
                roles[_role(a)].add(_role(b))
    assert _cycles(roles) == [], dict(roles)


def test_the_core_imports_none_of_its_adapters():
    _, graph = _graph()
    adapters = {"control", "serve", "hooks", "staging", "cli", "bench", "demo", "daemon", "attachments"}
    upward = sorted((m, t) for m, ts in graph.items() if _role(m) == "core" for t in ts if _role(t) in adapters)
    assert upward == []


def test_top_level_holds_only_the_face_and_foundations():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= TOP_LEVEL_MODULES_AT_MOST, top


def test_a_non_editable_install_ships_every_package(tmp_path):
    """`pip install .` (the README's demo command) ships what `-e` finds by path: every package
    under prefetchd/ is in the built wheel."""
    import subprocess
    import sys
    import zipfile
    import shutil
    root = PACKAGE.parent
    source = tmp_path / "src"             # a clean copy: a build/ left by build_ext would hide gaps
    shutil.copytree(root, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "*.so", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path),
                    str(source)], check=True, timeout=900, stdout=subprocess.DEVNULL)
    wheel, = tmp_path.glob("prefetchd-*.whl")
    shipped = {pathlib.PurePosixPath(n).parent for n in zipfile.ZipFile(wheel).namelist()
               if n.endswith("__init__.py")}
    packages = {pathlib.PurePosixPath(p.parent.relative_to(root).as_posix())
                for p in PACKAGE.rglob("__init__.py")}
    assert packages - shipped == set()
