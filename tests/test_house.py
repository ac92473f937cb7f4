"""The house stays as drawn: import arrows point one way, and no module uses another's private names.

Walks every module of the installed packages (``[tool.setuptools] package-dir`` in pyproject.toml) with
``ast`` - every import statement, at module level, inside functions and under ``TYPE_CHECKING`` alike,
since a lazy or type-only import still ties the two modules together - and fails on:

- a cycle of imports between modules (so shared types and helpers live where both sides import them
  downward);
- a name starting with ``_`` imported from another module (it becomes a public name with a docstring,
  or the code moves to where the name lives);
- a private module (``_name.py``) imported from outside its own package;
- an attribute starting with ``_`` read from a project object other than ``self`` / ``cls`` (the
  same rule for ``obj._lock`` as for ``from m import _lock``), except a private module reached as
  ``package._module``.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# attributes of other libraries' objects that are named with an underscore by those libraries
FOREIGN_PRIVATE = {
    "_int_mm",  # torch._int_mm: torch's int8 matrix product
    "_Options",  # ProcessGroupGloo._Options: gloo's option struct
    "_timeout", "_devices",  # fields of gloo's option struct
    "_numba_type_",  # numba's typed containers
    "_asdict", "_replace", "_fields", "_make",  # namedtuple's public API
    "_exit",  # os._exit: the documented exit without the interpreter's teardown
}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def _modules() -> dict[str, Module]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    roots = {pkg: ROOT / d for pkg, d in cfg.items()}
    out: dict[str, Module] = {}
    for pkg, d in roots.items():
        for p in sorted(d.rglob("*.py")):
            parts = list(p.relative_to(d).with_suffix("").parts)
            name = ".".join([pkg, *parts])
            if parts[-1] == "__init__":
                name = name.rpartition(".")[0]
            out[name] = Module(name, p)
    return out


MODULES = _modules()


def _resolve(mod: Module, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


@dataclass(frozen=True)
class Import:
    src: str
    dst: str  # the module imported from (or imported)
    name: str | None  # the name taken from it, None for ``import dst`` / a module
    line: int


def _imports(mod: Module) -> list[Import]:
    tree = ast.parse(mod.path.read_text(), str(mod.path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node.level, node.module)
            if target.split(".")[0] != "weaved":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:  # ``from package import module``
                    out.append(Import(mod.name, sub, None, node.lineno))
                elif target in MODULES:
                    out.append(Import(mod.name, target, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    out.append(Import(mod.name, a.name, None, node.lineno))
    return out


IMPORTS = [i for m in MODULES.values() for i in _imports(m)]


def test_the_walk_sees_the_house():
    # the walk itself must see the code, or every check below passes vacuously
    assert {"weaved.engine.engine", "weaved.kernels.matmul", "weaved.cli.app", "weaved.tui.app"} <= set(MODULES)
    assert len(IMPORTS) > 300


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_modules():
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        # a package's __init__ importing its own modules is how packages work, not a cycle of ideas
        if i.src != i.dst and not i.dst.startswith(i.src + "."):
            edges.setdefault(i.src, set()).add(i.dst)
    assert _cycles(edges) == []


def test_no_private_names_imported_from_another_module():
    bad = [f"{i.src}:{i.line} takes {i.name} from {i.dst}" for i in IMPORTS
           if i.name is not None and i.name.startswith("_") and not i.name.startswith("__")]
    assert bad == []


def test_private_modules_stay_in_their_package():
    bad = []
    for i in IMPORTS:
        leaf = i.dst.rpartition(".")[2]
        if leaf.startswith("_") and not leaf.startswith("__") and MODULES[i.dst].package != MODULES[i.src].package:
            bad.append(f"{i.src}:{i.line} imports {i.dst}")
    assert bad == []


@pytest.mark.parametrize("mod", sorted(MODULES), ids=str)
def test_no_private_attributes_of_other_objects(mod):
    m = MODULES[mod]
    tree = ast.parse(m.path.read_text(), str(m.path))
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if node.attr in FOREIGN_PRIVATE:
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue  # a subclass overriding its base's hook
        bad.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    assert bad == []


def test_every_package_is_listed_for_installation():
    # a package missing from [tool.setuptools] packages would be left out of a wheel
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m.name for m in MODULES.values() if m.is_package}
    assert packages - listed == set()
