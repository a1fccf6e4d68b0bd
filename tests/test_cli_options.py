"""The causal-qwen command before and around the model: start-up imports, option checks, what it prints."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO_ROOT, tiny_qwen2_config
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

from causal_qwen import CausalQwenConfig, CausalQwenForCausalLM, cli
from causal_qwen.cli import (
    _eval_plan,
    _print_intervals,
    build_parser,
    check_arguments,
    main,
    progress_bars,
    quiet_weight_bars,
)

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


BAD_OPTIONS = [
    (["generate", "M", "p", "--mode", "causal", "--shared-noise"], "--shared-noise"),
    (["generate", "M", "p", "--mode", "traditional", "--shared-noise"], "--shared-noise"),
    (["generate", "M", "p", "--shared-individual"], "--shared-individual"),
    (["generate", "M", "p", "--mode", "traditional", "--shared-individual"], "--shared-individual"),
    (["generate", "M", "p", "--mode", "standard", "--do-sample"], "--do-sample"),
    (["generate", "M", "p", "--mode", "causal", "--do-sample"], "--do-sample"),
    (["generate", "M", "p", "--temperature", "0.7"], "--temperature"),
    (["generate", "M", "p", "--mode", "traditional", "--top-k", "5"], "--top-k"),
    (["generate", "M", "p", "--mode", "traditional", "--do-sample", "--top-p", "1.5"], "--top-p"),
    (["generate", "M", "p", "--mode", "traditional", "--do-sample", "--temperature", "0"], "--temperature"),
    (["generate", "M", "p", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "M", "p", "--max-new-tokens", "-3"], "--max-new-tokens"),
    (["train", "M", "OUT", "--max-steps", "0"], "--max-steps"),
    (["train", "M", "OUT", "--batch-size", "0"], "--batch-size"),
    (["train", "M", "OUT", "--learning-rate", "-1e-4"], "--learning-rate"),
    (["train", "M", "OUT", "--eval-steps", "-1"], "--eval-steps"),
    (["train", "M", "OUT", "--max-steps", "10", "--eval-steps", "11"], "--eval-steps"),
    (["train", "M", "OUT", "--eval-examples", "0"], "--eval-examples"),
    (["train", "M", "OUT", "--seed", "-1"], "--seed"),
    (["eval", "M", "--batch-size", "0"], "--batch-size"),
    (["convert", "M", "OUT", "--set", "ovr_threshold"], "--set"),
    (["convert", "M", "OUT", "--seed", "-2"], "--seed"),
]


@pytest.mark.parametrize(("argv", "option"), BAD_OPTIONS)
def test_bad_options_stop_while_parsing(tmp_path, capsys, argv, option):
    # MODEL is a folder that does not exist: loading it would fail differently, and later.
    missing = str(tmp_path / "no-such-model")
    argv = [missing if a == "M" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err
    assert "no-such-model" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("setting", "said"), [
    ("ovr_treshold=20", "'ovr_treshold' (did you mean 'ovr_threshold'?)"),
    ("ovr_threshold=abc", "ovr_threshold must be a number, got str"),
])
def test_a_bad_config_field_stops_convert_before_qwen_loads(tmp_path, capsys, monkeypatch, setting, said):
    import transformers

    def load(*args, **kwargs):
        raise AssertionError("Qwen was loaded before --set was checked")

    monkeypatch.setattr(transformers.Qwen2ForCausalLM, "from_pretrained", load)
    source = tmp_path / "qwen"
    source.mkdir()
    with pytest.raises(SystemExit) as stop:
        main(["convert", str(source), str(tmp_path / "out"), "--set", setting])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("causal-qwen: error: argument --set: ") and said in err[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("settings", "said"), [
    (["ovr_treshold=20"], "'ovr_treshold' (did you mean 'ovr_threshold'?)"),
    (["ovr_threshold=abc"], "ovr_threshold must be a number, got str"),
    (["use_numeric=False", "context_values=True"], "context_values needs the numeric embedding"),
])
def test_a_bad_config_field_stops_convert_without_torch(tmp_path, console_script, settings, said):
    """The check runs before torch and transformers are imported (seconds on a small machine), in one line."""
    source = tmp_path / "qwen"
    source.mkdir()
    options = [option for setting in settings for option in ("--set", setting)]
    result = run_python("-X", "importtime", str(console_script), "convert", str(source), str(tmp_path / "out"),
                        *options)
    assert result.returncode == 2
    said_lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert said_lines[-1].startswith("causal-qwen: error: argument --set: ") and said in said_lines[-1]
    heavy = sorted(m for m in imported_modules(result.stderr) if m.split(".")[0] in ("torch", "transformers"))
    assert not heavy, heavy[:10]


def test_a_backbone_field_of_the_wrong_type_stops_convert_in_one_line(tmp_path, capsys):
    source = tmp_path / "qwen"
    source.mkdir()
    with pytest.raises(SystemExit) as stop:
        main(["convert", str(source), str(tmp_path / "out"), "--set", "use_cache=3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("causal-qwen: error: argument --set: ") and "use_cache" in err[-1]


def test_a_folder_under_a_literal_tilde_loads_as_that_folder(tmp_path, monkeypatch):
    """`"~/qwen"` (quoted, so the shell leaves it) is the folder under the home directory, not a hub id."""
    import transformers

    seen = []

    def load(path, *args, **kwargs):
        seen.append(path)
        raise KeyboardInterrupt  # stop here: the path is what this test reads

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(transformers.Qwen2ForCausalLM, "from_pretrained", load)
    (tmp_path / "qwen").mkdir()
    with pytest.raises(KeyboardInterrupt):
        main(["convert", "~/qwen", str(tmp_path / "out")])
    assert seen == [str(tmp_path / "qwen")]


@pytest.mark.parametrize("argv", [
    ["generate", "M", "p"],
    ["generate", "M", "p", "--shared-noise"],
    ["generate", "M", "p", "--mode", "causal", "--shared-individual"],
    ["generate", "M", "p", "--mode", "traditional"],
    ["generate", "M", "p", "--do-sample", "--top-p", "0.9"],
    ["generate", "M", "p", "--mode", "traditional", "--do-sample", "--temperature", "0.7", "--top-k", "5",
     "--top-p", "1"],
    ["train", "M", "OUT", "--max-steps", "10", "--eval-steps", "10"],
    ["train", "M", "OUT", "--eval-steps", "0", "--seed", "0"],
    ["convert", "M", "OUT", "--set", "ovr_threshold=20", "--seed", "3"],
])
def test_good_options_pass_the_checks(argv):
    parser = build_parser()
    check_arguments(parser, parser.parse_args(argv))


def test_option_check_and_generate_share_one_rule(tiny_qwen):
    # The command's check is the library's: generate raises for the same combination, naming the same argument.
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=120)
    with pytest.raises(ValueError, match="shared_noise"):
        model.generate(torch.tensor([[1, 2]]), mode="causal", shared_noise=True, max_new_tokens=1)


def test_a_mode_is_one_rule_that_generate_the_checks_and_the_command_read(tiny_qwen, monkeypatch, capsys):
    from causal_qwen.generation_modes import DECISION_RULES, StandardRule

    class Halved(StandardRule):
        name = "halved"
        summary = "standard mode's margins, halved"
        shared_option = None

        def scores(self, action, loc_s, scale_s):
            return action.margin(loc_s, scale_s) / 2

    monkeypatch.setitem(DECISION_RULES, "halved", Halved())
    parser = build_parser()
    check_arguments(parser, parser.parse_args(["generate", "M", "p", "--mode", "halved"]))
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "halved: standard mode's margins, halved" in " ".join(capsys.readouterr().out.split())
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=120).eval()
    options = dict(max_new_tokens=4, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ids = torch.tensor([[1, 2, 3]])
    halved = model.generate(ids, mode="halved", **options)
    standard = model.generate(ids, mode="standard", **options)
    assert torch.equal(halved.sequences, standard.sequences)
    torch.testing.assert_close(torch.stack(halved.scores), torch.stack(standard.scores) / 2)
    torch.testing.assert_close(torch.stack(halved.logits), torch.stack(standard.logits))
    # Its properties reach the checks: no beam search without a softmax, no sampling.
    with pytest.raises(ValueError, match="num_beams=2 needs mode='traditional', got 'halved'"):
        model.generate(ids, mode="halved", num_beams=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="do_sample"):
        model.generate(ids, mode="halved", do_sample=True, max_new_tokens=2)


@pytest.mark.parametrize(("max_steps", "batch_size", "eval_steps", "eval_examples", "expected"), [
    (10, 8, None, None, (10, 80)),  # default: one evaluation, at most as many examples as training sees
    (10, 8, 2, None, (2, 16)),  # five evaluations share the training's 80 examples
    (10, 8, 3, None, (3, 26)),  # three evaluations (steps 3, 6, 9)
    (10, 8, 0, None, (0, 80)),  # no evaluation
    (10, 8, None, 500, (10, 500)),  # an explicit cap wins
])
def test_eval_plan_costs_no_more_than_training(max_steps, batch_size, eval_steps, eval_examples, expected):
    args = SimpleNamespace(max_steps=max_steps, batch_size=batch_size, eval_steps=eval_steps,
                           eval_examples=eval_examples)
    steps, examples = _eval_plan(args)
    assert (steps, examples) == expected
    if eval_examples is None and steps:
        assert (max_steps // steps) * examples <= max_steps * batch_size


def test_intervals_say_when_no_number_was_generated(capsys):
    config = CausalQwenConfig(**tiny_qwen2_config().to_dict() | {"num_token_id": 120})
    model = CausalQwenForCausalLM(config).eval()
    loc_y, scale_y = torch.tensor([[0.5, 1.0, 2.0]]), torch.tensor([[0.1, 0.1, 0.2]])
    without = SimpleNamespace(sequences=torch.tensor([[7, 8, 9, 10, 11]]), loc_Y=loc_y, scale_Y=scale_y)
    _print_intervals(model, without, row=0, start=2, full_precision=False)
    assert capsys.readouterr().out == "  (no number generated: no interval)\n"

    with_one = SimpleNamespace(sequences=torch.tensor([[7, 8, 9, 120, 11]]), loc_Y=loc_y, scale_Y=scale_y)
    _print_intervals(model, with_one, row=0, start=2, full_precision=True)
    lines = capsys.readouterr().out.splitlines()
    median, low, high = (t.item() for t in model.value_interval(loc_y[0, 1], scale_y[0, 1], 0.9))
    assert lines == [f"  number {median!r}: 90% interval [{low!r}, {high!r}]"]

    # By default each number keeps the digits its 50% interval supports: every one within a twentieth of that
    # interval's half-width of its float, and fewer digits than the float's.
    _print_intervals(model, with_one, row=0, start=2, full_precision=False)
    written = re.fullmatch(r"  number (\S+): 90% interval \[(\S+), (\S+)\]", capsys.readouterr().out.strip("\n"))
    _, low50, high50 = (t.item() for t in model.value_interval(loc_y[0, 1], scale_y[0, 1], 0.5))
    for text, value in zip(written.groups(), (median, low, high), strict=True):
        assert abs(float(text) - value) <= (high50 - low50) / 2 / 20
        assert len(text) < len(repr(value))

    _print_intervals(model, SimpleNamespace(sequences=with_one.sequences, loc_Y=None, scale_Y=None), row=0, start=2,
                     full_precision=False)
    assert "no regression head" in capsys.readouterr().out


def test_progress_bars_show_inside_the_weights_quiet_and_leave_it_as_it_was():
    from transformers.utils import logging

    before = logging.is_progress_bar_enabled()
    with quiet_weight_bars():
        assert not logging.is_progress_bar_enabled()
        with progress_bars():
            assert logging.is_progress_bar_enabled()
        assert not logging.is_progress_bar_enabled()
    assert logging.is_progress_bar_enabled() == before


def test_quiet_weight_bars_hides_load_and_save_bars_and_restores_the_setting(tiny_qwen, tmp_path, capsys):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging

    before = (logging.is_progress_bar_enabled(), are_progress_bars_disabled())
    with quiet_weight_bars():
        tiny_qwen.save_pretrained(tmp_path / "q")
        Qwen2ForCausalLM.from_pretrained(tmp_path / "q")
        assert not are_progress_bars_disabled() or before[1]  # downloads keep their bars
    quiet = capsys.readouterr().err
    assert "Writing model shards" not in quiet and "Loading weights" not in quiet
    assert (logging.is_progress_bar_enabled(), are_progress_bars_disabled()) == before
    if before[0]:
        Qwen2ForCausalLM.from_pretrained(tmp_path / "q")
        assert "Loading weights" in capsys.readouterr().err



TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


@pytest.fixture
def converted(tmp_path, qwen25_dir):
    base = tmp_path / "base"
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).save_pretrained(base)
    for name in TOKENIZER_FILES:
        shutil.copy(qwen25_dir / name, base / name)
    assert main(["convert", str(base), str(tmp_path / "cq")]) == 0
    return tmp_path / "cq"


@pytest.mark.slow
def test_convert_seed_reproduces_the_model_and_is_recorded(converted, tmp_path):
    base = converted.parent / "base"
    assert main(["convert", str(base), str(tmp_path / "again")]) == 0
    assert main(["convert", str(base), str(tmp_path / "seed3"), "--seed", "3"]) == 0
    first, again, seed3 = (load_file(folder / "model.safetensors") for folder in (converted, tmp_path / "again",
                                                                                   tmp_path / "seed3"))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert {k for k in first if not torch.equal(first[k], seed3[k])} == {
        "numeric_embedding.w_num", "action.reg_head.weight", "abduction.context_values.key.weight"}
    assert json.loads((tmp_path / "seed3" / "config.json").read_text())["conversion_seed"] == 3
    assert json.loads((converted / "config.json").read_text())["conversion_seed"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "evaluations"), [([], [(4, 8)]), (["--eval-steps", "2"], [(2, 4), (4, 4)]),
                                                    (["--eval-steps", "0"], [])])
def test_train_evaluates_as_planned_and_quietly(converted, tmp_path, monkeypatch, capsys, extra, evaluations):
    from causal_qwen.training import CausalQwenTrainer

    seen = []
    evaluate = CausalQwenTrainer.evaluate

    def counting_evaluate(self, *args, **kwargs):
        seen.append((self.state.global_step, len(self.eval_dataset)))
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(CausalQwenTrainer, "evaluate", counting_evaluate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", str(converted), str(tmp_path / "trained"), "--num-examples", "24", "--max-steps", "4",
                     "--batch-size", "2", "--max-length", "32", *extra]) == 0
    # 4 steps of 2 examples: all evaluations together see at most those 8 examples (the validation split has 16).
    assert seen == evaluations
    assert sum(n for _, n in seen) <= 4 * 2
    if not torch.cuda.is_available():
        assert not [w for w in caught if "pin_memory" in str(w.message)]
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err


def test_serve_passes_vllms_options_on_and_stops_in_one_line_without_vllm(tmp_path, capsys, monkeypatch):
    import importlib.util

    args = build_parser().parse_args(["serve", "folder", "--dtype", "float32", "--port", "9000"])
    assert (args.model, args.options) == ("folder", ["--dtype", "float32", "--port", "9000"])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "vllm" else
                        find_spec(name, *rest))
    with pytest.raises(SystemExit) as stop:
        main(["serve", str(tmp_path), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "serve needs vLLM" in err and "Traceback" not in err, err


def test_missing_and_unconverted_folders_stop_in_one_line_before_loading(tmp_path, capsys):
    from transformers import Qwen2Config

    qwen = tmp_path / "qwen"
    Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(qwen)
    cases = [
        (["generate", str(tmp_path / "missing"), "p"], "no such folder"),
        (["value", str(tmp_path), "p"], "has no config.json"),
        (["eval", str(qwen)], "'qwen2' checkpoint, not a CausalQwen one: convert it first with `causal-qwen convert"),
        (["convert", str(tmp_path / "missing"), str(tmp_path / "out")], "no such folder"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "config.json").write_text('{"model_type": "causal_qwen"}')
    with pytest.raises(SystemExit) as stop:
        main(["train", str(converted), str(tmp_path / "out"), "--data", str(tmp_path / "none.jsonl")])
    assert stop.value.code == 2 and "argument --data: no such file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_eval_on_data_without_a_number_to_predict_stops_in_one_line_before_loading(tmp_path, console_script,
                                                                                  monkeypatch, capsys):
    model = tmp_path / "converted"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "causal_qwen"}')  # no weights: a load would fail otherwise
    files = {
        "words.jsonl": ['{"text": "Plain text without digits."}', '{"text": "Still none."}'],
        "opening.txt": ["5 apples and nothing after"],  # the first token is never predicted
        "pairs.jsonl": ['{"prompt": "It cost 12 dollars, so", "completion": " a lot."}'],  # the prompt is not scored
    }
    for name, lines in files.items():
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    for name, scored in (("words.jsonl", "text"), ("opening.txt", "text"), ("pairs.jsonl", "completion")):
        with pytest.raises(SystemExit) as stop:
            main(["eval", str(model), "--data", str(tmp_path / name)])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --data: no {scored} of {tmp_path / name} holds a number" in err, err
        assert "no regression metric" in err and "--data corpus" in err and "Traceback" not in err
    # A malformed file stops the same way, naming the file and the line.
    (tmp_path / "broken.jsonl").write_text('{"text": "a 1"}\n{"text": \n')
    with pytest.raises(SystemExit) as stop:
        main(["eval", str(model), "--data", str(tmp_path / "broken.jsonl")])
    assert stop.value.code == 2 and "argument --data:" in capsys.readouterr().err
    # The stop imports neither torch nor transformers: nothing has loaded.
    result = run_python("-X", "importtime", str(console_script), "eval", str(model), "--data",
                        str(tmp_path / "words.jsonl"))
    assert result.returncode == 2 and "holds a number" in result.stderr.splitlines()[-1], result.stderr[-2000:]
    heavy = sorted(m for m in imported_modules(result.stderr) if m.split(".")[0] in ("torch", "transformers"))
    assert not heavy, heavy[:10]
    # Data with a number to predict passes, and the examples read are the ones evaluated.
    (tmp_path / "numbers.jsonl").write_text('{"prompt": "It cost", "completion": " 12 dollars."}\n'
                                           '{"prompt": "", "completion": "No number here."}\n')
    seen = []
    monkeypatch.setattr(cli, "run_eval", lambda args: seen.append(cli._examples(args)) or 0)
    assert main(["eval", str(model), "--data", str(tmp_path / "numbers.jsonl")]) == 0
    assert seen == [[{"prompt": "It cost", "completion": " 12 dollars."},
                     {"prompt": "", "completion": "No number here."}]]
