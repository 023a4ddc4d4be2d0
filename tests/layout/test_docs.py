"""Every path and module name README.md, docs/*.md and native/API.md cite exists in the tree.

The package moves (issue #25: loose modules into hooks/, cost/, telemetry/, demo/), and docs that
still name `prefetchd/plan.py` or `prefetchd.timeline` send a reader to nothing. Read from the
source (nothing is imported): a dotted name resolves to its longest module prefix (a .py file, a
package, or the native extension setup.py builds), then its next name must be defined at that
module's top level (def, class, assignment, import, or a string a lazy `__getattr__` module
lists), and a name after a class must be defined in that class's body.

Checked:
- `prefetchd/....py` paths, and `core/x.py`-style paths relative to the package (a role
  folder of prefetchd/ first);
- `tests/....py` paths, with a `::test_name` after them naming a function in that file;
- `native/...` paths;
- `prefetchd.<module>[.<name>[.<name>]]` dotted names.
Not checked: bare file names (`refine.py`) and names relative to a module (`plan.refined`, a
JSON key); those depend on the sentence around them.
"""
import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prefetchd"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "native" / "API.md"]

ROLES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
# Not preceded by a word character, a slash or a dot: `/run/prefetchd/serve.sock` and
# `dashboards/prefetchd.json` are not references into the package.
_NOT_AFTER = r"(?<![\w/.\-])"
PACKAGE_PATH = re.compile(_NOT_AFTER + r"prefetchd/[\w/]+\.py\b")
ROLE_PATH = re.compile(_NOT_AFTER + r"(?:" + "|".join(ROLES) + r")/[\w/]+\.py\b")
TEST_PATH = re.compile(_NOT_AFTER + r"(tests/[\w/]+\.py)(?:::(\w+))?")
NATIVE_PATH = re.compile(_NOT_AFTER + r"native/[\w/]+\.(?:cpp|cc|h|md)\b")
DOTTED = re.compile(_NOT_AFTER + r"prefetchd(?:\.[A-Za-z_]\w*)+")


def _module_file(dotted):
    """The source of module `prefetchd.a.b` (a .py file or a package's __init__.py), or None."""
    rel = pathlib.Path(*dotted.split("."))
    for candidate in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _native_extension(dotted):
    return dotted == "prefetchd._native" and '"prefetchd._native"' in (ROOT / "setup.py").read_text()


def _body_names(body, lazy_strings):
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
            if lazy_strings and node.value is not None:
                names.update(c.value for c in ast.walk(node.value)
                             if isinstance(c, ast.Constant) and isinstance(c.value, str))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
    return names


@functools.lru_cache(maxsize=None)
def _top_level(path):
    """(names defined at the top of `path`, {class name: names its body defines})."""
    tree = ast.parse(path.read_text())
    lazy = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
    classes = {n.name: _body_names(n.body, False) for n in tree.body if isinstance(n, ast.ClassDef)}
    return _body_names(tree.body, lazy), classes


def dotted_name_problem(name):
    """Why `prefetchd.x.y` names nothing in the tree, or None if it resolves."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        rest = parts[cut:]
        if _native_extension(module):
            sources = "".join(p.read_text() for p in (ROOT / "native" / "src").glob("*.cpp"))
            if rest and f'"{rest[0]}"' not in sources:
                return f"{module} (the native extension) binds no {rest[0]!r}"
            return None
        path = _module_file(module)
        if path is None:
            continue
        if not rest:
            return None
        names, classes = _top_level(path)
        if rest[0] not in names:
            return f"{module} ({path.relative_to(ROOT)}) defines no {rest[0]!r}"
        if len(rest) > 1 and rest[0] in classes and rest[1] not in classes[rest[0]]:
            return f"{module}.{rest[0]} ({path.relative_to(ROOT)}) defines no {rest[1]!r}"
        return None
    return "no such module"


def problems(text):
    """Every stale reference in one document's text, as 'what: why' lines."""
    out = []
    for match in PACKAGE_PATH.finditer(text):
        if not (ROOT / match.group()).is_file():
            out.append(f"{match.group()}: no such file")
    for match in ROLE_PATH.finditer(text):
        if not (PACKAGE / match.group()).is_file():
            out.append(f"{match.group()}: no such file under prefetchd/")
    for match in TEST_PATH.finditer(text):
        path, test = ROOT / match.group(1), match.group(2)
        if not path.is_file():
            out.append(f"{match.group(1)}: no such file")
        elif test and not re.search(rf"^\s*def {test}\(", path.read_text(), re.M):
            out.append(f"{match.group()}: no such test in {match.group(1)}")
    for match in NATIVE_PATH.finditer(text):
        if not (ROOT / match.group()).is_file():
            out.append(f"{match.group()}: no such file")
    for match in DOTTED.finditer(text):
        why = dotted_name_problem(match.group())
        if why:
            out.append(f"{match.group()}: {why}")
    return out


def test_every_path_and_module_name_in_the_docs_exists():
    stale = [f"{doc.relative_to(ROOT)}: {line}" for doc in DOCS for line in problems(doc.read_text())]
    assert not stale, "stale references in the docs:\n" + "\n".join(stale)


def test_the_check_finds_wrong_paths_and_names():
    # Each of these is wrong in one way; the check must name every one.
    wrong = ["prefetchd/plan.py", "hooks/nothing_here.py", "tests/layout/test_nothing.py",
             "tests/layout/test_docs.py::test_no_such_test", "native/src/nothing.cpp",
             "prefetchd.timeline", "prefetchd.cost.model.Plan", "prefetchd.cost.model.Inputs.no_field",
             "prefetchd._native.NoSuchClass", "prefetchd.no_such_name"]
    found = problems("\n".join(f"`{w}`" for w in wrong))
    assert len(found) == len(wrong), found
    for w in wrong:
        assert [line for line in found if line.startswith(w + ": ")], (w, found)


def test_the_check_accepts_what_exists():
    right = ["prefetchd/cost/model.py", "core/homes.py", "tests/layout/test_docs.py",
             "tests/layout/test_docs.py::test_the_check_accepts_what_exists", "native/src/bulk_copy.cpp",
             "prefetchd.offload", "prefetchd.ops", "prefetchd.serve.TensorSpec", "prefetchd.cost.model.Schedule",
             "prefetchd.cost.model.Inputs.copy_contention", "prefetchd._native.Arena",
             "/run/prefetchd/serve.sock", "dashboards/prefetchd.json"]
    assert problems("\n".join(f"`{r}`" for r in right)) == []
