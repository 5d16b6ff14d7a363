"""docs/architecture.md names every module of kvobserve/ in its layer, and nothing that is none."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "kvobserve"
MODULE = re.compile(r"(?<![\w/.])(\w+\.py)\b")
PATH = re.compile(r"(?<![\w/.<])((?:\w+/)+\w+\.py)\b")


def _defines_something(path: Path) -> bool:
    """A class, a function or a name other than a dunder: more than a package's face."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and not t.id.startswith("__") for t in targets):
                return True
    return False


def _modules() -> set[str]:
    """Every module of kvobserve/ as a path under it; a package's __init__.py only when it
    holds code of its own."""
    return {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or _defines_something(p)
    }


def _named(text: str) -> set[str]:
    """The modules the layer list (the first code block) and the simulator's paragraph name,
    as paths under kvobserve/: a line that starts with `kvobserve/<pkg>/` opens a package, and
    every `name.py` until the next one is a module of it; the simulator's paragraph names its
    modules bare and those of its subpackages by their paths (`simulate/engines/...`)."""
    block = text.split("```")[1]
    named: set[str] = set()
    package = ""
    for line in block.splitlines():
        head = re.match(r"kvobserve/((?:\w+/)*)(\w+\.py)?", line)
        if head:
            package = head.group(1)
            line = line[head.end() :]
            if head.group(2):
                named.add(head.group(2))
        named.update(package + m for m in MODULE.findall(line))
    (simulator,) = [p for p in text.split("\n\n") if p.startswith("`kvobserve/simulate/`")]
    named.update("simulate/" + m for m in MODULE.findall(simulator))
    named.update(p for p in PATH.findall(simulator) if p.startswith("simulate/"))
    return named


def test_every_module_is_named_in_its_layer() -> None:
    named, modules = _named(DOC.read_text()), _modules()
    assert not modules - named, f"modules docs/architecture.md does not name: {modules - named}"
    assert not named - modules, f"named in docs/architecture.md, not modules: {named - modules}"


def test_every_path_in_the_doc_is_a_file() -> None:
    """`analysis/conditions.py`, `tests/unit/...py`: under kvobserve/ or the repository."""
    paths = set(PATH.findall(DOC.read_text()))
    assert paths, "no paths found"
    missing = {p for p in paths if not ((PACKAGE / p).is_file() or (ROOT / p).is_file())}
    assert not missing, missing


def test_the_check_sees_a_module_missing_from_the_list() -> None:
    """The parser reads what the list says: drop a name and it is missing."""
    text = DOC.read_text()
    assert "analysis/conditions.py" in _named(text)
    cut = text.replace("conditions.py (what is", "(what is", 1)
    assert "analysis/conditions.py" not in _named(cut)
