"""Run a Python script or file under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before triton is
imported, hence a subprocess), with the repository on PYTHONPATH; for the Triton kernels' CPU tests."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python *args` (e.g. "-c", SCRIPT, or a file) under the interpreter; stdout and stderr captured as text."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
