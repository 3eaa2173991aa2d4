"""The set-up's claims hold (issue 66, point 3): README, pyproject and the Makefile say
the same Python (3.11 or later: the pinned set has no 3.10 wheels), the Makefile checks
it before pip with a clear message, and the CPU set-up names PyTorch's CPU wheel index
as vLLM's CPU install does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_readme_pyproject_and_makefile_claim_one_python():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["requires-python"] == ">=3.11"
    assert "Python 3.11 or later" in (ROOT / "README.md").read_text()
    assert re.search(r"^PYTHON_MIN := 3\.11$", (ROOT / "Makefile").read_text(), re.M)
    assert "(3, 11)" in (ROOT / "Makefile").read_text()
    assert sys.version_info >= (3, 11)  # what this venv was made with


def _python_reporting(tmp_path: Path, version: tuple[int, int, int]) -> Path:
    """An interpreter that is this one but says it is ``version``."""
    fake = tmp_path / "python-old"
    fake.write_text(f"#!{sys.executable}\n"
                    "import sys\n"
                    f"if sys.argv[1:] == ['--version']:\n"
                    f"    print('Python {'.'.join(map(str, version))}'); raise SystemExit\n"
                    f"sys.version_info = {version!r}\n"
                    "exec(sys.argv[2])\n")
    fake.chmod(0o755)
    return fake


def _check(python: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    return subprocess.run(["make", "-s", "-C", str(ROOT), "check-python", f"PYTHON={python}"],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("version, ok", [((3, 10, 13), False), ((3, 11, 0), True),
                                         ((3, 13, 1), True)])
def test_make_checks_the_python_before_pip(tmp_path, version, ok):
    r = _check(str(_python_reporting(tmp_path, version)))
    assert (r.returncode == 0) == ok, r.stderr
    if not ok:
        assert "kvpush needs Python 3.11 or later" in r.stderr
        assert "is Python 3.10.13" in r.stderr and "make venv PYTHON=python3.11" in r.stderr


def test_make_says_a_missing_python(tmp_path):
    r = _check(str(tmp_path / "no-python"))
    assert r.returncode != 0 and "is not found" in r.stderr


def test_the_cpu_set_up_takes_torch_from_pytorchs_cpu_index():
    """`make -n venv` (what it would run, in a fresh folder): torch's +cpu build from
    the CPU index, before the pinned set, whose torch==2.13.0 it then satisfies."""
    r = subprocess.run(["make", "-n", "-C", str(ROOT), "venv", "VENV=/nonexistent/venv"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pips = [line for line in r.stdout.splitlines() if " -m pip install" in line]
    torch_step = next(i for i, line in enumerate(pips) if "torch==2.13.0+cpu" in line)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in pips[torch_step]
    assert torch_step < next(i for i, line in enumerate(pips) if "requirements.txt" in line)
    assert "torch==2.13.0" in (ROOT / "requirements.txt").read_text().splitlines()
