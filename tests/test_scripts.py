"""The experiment and benchmark scripts keep up with the library: each one answers `--help` (a library name it
imports that is gone or moved fails it), and a module without a command line imports."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "experiments").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))

# One process for all (torch is imported once): each script runs as `__main__` with `--help`, where argparse exits
# with status 0 before any work; a module without `if __name__ == "__main__"` is imported only.
RUN_EACH = """
import os, runpy, sys
failed = []
sys.path.insert(0, "")
for path in sys.argv[1:]:
    command = "__main__" in open(path, encoding="utf-8").read()
    sys.argv = [path, "--help"]
    sys.path[0] = os.path.dirname(path)  # as `python path` sets it
    try:
        runpy.run_path(path, run_name="__main__" if command else "imported")
        if command:
            failed.append(f"{path}: did not stop at --help")
    except SystemExit as stop:
        if stop.code not in (0, None):
            failed.append(f"{path}: exit status {stop.code}")
    except Exception as error:
        failed.append(f"{path}: {type(error).__name__}: {error}")
print("FAILED:" + repr(failed))
"""


def test_every_script_imports_the_library_names_it_uses():
    assert len(SCRIPTS) > 20
    run = subprocess.run([sys.executable, "-c", RUN_EACH, *map(str, SCRIPTS)], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = run.stdout.rsplit("FAILED:", 1)[1].strip()
    assert failed == "[]", failed
