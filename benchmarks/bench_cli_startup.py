"""How long `causal-qwen --help` and its one-line mistakes take, against starting Python and importing torch, in the
same run.

Each command runs in a fresh subprocess (`--repeats` times; the script prints the median and the fastest) with this
checkout first on `PYTHONPATH`. The mistakes (a misspelt `convert --set` field, a missing folder, a Qwen folder never
converted, a data file without numbers for `eval`) each exit with status 2 before any model loads. The command is run
as pip installs it: a console script named `causal-qwen` (written to a temporary folder) that imports
`causal_qwen.cli` and calls `main()`. `import causal_qwen` is shown too: a user's import registers the classes with
transformers, which needs torch and transformers.

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
    result = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if result.returncode not in (0, 2):  # 2: argparse's error, the one-line stop the mistakes are timed to
        raise RuntimeError(f"{argv} exited with status {result.returncode}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "causal-qwen"
        script.write_text(CONSOLE_SCRIPT)
        qwen = Path(folder) / "qwen"
        qwen.mkdir()
        (qwen / "config.json").write_text('{"model_type": "qwen2"}')
        causal = Path(folder) / "cq"
        causal.mkdir()
        (causal / "config.json").write_text('{"model_type": "causal_qwen"}')
        words = Path(folder) / "words.txt"
        words.write_text("no number here\n")
        cli = [sys.executable, str(script)]
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "python -c 'import causal_qwen'": [sys.executable, "-c", "import causal_qwen"],
            "causal-qwen --help": [sys.executable, str(script), "--help"],
            "causal-qwen generate --help": [sys.executable, str(script), "generate", "--help"],
            "convert --set ovr_treshold=20": [*cli, "convert", str(qwen), str(Path(folder) / "out"), "--set",
                                              "ovr_treshold=20"],
            "eval ./no-such-folder": [*cli, "eval", str(Path(folder) / "no-such-folder")],
            "eval QWEN_FOLDER": [*cli, "eval", str(qwen)],
            "eval --data WORDS": [*cli, "eval", str(causal), "--data", str(words)],
        }
        width = max(map(len, commands))
        print(f"{'command':<{width}}  median    fastest   ({args.repeats} runs each, {os.cpu_count()} CPUs)")
        for label, argv in commands.items():
            times = [seconds(argv, env) for _ in range(args.repeats)]
            print(f"{label:<{width}}  {statistics.median(times):.2f} s    {min(times):.2f} s")


if __name__ == "__main__":
    main()
