"""The device rule, checked statically: every tensor factory in dpkfac/ names its device.

A tensor made without ``device=`` lands on the CPU. On a GPU run it then either
fails where it meets layer data, hands a CPU tensor to NCCL, or copies host to
device on every call, and none of that shows on a CPU-only test suite. So
every call of a factory below in ``dpkfac/`` passes ``device=``, unless the
allow-list names the call (file, enclosing function, factory) with the reason
it may live on the CPU. ``*_like`` factories and ``Tensor.new_*`` inherit
their device and are not factories here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dpkfac"
FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "eye",
        "linspace",
        "logspace",
        "rand",
        "randn",
        "randint",
        "randperm",
        "triu_indices",
        "tril_indices",
    }
)

#: (path under dpkfac/, enclosing function, factory) -> why it may stay on the CPU.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("costmodel/calibration.py", "_rank", "zeros"): (
        "gloo link calibration in its own CPU processes: the buffers never meet a GPU"
    ),
    ("costmodel/calibration.py", "_factor_samples", "randn"): (
        "measure_compute calibrates this machine's CPU kernels (the cpu_* presets): CPU "
        "layers, CPU inputs from a seeded CPU generator"
    ),
    ("costmodel/calibration.py", "measure_compute", "randn"): (
        "measure_compute calibrates this machine's CPU kernels: inputs from a seeded CPU generator"
    ),
    ("costmodel/calibration.py", "measure_compute", "rand"): (
        "measure_compute calibrates this machine's CPU kernels: inputs from a seeded CPU generator"
    ),
    ("probes.py", "measure_in_group", "randn"): (
        "seeded CPU generator for the same start-up eigh probe on every rank; moved to the "
        "run's device (.to(device)) before it is timed"
    ),
}


def _tensor_factory(node: ast.Call) -> str | None:
    """``X`` for a call ``torch.X(...)`` of a factory, else None."""
    func = node.func
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "torch"
        and func.attr in FACTORIES
    ):
        return func.attr
    return None


def factory_calls() -> list[tuple[str, str, str, int, bool]]:
    """Every factory call in dpkfac/: (path, function, factory, line, has device=)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        stack: list[tuple[ast.AST, str]] = [(tree, "<module>")]
        while stack:
            node, function = stack.pop()
            for child in ast.iter_child_nodes(node):
                name = function
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = child.name
                if isinstance(child, ast.Call) and (factory := _tensor_factory(child)):
                    has_device = any(k.arg == "device" for k in child.keywords)
                    found.append((rel, name, factory, child.lineno, has_device))
                stack.append((child, name))
    return found


def test_the_scan_finds_the_factories_it_should() -> None:
    calls = factory_calls()
    # The kernels' tables and the triangle indices are made on the data's device.
    assert ("curvature/factors.py", "_mask", "tensor") in {c[:3] for c in calls if c[4]}
    assert ("comm.py", "build", "triu_indices") in {c[:3] for c in calls if c[4]}
    assert len(calls) > 20


def test_every_factory_names_its_device() -> None:
    offenders = [
        f"dpkfac/{path}:{line} torch.{factory}(...) in {function}() has no device="
        for path, function, factory, line, has_device in factory_calls()
        if not has_device and (path, function, factory) not in ALLOWED
    ]
    assert not offenders, "\n".join(offenders)


def test_every_allowed_entry_is_used_and_has_a_reason() -> None:
    used = {c[:3] for c in factory_calls() if not c[4]}
    for key, reason in ALLOWED.items():
        assert key in used, f"allow-list entry {key} matches no call without device= any more"
        assert len(reason.split()) >= 5, f"allow-list entry {key} needs a reason"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("torch.zeros(3)", False),
        ("torch.zeros(3, device=x.device)", True),
        ("torch.zeros_like(x)", None),
        ("x.new_zeros(3)", None),
    ],
)
def test_the_scan_reads_calls_as_meant(source: str, expected: bool | None) -> None:
    call = ast.parse(source).body[0].value
    assert isinstance(call, ast.Call)
    if expected is None:
        assert _tensor_factory(call) is None
    else:
        assert _tensor_factory(call) is not None
        assert any(k.arg == "device" for k in call.keywords) is expected
