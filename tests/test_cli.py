"""The causal-qwen command line end to end on a tiny base checkpoint with the real tokenizer."""

import argparse
import json
import shutil
import subprocess

import pytest
import torch
from conftest import tiny_qwen2_config
from transformers import Qwen2ForCausalLM, TrainerCallback

from causal_qwen import CausalQwenForCausalLM, training
from causal_qwen.cli import build_parser, main

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def test_help_explains_every_command():
    out = subprocess.run(["causal-qwen", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("convert", "generate", "train", "eval", "value", "serve"):
        assert command in out
    sub = subprocess.run(["causal-qwen", "generate", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--mode" in sub and "--seed" in sub


def test_train_learning_rate_is_the_heads_and_defaults_to_1e_4():
    assert build_parser().parse_args(["train", "in", "out"]).learning_rate == 1e-4
    sub = subprocess.run(["causal-qwen", "train", "--help"], capture_output=True, text=True, check=True).stdout
    assert "classification head" in sub and "LEARNING_RATE_SCALES" in sub


def _option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry of a --help, by its first option string, its lines joined."""
    entries, current = {}, None
    for line in help_text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = ""
        if current is not None:
            entries[current] += " " + " ".join(line.split())
    return entries


@pytest.mark.parametrize("command", ["convert", "generate", "train", "eval", "value", "serve"])
def test_every_subcommand_help_shows_each_default_once(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    help_text = capsys.readouterr().out
    subparser = build_parser()._subparsers._group_actions[0].choices[command]
    entries = _option_entries(help_text)
    for action in subparser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        entry = entries[action.option_strings[0]]
        assert "(default: None)" not in entry and "%%" not in entry, entry
        if isinstance(action, argparse.BooleanOptionalAction):
            assert entry.endswith(f"(default: {'on' if action.default else 'off'})"), entry
        elif action.default not in (None, False, []):
            assert entry.count("(default") == 1 and f"(default: {action.default})" in entry, entry
    assert "%%" not in help_text
    if command == "generate":
        assert entries["--max-new-tokens"].endswith("tokens to generate after each prompt (default: 32)")
        assert "(default" not in entries["--do-sample"]  # a plain flag is off without it


@pytest.mark.slow
def test_convert_generate_train_eval(tmp_path, qwen25_dir, capsys):
    base = tmp_path / "base"
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).eval()
    qwen.save_pretrained(base)
    for name in TOKENIZER_FILES:
        shutil.copy(qwen25_dir / name, base / name)

    converted = tmp_path / "cq"
    assert main(["convert", str(base), str(converted), "--set", "ovr_threshold=1.5"]) == 0
    model = CausalQwenForCausalLM.from_pretrained(converted)
    assert model.config.num_token_id == 151665 and model.config.ovr_threshold == 1.5
    ids = torch.tensor([[9707, 1879, 11]])
    other = torch.arange(151936) != 151665
    digit_ids = [15, 16, 17, 18, 19, 20, 21, 22, 23, 24]  # "0" ... "9" in Qwen2.5's vocabulary
    with torch.no_grad():
        assert (model(ids).loc_S[..., other] - qwen(ids).logits[..., other]).abs().max() <= 1e-5
    # By default <NUM> starts at the mean of the digit rows, and the value has its own noise (docs/design.md §3, §1).
    torch.testing.assert_close(model.action.cls_head.weight[151665], qwen.lm_head.weight[digit_ids].mean(0))
    assert model.action.reg_log_noise.exp().item() == pytest.approx(1.0)

    copied_dir = tmp_path / "cq-copy"
    assert main(["convert", str(base), str(copied_dir), "--num-row-init", "copy",
                 "--set", "regression_noise=0.5"]) == 0
    copied = CausalQwenForCausalLM.from_pretrained(copied_dir)
    with torch.no_grad():
        assert (copied(ids).loc_S - qwen(ids).logits).abs().max() <= 1e-5
    assert copied.action.reg_log_noise.exp().item() == pytest.approx(0.5)

    capsys.readouterr()
    assert main(["generate", str(converted), "Price: 3.5 dollars", "--mode", "causal", "--seed", "1",
                 "--max-new-tokens", "4"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("Price: 3.5 dollars")
    main(["generate", str(converted), "Price: 3.5 dollars", "--mode", "causal", "--seed", "1", "--max-new-tokens", "4"])
    assert capsys.readouterr().out == first

    trained = tmp_path / "trained"
    assert main(["train", str(converted), str(trained), "--data", "corpus", "--num-examples", "24", "--max-steps", "3",
                 "--batch-size", "4", "--max-length", "48"]) == 0
    assert (trained / "model.safetensors").exists() and (trained / "loss.png").exists()
    after = CausalQwenForCausalLM.from_pretrained(trained)
    assert not torch.equal(after.action.cls_head.weight, model.action.cls_head.weight)
    assert torch.equal(after.model.embed_tokens.weight, model.model.embed_tokens.weight)

    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"text": t}) for t in ["It costs 12 dollars.", "2 plus 3 is 5."]))
    plots, report = tmp_path / "plots", tmp_path / "metrics.json"
    assert main(["eval", str(trained), "--data", str(texts), "--plots", str(plots), "--json", str(report)]) == 0
    metrics = json.loads(report.read_text())
    assert {"eval/accuracy", "eval/ppl_ovr", "eval/reg_mae", "dist/ovr_prob_sum_median"} <= metrics.keys()
    assert (plots / "predictions.png").stat().st_size > 0 and (plots / "u_scale.png").stat().st_size > 0


def _converted_tiny(tmp_path, qwen25_dir):
    """A tiny random Qwen2 with the real tokenizer, converted by `causal-qwen convert`; its folder."""
    base, converted = tmp_path / "base", tmp_path / "cq"
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).eval().save_pretrained(base)
    for name in TOKENIZER_FILES:
        shutil.copy(qwen25_dir / name, base / name)
    assert main(["convert", str(base), str(converted)]) == 0
    return converted


def _with_callback(cls, callback):
    """`cls.__init__` that adds `callback` to every trainer it builds."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), callback]
        init(self, *args, **kwargs)

    return __init__


@pytest.mark.slow
def test_train_and_eval_on_prompt_completion_data(tmp_path, qwen25_dir, capsys, monkeypatch):
    converted, trained = _converted_tiny(tmp_path, qwen25_dir), tmp_path / "trained"
    pairs = [{"q": f"{a} apples at {b} dollars each cost", "a": f" {a * b} dollars."}
             for a in range(2, 8) for b in (3, 5, 1.5)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in pairs))
    assert main(["train", str(converted), str(trained), "--data", str(data), "--prompt-column", "q",
                 "--completion-column", "a", "--max-steps", "2", "--batch-size", "4"]) == 0
    # The start reads the data through the model before the first step (minutes on a CPU): the command says so.
    assert "fitting the value head to the training data's numbers" in capsys.readouterr().out
    after = CausalQwenForCausalLM.from_pretrained(trained)
    # The value head was started from the completions' numbers: one row per pair (the prompt's are not labelled).
    assert after.config.value_head_fit["positions"] == len(pairs)
    # The features the value reads were held (the value side is the start's); the class decisions trained.
    before = CausalQwenForCausalLM.from_pretrained(converted)
    for name in ("numeric_embedding.w_num", "abduction.loc_net.weight", "abduction.scale_net.bias"):
        assert torch.equal(after.get_parameter(name), before.get_parameter(name)), name
    assert not torch.equal(after.action.cls_head.bias, before.action.cls_head.bias)
    # --train-value-features trains them: they move during training.
    moved = []

    class Moved(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            moved.append(not torch.equal(model.numeric_embedding.w_num, before.numeric_embedding.w_num))

    monkeypatch.setattr(training.CausalQwenTrainer, "__init__", _with_callback(training.CausalQwenTrainer, Moved()))
    assert main(["train", str(converted), str(tmp_path / "features"), "--data", str(data), "--prompt-column", "q",
                 "--completion-column", "a", "--max-steps", "2", "--batch-size", "4", "--train-value-features"]) == 0
    assert moved == [True, True]
    report = tmp_path / "metrics.json"
    assert main(["eval", str(trained), "--data", str(data), "--prompt-column", "q", "--completion-column", "a",
                 "--json", str(report)]) == 0
    metrics = json.loads(report.read_text())
    # Scored positions: the completion's " ", <NUM>, " dollars", "." and the end of text; the numbers are the answers.
    assert metrics["eval/num_targets"] == len(pairs)
    assert metrics["eval/positions"] == 5 * len(pairs)


@pytest.mark.slow
def test_train_on_a_text_file_without_numbers_and_data_file_errors(tmp_path, qwen25_dir, capsys):
    converted, trained = _converted_tiny(tmp_path, qwen25_dir), tmp_path / "trained"
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"The cat sat on mat number {word}.\n" for word in ("one", "two", "three", "four")))
    assert main(["train", str(converted), str(trained), "--data", str(lines), "--max-steps", "2",
                 "--batch-size", "2"]) == 0
    after = CausalQwenForCausalLM.from_pretrained(trained)
    assert after.config.value_head_fit is None  # no number to start it from: skipped, not an error
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match=r"causal-qwen train: data file .*empty\.jsonl holds no examples"):
        main(["train", str(converted), str(trained), "--data", str(empty), "--max-steps", "1"])
