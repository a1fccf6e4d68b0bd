"""The causal-qwen command before and around the model: start-up imports, option checks, what it prints."""

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO_ROOT

from causal_qwen import CausalQwenForCausalLM

# What pip writes as the `causal-qwen` console script.
CONSOLE_SCRIPT = textwrap.dedent("""\
    import re
    import sys
    from causal_qwen.cli import main
    if __name__ == '__main__':
        sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
        sys.exit(main())
""")


def run_python(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd)


def imported_modules(importtime_log: str) -> set[str]:
    """Module names from the lines of `python -X importtime`: `import time: self | cumulative | name`."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}


@pytest.fixture
def console_script(tmp_path):
    path = tmp_path / "causal-qwen"
    path.write_text(CONSOLE_SCRIPT)
    return path


@pytest.mark.parametrize("how", ["console script", "python -m"])
@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["train", "--help"]])
def test_help_imports_neither_torch_nor_transformers(console_script, how, argv):
    program = [str(console_script)] if how == "console script" else ["-m", "causal_qwen.cli"]
    result = run_python("-X", "importtime", *program, *argv)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: causal-qwen")
    modules = imported_modules(result.stderr)
    assert "causal_qwen" in modules  # the log is the one of this program
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "transformers", "numpy"))
    assert not heavy, heavy[:10]


def test_the_command_imports_and_registers_the_classes_when_they_are_used(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent("""\
        import sys
        sys.argv[0] = "causal-qwen"  # as the console script runs
        import causal_qwen
        assert "torch" not in sys.modules
        config_class = causal_qwen.CausalQwenConfig
        from transformers import AutoConfig
        assert AutoConfig.for_model("causal_qwen", num_token_id=3).__class__ is config_class
        print("ok")
    """))
    result = run_python(str(script))
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_import_causal_qwen_registers_with_the_auto_classes(tiny_qwen, tmp_path):
    # A plain `import causal_qwen`, nothing else touched: AutoModelForCausalLM must then load a saved folder without
    # remote code (the folder carries an auto_map, so an unregistered model type would ask for trust_remote_code).
    CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=120).save_pretrained(tmp_path / "cq")
    result = run_python("-c", textwrap.dedent(f"""\
        import causal_qwen
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "cq")!r})
        print(type(model).__module__, type(model).__name__)
    """))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["causal_qwen.modeling", "CausalQwenForCausalLM"]
