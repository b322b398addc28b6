"""Exit codes: one IntEnum, one meaning per code, used by every error class; the runbooks' table is
generated from it (httpie's ExitStatus and test_exit_status.py)."""

import importlib
import pkgutil
import re
from pathlib import Path

import dflash_ops
from dflash_ops.errors import DflashOpsError, ExitStatus, exit_code_table

ROOT = Path(__file__).resolve().parents[2]


def all_error_classes() -> list[type]:
    for mod in pkgutil.walk_packages(dflash_ops.__path__, "dflash_ops."):
        importlib.import_module(mod.name)
    found, todo = [], [DflashOpsError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_error_class_names_an_exit_status():
    classes = all_error_classes()
    assert {"DoctorFailed", "NotLossless", "DeployError", "SandboxError", "ChecksumMismatch",
            "FanOutFailed", "HostKeyChanged"} <= {c.__name__ for c in classes}
    for cls in classes:
        assert type(cls.exit_status) is ExitStatus, f"{cls.__module__}.{cls.__name__}: {cls.exit_status!r}"
        assert "exit_code" not in vars(cls), f"{cls.__name__} defines exit_code: use exit_status"


def test_one_meaning_per_code():
    # @unique refuses aliases; two meanings for one code would have to be one member.
    assert len({s.value for s in ExitStatus}) == len(ExitStatus)
    assert len({s.meaning for s in ExitStatus}) == len(ExitStatus)
    # Classes that share a code share a family: fan-out failure and "not lossless" were both 8.
    by_code: dict[int, set[str]] = {}
    for cls in all_error_classes():
        by_code.setdefault(int(cls.exit_status), set()).add(cls.exit_status.name)
    assert all(len(names) == 1 for names in by_code.values()), by_code
    fan_out = next(c for c in all_error_classes() if c.__name__ == "FanOutFailed")
    not_lossless = next(c for c in all_error_classes() if c.__name__ == "NotLossless")
    assert fan_out.exit_status != not_lossless.exit_status


def test_no_module_but_errors_defines_an_exit_code():
    pattern = re.compile(r"\bexit_code\s*=\s*\d|\bcode=\d|Exit\([^)]*code=\d")
    offenders = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
                 for p in sorted((ROOT / "dflash_ops").rglob("*.py")) + [ROOT / "tasks.py"]
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_runbooks_table_is_generated_from_exit_status():
    text = (ROOT / "docs/runbooks/README.md").read_text()
    section = text.split("## Exit codes of the tasks", 1)[1]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == exit_code_table(), "regenerate it: python -m dflash_ops.errors"
