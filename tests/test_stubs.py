"""The compiled core's stubs (cucopy/_segment.pyi) cover the built module, name by name.

mypy reads the stubs for ``cucopy._segment``; a name the C adds that the stubs lack is
invisible to it, and a name the stubs keep after the C drops it type-checks code that
fails at run time. These tests compare names only (the module's, each type's members
and methods), not the members' types, so they hold while a member's C type changes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

try:
    from cucopy import _segment as compiled
except ImportError:
    compiled = None

pytestmark = pytest.mark.skipif(
    compiled is None, reason="the compiled core (cucopy._segment) is not built"
)

STUB = Path(__file__).resolve().parents[1] / "cucopy" / "_segment.pyi"

#: names every type's __dict__ may hold that a stub does not declare: the docstring, and
#: the constructor's slots (checked apart, see test_a_type_with_its_own_init_...)
UNDECLARED = {"__doc__", "__module__", "__new__", "__init__", "__getattribute__"}
#: Py_TPFLAGS_BASETYPE: the type may be subclassed
BASETYPE = 1 << 10


def _decorators(node: ast.ClassDef | ast.FunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        if isinstance(d, ast.Attribute):
            names.add(d.attr)
        elif isinstance(d, ast.Name):
            names.add(d.id)
    return names


def _stub() -> tuple[dict[str, ast.FunctionDef], dict[str, ast.ClassDef]]:
    """The stub's module-level functions and classes, by name."""
    tree = ast.parse(STUB.read_text(), filename=str(STUB))
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    return funcs, classes


def _members(cls: ast.ClassDef) -> set[str]:
    """The names a stub class declares: methods, properties and annotated attributes."""
    names = set()
    for n in cls.body:
        if isinstance(n, ast.FunctionDef):
            names.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return names


def _compiled_names() -> set[str]:
    return {n for n in vars(compiled) if not (n.startswith("__") and n.endswith("__"))}


def _compiled_types() -> dict[str, type]:
    return {n: v for n, v in vars(compiled).items() if isinstance(v, type)}


def test_every_name_the_module_exports_is_declared():
    funcs, classes = _stub()
    missing = _compiled_names() - set(funcs) - set(classes)
    assert not missing, f"cucopy/_segment.pyi lacks {sorted(missing)}"


def test_every_function_and_class_the_stub_declares_exists():
    funcs, classes = _stub()
    for name in funcs:
        assert callable(getattr(compiled, name, None)), f"cucopy._segment.{name} is gone"
        assert not isinstance(getattr(compiled, name), type), name
    for name in classes:
        assert isinstance(getattr(compiled, name, None), type), f"cucopy._segment.{name} is gone"


def test_every_member_and_method_of_each_type_is_declared():
    _, classes = _stub()
    for name, tp in _compiled_types().items():
        declared = _members(classes[name])
        missing = set(vars(tp)) - UNDECLARED - declared
        assert not missing, f"cucopy/_segment.pyi: {name} lacks {sorted(missing)}"


def test_every_member_and_method_the_stub_declares_exists():
    _, classes = _stub()
    for name, node in classes.items():
        tp = getattr(compiled, name)
        for member in _members(node):
            if member == "__getattr__":
                # the stubs' spelling of a type whose tp_getattro forwards what it lacks
                assert tp.__getattribute__ is not object.__getattribute__, name
            else:
                assert hasattr(tp, member), f"cucopy._segment.{name}.{member} is gone"


def test_a_type_with_its_own_init_declares_its_constructor():
    _, classes = _stub()
    for name, tp in _compiled_types().items():
        if "__init__" in vars(tp):  # tp_init: it takes arguments the stub must name
            assert {"__init__", "__new__"} & _members(classes[name]), name


def test_final_in_the_stub_exactly_where_the_type_cannot_be_subclassed():
    _, classes = _stub()
    for name, tp in _compiled_types().items():
        final = "final" in _decorators(classes[name])
        assert final == (not tp.__flags__ & BASETYPE), (
            f"{name}: @final in cucopy/_segment.pyi, or a base type at run time (or neither)"
        )
