"""Every tracked .py file keeps its lines at 120 characters or fewer (pyproject.toml's [tool.ruff] line-length)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN = 120


def _tracked_py_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and the repository's .git")
    proc = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"git ls-files failed: {proc.stderr.strip()}")
    return [name for name in proc.stdout.split("\0") if name]


def test_no_py_line_over_120_characters():
    files = _tracked_py_files()
    assert files, "git ls-files listed no .py files"
    long_lines = []
    for name in files:
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.split("\n"), start=1):
            length = len(line.rstrip("\r"))
            if length > MAX_LEN:
                long_lines.append(f"{name}:{lineno} ({length} characters)")
    assert not long_lines, f"lines over {MAX_LEN} characters:\n" + "\n".join(long_lines)
