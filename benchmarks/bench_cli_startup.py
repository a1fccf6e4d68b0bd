"""How long `causal-qwen --help` takes, against starting Python and importing torch, in the same run.

Each command runs in a fresh subprocess (`--repeats` times; the script prints the median and the fastest) with
this checkout first on `PYTHONPATH`. The command is run as pip installs it: a console script named `causal-qwen`
(written to a temporary folder) that imports `causal_qwen.cli` and calls `main()`. `import causal_qwen` is shown
too: a user's import registers the classes with transformers, which needs torch and transformers.

Usage:
    python benchmarks/bench_cli_startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = """\
import re
import sys
from causal_qwen.cli import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


def seconds(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "causal-qwen"
        script.write_text(CONSOLE_SCRIPT)
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "python -c 'import causal_qwen'": [sys.executable, "-c", "import causal_qwen"],
            "causal-qwen --help": [sys.executable, str(script), "--help"],
            "causal-qwen generate --help": [sys.executable, str(script), "generate", "--help"],
        }
        width = max(map(len, commands))
        print(f"{'command':<{width}}  median    fastest   ({args.repeats} runs each, {os.cpu_count()} CPUs)")
        for label, argv in commands.items():
            times = [seconds(argv, env) for _ in range(args.repeats)]
            print(f"{label:<{width}}  {statistics.median(times):.2f} s    {min(times):.2f} s")


if __name__ == "__main__":
    main()
