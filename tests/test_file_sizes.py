"""No Python file in rl_engine/ outside kernels/ grows past 450 lines.

Kernels are exempt: a Triton or C++-binding file holds a kernel, its launch table and
its contract in one place. Everything else is a module a reader should take in at once;
past 450 lines it holds more than one concern and is split by concern.
"""

from pathlib import Path

import rl_engine

PACKAGE = Path(rl_engine.__file__).parent
MAX_LINES = 450


def _too_long(root: Path, exempt: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if exempt in path.parents:
            continue
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            found.append(f"{path.relative_to(root.parent)}: {lines} lines")
    return found


def test_no_module_outside_kernels_is_over_the_limit():
    offenders = _too_long(PACKAGE, PACKAGE / "kernels")
    assert not offenders, f"over {MAX_LINES} lines (split by concern):\n" + "\n".join(offenders)


def test_the_rule_sees_a_long_file(tmp_path):
    """Negative control: a 451-line module is reported, one inside the exempt folder is not."""
    package = tmp_path / "pkg"
    (package / "kernels").mkdir(parents=True)
    (package / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (package / "short.py").write_text("x = 1\n" * MAX_LINES)
    (package / "kernels" / "kernel.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert _too_long(package, package / "kernels") == [f"pkg/long.py: {MAX_LINES + 1} lines"]
