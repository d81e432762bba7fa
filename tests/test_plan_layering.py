"""The floors stay one-way, the plan floor stays pure, and the design document cannot drift.

* dpkfac's import graph between its sub-packages and top-level modules has no
  cycle, nor between any two of its modules, counting imports inside functions
  (only ``if TYPE_CHECKING:`` ones are exempt);
* the plan floor (``dpkfac/plan``) imports the standard library and itself only;
* no module outside ``dpkfac/preconditioner.py`` touches one of the
  preconditioner's private members;
* the role table in ``docs/design.md`` is what the plans say
  (``python -m dpkfac.plan`` prints it).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from dpkfac.plan.describe import role_table

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dpkfac"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules a file imports, anywhere in it except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(sub) for sub in ast.walk(node)}
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _unit(module: str) -> str:
    """A sub-package (dpkfac.strategies) or a top-level module (dpkfac.overlap)."""
    return ".".join(module.split(".")[:2])


def _graph() -> dict[str, set[str]]:
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        src = _unit(_module_name(path))
        for target in _imports(path):
            dst = _unit(target)
            if target.startswith("dpkfac.") and dst in units and dst != src:
                edges.setdefault(src, set()).add(dst)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return [*stack[stack.index(v) :], v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(edges):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_the_package_import_graph_has_no_cycle() -> None:
    edges = _graph()
    assert _cycle(edges) is None, " -> ".join(_cycle(edges) or [])
    # The floors, bottom to top, as the design document draws them.
    assert "dpkfac.strategies" not in edges.get("dpkfac.costmodel", set())
    assert "dpkfac.costmodel" not in edges.get("dpkfac.strategies", set())
    # The preconditioner is the top floor: only the package's front door imports it.
    importers = {s for s, ds in edges.items() if "dpkfac.preconditioner" in ds}
    assert importers <= {"dpkfac"}, importers


@pytest.mark.parametrize("package", ["dpkfac", "experiments"])
def test_no_two_modules_import_each_other_even_within_a_subpackage(package: str) -> None:
    """Below the sub-package level too, in the library and in the experiments (a
    subpackage's ``__init__`` re-exports are left out: they import their own modules by
    design)."""
    files = (ROOT / package).rglob("*.py")
    modules = {_module_name(p): p for p in files if p.name != "__init__.py"}
    edges = {
        name: {t for t in _imports(path) if t in modules and t != name}
        for name, path in modules.items()
    }
    assert _cycle(edges) is None, " -> ".join(_cycle(edges) or [])


def test_a_cycle_is_found() -> None:
    """The checker itself: a cycle through a function-local import is reported."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_plan_floor_imports_the_standard_library_and_itself_only() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for path in (PACKAGE / "plan").rglob("*.py"):
        for module in _imports(path):
            top = module.split(".")[0]
            assert top in stdlib or module.startswith("dpkfac.plan"), (
                f"{path.relative_to(ROOT)} imports {module}"
            )


def test_the_plan_floor_holds_models_not_fits() -> None:
    """Fitting measured samples lives beside the measurement (``dpkfac.probes``) or in the
    cost model (``dpkfac.costmodel.fitting``); the plan floor only holds what was fitted."""
    for path in (PACKAGE / "plan").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = node.name.lstrip("_")
                assert not name.startswith(("fit", "calibrate", "nnls", "lstsq")), (
                    f"{path.relative_to(ROOT)} defines {node.name}"
                )


def _private_members() -> set[str]:
    """Names of the preconditioner's private attributes and methods."""
    tree = ast.parse((PACKAGE / "preconditioner.py").read_text())
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KFACPreconditioner"
    )
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
        ):
            names.add(node.attr)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def test_no_module_touches_the_preconditioners_private_members() -> None:
    private = _private_members()
    assert {"_fidelity", "_decompose", "_timer", "_params"} <= private
    found = []
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]
    for path in paths:
        if path == PACKAGE / "preconditioner.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not found, found


def test_the_design_documents_role_table_is_generated_from_the_plans() -> None:
    text = (ROOT / "docs" / "design.md").read_text()
    start = "<!-- roles: generated by python -m dpkfac.plan -->\n"
    end = "<!-- /roles -->"
    assert start in text and end in text, "docs/design.md lacks the role table markers"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == role_table(), "regenerate it: python -m dpkfac.plan"
