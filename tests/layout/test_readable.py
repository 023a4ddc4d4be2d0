"""One screen at a time (issue #25): no module of prefetchd/ over MODULE_LINES lines and no
class over CLASS_LINES, read from the source (nothing is imported). A file that grows past
the bound is split by role, not given an exception here."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "prefetchd"
MODULE_LINES = 450
CLASS_LINES = 300


def _sources():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_no_module_is_longer_than_the_bound():
    long = {str(p.relative_to(PACKAGE)): n for p in _sources()
            if (n := p.read_text().count("\n")) > MODULE_LINES}
    assert long == {}, f"modules over {MODULE_LINES} lines: {long}"


def test_no_class_is_longer_than_the_bound():
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                long[f"{p.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}, f"classes over {CLASS_LINES} lines: {long}"
