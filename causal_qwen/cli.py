"""The `causal-qwen` command line: convert a Qwen2 checkpoint, train, evaluate, generate.

    causal-qwen convert Qwen/Qwen2.5-0.5B ./cq            # or a local Qwen2 folder
    causal-qwen generate ./cq "A kilo of apples costs 3.5 dollars, so 4 kilos cost" --mode causal --seed 0
    causal-qwen train ./cq ./cq-trained --data corpus --max-steps 200
    causal-qwen eval ./cq-trained --data corpus --split test --plots ./plots
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib.util
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

from .generation_modes import DECISION_RULES
from .generation_options import GenerationOptionError, check_generation_options
from .numbers import format_number, supported_place

__all__ = ["main", "build_parser"]

_FULL_PRECISION_HELP = ("write every digit of each number (by default a number keeps the digits its 50%% interval "
                        "supports: down to the second significant digit of the interval's half-width)")

DESCRIPTION = """\
CausalQwen: Qwen2 models that read numbers as values, decide each token with One-vs-Rest Cauchy
decisions and predict numbers with a median and an interval.

Start with `convert` to turn a Qwen2 / Qwen2.5 checkpoint (a folder or a hub id) into a CausalQwen
checkpoint; then `generate`, `train`, `eval` and `serve` take that folder. `causal-qwen COMMAND --help` says more.
"""


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one that its help does not state already.

    argparse's `ArgumentDefaultsHelpFormatter` would also write "(default: None)" for an option whose absence means
    something its help explains, "(default: False)" for every flag, and True/False for a --x/--no-x pair, which this
    writes as on/off."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "%(default)" in text or "(default" in text:
            return text
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: on or off
            return f"{text} (default: {'on' if default else 'off'})".lstrip()
        if default is None or default is False or default is argparse.SUPPRESS or default == []:
            return text  # no value without the option (a plain flag is off, --set adds nothing)
        return f"{text} (default: %(default)s)".lstrip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="causal-qwen", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each subcommand's --help shows the defaults (add_parser does not pass the formatter on).
    commands.add_parser = functools.partial(commands.add_parser, formatter_class=_DefaultsHelpFormatter)
    for add in (_add_convert, _add_generate, _add_train, _add_value, _add_eval, _add_serve):
        add(commands)
    return parser


def _add_convert(commands) -> None:
    convert = commands.add_parser("convert", help="Qwen2 checkpoint -> CausalQwen checkpoint with its tokenizer",
                                  description="Build a CausalQwen from a Qwen2 checkpoint (initialised as in "
                                              "docs/design.md §3: it starts as exactly its Qwen) and save it with "
                                              "its tokenizer.")
    convert.add_argument("source", help="Qwen2 folder (with its tokenizer) or hub id")
    convert.add_argument("output", help="folder to write the CausalQwen checkpoint to")
    convert.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                         help="dtype of the saved weights")
    convert.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                         help="override a CausalQwenConfig field, e.g. --set ovr_threshold=20 (repeatable)")
    convert.add_argument("--num-row-init", default="digits", choices=["copy", "digits"],
                         help="the <NUM> row of the classification head: the mean of Qwen's rows of the digits 0-9 "
                              "(digits: <NUM> starts where Qwen expects a digit) or Qwen's row of that id (copy: "
                              "a reserved, untrained row, so the model starts never writing a number)")
    convert.add_argument("--seed", type=int, default=0,
                         help="seed of the weights the conversion draws (w_num, w_reg); the same seed gives the same "
                              "model, and it is recorded as conversion_seed in config.json")


def _add_generate(commands) -> None:
    generate = commands.add_parser("generate", help="generate text, numbers written as digits",
                                   description="Generate a continuation of PROMPT in any mode.")
    generate.add_argument("model", help="CausalQwen folder")
    generate.add_argument("prompt", nargs="+", help="one or more prompts")
    generate.add_argument("--mode", choices=list(DECISION_RULES),
                          help="; ".join(f"{name}: {rule.summary}" for name, rule in DECISION_RULES.items()))
    for rule in DECISION_RULES.values():
        if rule.shared_option is not None:
            generate.add_argument(f"--{rule.shared_option.replace('_', '-')}", action="store_true",
                                  help=f"{rule.name} mode: {rule.shared_summary}")
    generate.add_argument("--do-sample", action="store_true",
                          help="sample from the softmax (traditional mode, the default with it)")
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate after each prompt")
    generate.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    generate.add_argument("--intervals", action="store_true",
                          help="print the 90%% interval of every generated number (a freshly converted model "
                               "rarely writes one: it says so)")
    generate.add_argument("--full-precision", action="store_true", help=_FULL_PRECISION_HELP)


def _add_train(commands) -> None:
    train = commands.add_parser("train", help="fine-tune the causal heads (backbone frozen) with Trainer",
                                description="Train with transformers' Trainer on the built-in numeric corpus or "
                                            "on your texts (.jsonl/.csv with a text column, or .txt).")
    train.add_argument("model", help="CausalQwen folder to start from")
    train.add_argument("output", help="folder for checkpoints and the final model")
    _add_data_arguments(train, default_split="train", default_n=2000)
    train.add_argument("--eval-data", help="evaluation data (same forms as --data; 'corpus' is its validation "
                                          "split); default: the corpus validation split when training on the corpus")
    train.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    train.add_argument("--eval-steps", type=int,
                       help="evaluate every N steps; 0: no evaluation (default: once, after the last step)")
    train.add_argument("--eval-examples", type=int,
                       help="evaluate on at most N examples (default: max-steps x batch-size / number of "
                            "evaluations, so that evaluating costs less than training)")
    train.add_argument("--batch-size", type=int, default=8, help="examples per step")
    train.add_argument("--learning-rate", type=float, default=1e-4,
                       help="learning rate of the classification head; the other modules use fixed multiples of it "
                            "(see causal_qwen.training.LEARNING_RATE_SCALES)")
    train.add_argument("--max-length", type=int, default=128, help="tokens kept of each example")
    train.add_argument("--seed", type=int, default=0,
                       help="seed of the built-in corpus, the data order and every random draw")
    train.add_argument("--report-to", default="none", help="Trainer's report_to, e.g. tensorboard, wandb, none")
    train.add_argument("--value-head-start", action=argparse.BooleanOptionalAction, default=True,
                       help="fit the value head on the training data before the first step (see "
                            "causal_qwen.starts)")
    train.add_argument("--train-value-features", action=argparse.BooleanOptionalAction, default=False,
                       help="also train the numeric embedding and the abduction network the value reads (off: the "
                            "read-out learns from its start on the rows the start read; see docs/training.md)")
    train.add_argument("--value-learning", action=argparse.BooleanOptionalAction, default=True,
                       help="train the value read-out from its start by gradient, keeping the state of least "
                            "held-out error (causal_qwen.starts.learning)")
    train.add_argument("--value-learning-rate", type=float,
                       help="Adam's rate of the read-out's training, in whitened coordinates (default: "
                            "ValueLearning's)")
    train.add_argument("--value-start-rows", type=int, default=4096,
                       help="value rows the start reads (and the read-out trains on), a sample of the "
                            "training data when it holds more")


def _add_value(commands) -> None:
    value = commands.add_parser("value", help="the value each prompt asks for next, with its intervals",
                                description="Print the median and the 50% and 90% intervals of the number each "
                                            "PROMPT asks for next (model.next_value).")
    value.add_argument("model", help="CausalQwen folder")
    value.add_argument("prompt", nargs="+", help="one or more prompts, each ending where its number would start")
    value.add_argument("--full-precision", action="store_true", help=_FULL_PRECISION_HELP)


def _add_eval(commands) -> None:
    evaluate = commands.add_parser("eval", help="metrics table and plots",
                                   description="Evaluate every metric (docs/design.md §6) and write PNG plots.")
    evaluate.add_argument("model", help="CausalQwen folder")
    _add_data_arguments(evaluate, default_split="test", default_n=500)
    evaluate.add_argument("--batch-size", type=int, default=8, help="examples per forward pass")
    evaluate.add_argument("--max-length", type=int, default=128, help="tokens kept of each example")
    evaluate.add_argument("--plots", help="folder for predictions.png and u_scale.png")
    evaluate.add_argument("--json", help="also write the metrics to this JSON file")
    evaluate.add_argument("--seed", type=int, default=0,
                          help="seed of the built-in corpus and of the metrics' random draws")


def _add_serve(commands) -> None:
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible server on vLLM that writes the numbers into its text",
        description="Serve the folder on vLLM (installed in an environment of its own, docs/serving.md): completions "
                    "and chat completions whose text holds the numbers the model writes, with their intervals "
                    "(causal_qwen.integrations.vllm_server). The options after the folder are vLLM's engine options "
                    "(--dtype, --kv-cache-memory-bytes, --max-model-len, ...) and --host, --port.")
    serve.add_argument("model", help="CausalQwen folder")
    serve.add_argument("options", nargs=argparse.REMAINDER, help="vLLM's engine options, --host and --port")


def _add_data_arguments(parser: argparse.ArgumentParser, default_split: str, default_n: int) -> None:
    parser.add_argument("--data", default="corpus",
                        help="'corpus' (the built-in numeric corpus) or a .jsonl/.csv/.txt file of texts, or of "
                             "prompt/completion pairs (then only the completion is trained and scored)")
    parser.add_argument("--text-column", default="text", help="column holding the text in .jsonl/.csv files")
    parser.add_argument("--prompt-column", default="prompt",
                        help="column of the prompt in prompt/completion .jsonl/.csv files")
    parser.add_argument("--completion-column", default="completion",
                        help="column of the completion in prompt/completion .jsonl/.csv files")
    parser.add_argument("--split", default=default_split,
                        choices=["train", "validation", "test", "extrapolation"], help="corpus split")
    parser.add_argument("--num-examples", type=int, default=default_n, help="corpus size")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    _check_paths(parser, args)
    _check_overrides(parser, args)
    _check_eval_data(parser, args)
    run = {"convert": run_convert, "generate": run_generate, "value": run_value, "train": run_train,
           "eval": run_eval, "serve": run_serve}[args.command]
    with quiet_weight_bars(), deepspeed_accelerator_named():
        return run(args)


# Checked on the parsed arguments, before anything is loaded. Arguments a command lacks are skipped.
_POSITIVE_INTS = ("max_new_tokens", "top_k", "max_steps", "batch_size", "max_length", "num_examples", "eval_examples",
                  "value_start_rows")
_NON_NEGATIVE_INTS = ("seed", "eval_steps")
_POSITIVE_FLOATS = ("temperature", "learning_rate", "value_learning_rate")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop with `parser.error` (exit status 2) on values and combinations that cannot work, before any loading."""
    for dest, bound, holds in ((_POSITIVE_INTS, "a positive integer", lambda v: v >= 1),
                               (_NON_NEGATIVE_INTS, "a non-negative integer", lambda v: v >= 0),
                               (_POSITIVE_FLOATS, "a positive number", lambda v: v > 0)):
        for name in dest:
            value = getattr(args, name, None)
            if value is not None and not holds(value):
                parser.error(f"argument {_option(name)}: must be {bound}, got {value}")
    if args.command == "convert":
        try:
            parse_overrides(args.overrides)
        except ValueError as error:
            parser.error(f"argument --set: {error}")

    elif args.command == "generate":
        _check_generate(parser, args)
    elif args.command == "serve" and importlib.util.find_spec("vllm") is None:
        parser.error("serve needs vLLM, which is not installed here: it goes in an environment of its own "
                     "(docs/serving.md)")
    elif args.command == "train" and args.eval_steps is not None and args.eval_steps > args.max_steps:
        parser.error(f"argument --eval-steps: {args.eval_steps} exceeds --max-steps {args.max_steps}, so no "
                     "evaluation would run (0 turns evaluation off)")


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The folders and files the command reads, after its options: each missing one in one line, before loading."""
    if args.command == "convert":
        if _looks_local(args.source) and not Path(args.source).expanduser().is_dir():
            parser.error(f"argument source: no such folder: {args.source}")
        if _looks_local(args.source):  # a "~/..." the shell left as it is loads as the folder it names
            args.source = str(Path(args.source).expanduser())
    else:
        _check_model_folder(parser, args.model)
        args.model = str(Path(args.model).expanduser())
    data = getattr(args, "data", "corpus")
    if data != "corpus" and not Path(data).expanduser().is_file():
        parser.error(f"argument --data: no such file: {data}")


def _check_eval_data(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`eval`'s data file, read before the model loads: a malformed file or one without a number to predict stops in
    one line. The examples read are kept on `args` for `run_eval`."""
    if args.command != "eval" or args.data == "corpus":  # the corpus has numbers in every split
        return
    from .data.texts import read_examples

    try:
        examples = read_examples(args.data, args.text_column, args.prompt_column, args.completion_column)
    except ValueError as error:  # names the file and the line
        parser.error(f"argument --data: {error}")
    if not any(map(_has_predicted_number, examples)):
        scored = "completion" if isinstance(examples[0], dict) else "text"
        parser.error(f"argument --data: no {scored} of {args.data} holds a number after other text, so eval has no "
                     "value to score and would report no regression metric (a number that opens a text is never "
                     "predicted): evaluate on texts with numbers, or on --data corpus")
    args.examples = examples


def _has_predicted_number(example: str | dict) -> bool:
    """Whether a scored position of the example is a number: one after some text (the first token has no
    prediction), in the completion of a prompt/completion pair (the prompt is not scored)."""
    from .numbers import find_numbers

    prompt, text = ("", example) if isinstance(example, str) else (example["prompt"], example["completion"])
    return any(span.start > 0 or prompt for span in find_numbers(text))


def _check_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`convert --set` fields named and valued as the config takes them (the config's own checks: a misspelt field, a
    value of the wrong type), before torch and Qwen load. A field of the backbone is checked by the config itself."""
    if args.command != "convert" or not args.overrides:
        return
    from . import config_fields

    overrides = parse_overrides(args.overrides)
    known = config_fields.QWEN2_FIELDS | config_fields.CHECKED_FIELDS | set(config_fields.INIT_KEYWORDS)
    try:
        config_fields.check_names(overrides, known, where="convert")
        for name, value in overrides.items():
            config_fields.check_field(name, value)
        config_fields.check_relations(overrides)
        if not set(overrides) <= config_fields.CHECKED_FIELDS:
            _check_backbone_fields(overrides)
    except (TypeError, ValueError) as error:
        parser.error(f"argument --set: {error}")


def _check_backbone_fields(overrides: dict) -> None:
    """The config's own checks, for `--set` fields of the Qwen2 backbone (`@strict`'s error as a ValueError)."""
    from huggingface_hub.errors import StrictDataclassError

    from .configuration import CausalQwenConfig

    try:
        CausalQwenConfig(**overrides)
    except StrictDataclassError as error:
        raise ValueError(" ".join(str(error).split())) from None


def _looks_local(name: str) -> bool:
    """Whether `name` is a path on this machine rather than a hub id (`owner/name`)."""
    return name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") != 1


def _check_model_folder(parser: argparse.ArgumentParser, folder: str) -> None:
    """A CausalQwen folder (its config's `model_type`), said in one line before anything loads."""
    config = Path(folder).expanduser() / "config.json"
    if not Path(folder).expanduser().is_dir():
        parser.error(f"argument model: no such folder: {folder}")
    if not config.is_file():
        parser.error(f"argument model: {folder} has no config.json (a CausalQwen folder is what `causal-qwen convert` "
                     "writes)")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as error:
        parser.error(f"argument model: cannot read {config}: {error}")
    if model_type != "causal_qwen":
        parser.error(f"argument model: {folder} holds a {model_type!r} checkpoint, not a CausalQwen one: convert it "
                     f"first with `causal-qwen convert {folder} OUTPUT`")


def _check_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"argument --top-p: must lie in (0, 1], got {args.top_p}")
    try:
        check_generation_options(args.mode, args.shared_individual, args.shared_noise, args.do_sample)
    except GenerationOptionError as error:
        parser.error(f"argument {_option(error.argument)}: {error}")
    for name in ("temperature", "top_k", "top_p"):
        if getattr(args, name) is not None and not args.do_sample:
            parser.error(f"argument {_option(name)}: sets how --do-sample samples; add --do-sample")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


@contextlib.contextmanager
def quiet_weight_bars() -> Iterator[None]:
    """Hide transformers' bars of every checkpoint load and save ("Loading weights", "Writing model shards").

    The commands print a line for each step themselves. Download bars (huggingface_hub's) stay, and so do
    Trainer's and evaluation's. The previous settings come back on exit, for callers of `main` in the same process.
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging

    bars_on, hub_bars_on = logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    logging.disable_progress_bar()  # turns the hub's bars off too
    if hub_bars_on:
        enable_progress_bars()
    try:
        yield
    finally:
        if bars_on:
            logging.enable_progress_bar()
        if not hub_bars_on:
            disable_progress_bars()


@contextlib.contextmanager
def progress_bars() -> Iterator[None]:
    """transformers' progress bars on inside [`quiet_weight_bars`], as they were before on exit."""
    from transformers.utils import logging

    bars_on = logging.is_progress_bar_enabled()
    logging.enable_progress_bar()
    try:
        yield
    finally:
        if not bars_on:
            logging.disable_progress_bar()


@contextlib.contextmanager
def deepspeed_accelerator_named() -> Iterator[None]:
    """Tell DeepSpeed, where it is installed and torch finds no accelerator, that the accelerator is the CPU.

    The commands never use DeepSpeed, but accelerate imports it, where it is installed, each time it unwraps a model
    (transformers' `save_pretrained` and `Trainer` do: `convert` and `train`), and DeepSpeed, left to find the
    accelerator itself, logs "[WARNING] Setting accelerator to CPU ..." where there is none. `DS_ACCELERATOR` is the
    variable DeepSpeed reads for it; one set already is left alone, and the variable goes again on exit.
    """
    import importlib.util
    import os

    if "DS_ACCELERATOR" in os.environ or importlib.util.find_spec("deepspeed") is None or _has_accelerator():
        yield
        return
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        os.environ.pop("DS_ACCELERATOR", None)


def parse_overrides(pairs: list[str]) -> dict:
    """`["ovr_threshold=20", "learnable_threshold=True"]` -> `{"ovr_threshold": 20, "learnable_threshold": True}`."""
    overrides = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"expects FIELD=VALUE, got {pair!r}")
        key, raw = pair.split("=", 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        overrides[key.strip()] = value
    return overrides


def run_convert(args) -> int:
    import torch
    from transformers import Qwen2ForCausalLM

    from . import CausalQwenForCausalLM, CausalQwenTokenizer

    dtype = getattr(torch, args.dtype)
    print(f"loading Qwen2 from {args.source} ...")
    qwen = Qwen2ForCausalLM.from_pretrained(args.source, dtype=dtype)
    tokenizer = CausalQwenTokenizer.from_pretrained(args.source)
    model = CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer, num_row_init=args.num_row_init,
                                            seed=args.seed, **parse_overrides(args.overrides))
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"saved CausalQwen to {args.output} (<NUM> id {model.config.num_token_id}, vocab {model.config.vocab_size}, "
          f"seed {args.seed})")
    return 0


def _load(path: str):
    from . import CausalQwenForCausalLM, CausalQwenTokenizer

    model = CausalQwenForCausalLM.from_pretrained(path).eval()
    tokenizer = CausalQwenTokenizer.from_pretrained(path)
    if model.config.use_numeric and tokenizer.num_token_id != model.config.num_token_id:
        raise SystemExit(f"tokenizer <NUM> id {tokenizer.num_token_id} != model's {model.config.num_token_id}")
    return model, tokenizer


def _written(numbers: tuple[float, ...], supported: tuple[float, float, float] | None) -> list[str]:
    """`numbers` as digits: rounded to the place the `supported` (median, 50% low, 50% high) allows, or every
    digit where None."""
    place = None if supported is None else supported_place(*supported)
    return [str(n) if not math.isfinite(n) else format_number(n if place is None else round(n, place))
            for n in numbers]


def _say_rounding(full_precision: bool) -> None:
    if not full_precision:
        print("(numbers rounded to the digits their 50% interval supports; --full-precision writes every digit)",
              file=sys.stderr)


def run_serve(args) -> int:
    from .integrations.vllm_server import main as serve

    serve(["--model", args.model, *args.options])
    return 0


def run_value(args) -> int:
    import warnings

    model, tokenizer = _load(args.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said per prompt below
        values = model.next_value(tokenizer, args.prompt)
    for prompt, value in zip(args.prompt, values, strict=True):
        (low50, high50), (low90, high90) = value.intervals[0.5], value.intervals[0.9]
        supported = None if args.full_precision else (value.median, low50, high50)
        median, low50, high50, low90, high90 = _written((value.median, low50, high50, low90, high90), supported)
        note = "" if value.writes_number else "  (the model's next token here is not <NUM>)"
        print(f"{prompt}{value.separator}{median}  50% [{low50}, {high50}]  90% [{low90}, {high90}]{note}")
    _say_rounding(args.full_precision)
    return 0


def run_generate(args) -> int:
    import torch

    model, tokenizer = _load(args.model)
    tokenizer.padding_side = "left"
    batch = tokenizer(args.prompt, return_tensors="pt", padding=True)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p))
                if v is not None}
    out = model.generate(
        **batch, mode=args.mode, shared_individual=args.shared_individual, shared_noise=args.shared_noise,
        do_sample=args.do_sample or None, max_new_tokens=args.max_new_tokens,
        generator=torch.Generator().manual_seed(args.seed), return_dict_in_generate=True,
        output_value_scores=args.intervals or not args.full_precision, pad_token_id=tokenizer.pad_token_id, **sampling,
    )
    start = batch["input_ids"].shape[1]
    values = out.numeric_values
    if not args.full_precision and out.loc_Y is not None:
        values = model.round_generated_numbers(out.sequences, values, out.loc_Y, out.scale_Y)
    for row, prompt in enumerate(args.prompt):
        ids = out.sequences[row, start:]
        text = tokenizer.decode(ids, numeric_values=values[row, start:], skip_special_tokens=True)
        print(prompt + text)
        if args.intervals:
            _print_intervals(model, out, row, start, args.full_precision)
    if out.loc_Y is not None:
        _say_rounding(args.full_precision)
    return 0


def _number_steps(model, out, row: int, start: int) -> list[int]:
    return (out.sequences[row, start:] == model.config.num_token_id).nonzero().flatten().tolist()


def _print_intervals(model, out, row: int, start: int, full_precision: bool) -> None:
    """One line per generated number; one line saying why when there is none, rather than silence."""
    if out.loc_Y is None:
        print("  (no interval: this model has no regression head)")
        return
    steps = _number_steps(model, out, row, start)
    if not steps:
        print("  (no number generated: no interval)")
    for step in steps:
        loc, scale = out.loc_Y[row, step], out.scale_Y[row, step]
        median, low, high = (t.item() for t in model.value_interval(loc, scale, 0.9))
        supported = None if full_precision else tuple(t.item() for t in model.value_interval(loc, scale, 0.5))
        median, low, high = _written((median, low, high), supported)
        print(f"  number {median}: 90% interval [{low}, {high}]")


def _examples(args, split: str | None = None, n: int | None = None) -> list:
    """Texts or prompt/completion dicts, from the built-in corpus or a data file."""
    from .data import generate_corpus
    from .data.texts import read_examples

    if args.data == "corpus":
        return [example.text for example in generate_corpus(n or args.num_examples, split=split or args.split,
                                                            seed=args.seed)]
    if getattr(args, "examples", None) is not None:  # read by the checks already
        return args.examples
    try:
        return read_examples(args.data, args.text_column, args.prompt_column, args.completion_column)
    except ValueError as error:  # names the file and the line: the message is the whole story, not a traceback
        raise SystemExit(f"causal-qwen {args.command}: {error}") from None


def _eval_plan(args) -> tuple[int, int]:
    """Evaluate every `steps` steps on at most `examples` examples; by default once, costing less than training."""
    steps = args.max_steps if args.eval_steps is None else args.eval_steps
    evaluations = args.max_steps // steps if steps else 0
    examples = args.eval_examples or max(1, args.max_steps * args.batch_size // max(1, evaluations))
    return steps, examples


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def _value_learning(args):
    """The read-out's training settings of `--value-learning` and `--value-learning-rate` (None: off)."""
    from .starts import ValueLearning

    if not args.value_learning:
        return None
    return ValueLearning() if args.value_learning_rate is None else ValueLearning(
        learning_rate=args.value_learning_rate)


def run_train(args) -> int:
    from transformers import TrainingArguments

    from .data import CausalQwenDataCollator
    from .data.texts import tokenize_examples
    from .plots import plot_loss_curves
    from .training import CausalQwenTrainer

    model, tokenizer = _load(args.model)
    model.train()
    train_features = tokenize_examples(tokenizer, _examples(args), args.max_length)
    eval_steps, eval_size = _eval_plan(args)
    if not eval_steps:
        eval_examples = []
    elif args.eval_data and args.eval_data != "corpus":
        eval_examples = _examples(argparse.Namespace(**{**vars(args), "data": args.eval_data}))
    elif args.eval_data == "corpus" or args.data == "corpus":
        eval_examples = _examples(args, split="validation", n=max(16, args.num_examples // 10))
    else:
        eval_examples = []
    eval_features = tokenize_examples(tokenizer, eval_examples, args.max_length) or None
    if eval_features and len(eval_features) > eval_size:
        print(f"evaluating on the first {eval_size} of {len(eval_features)} evaluation examples (--eval-examples)")
        eval_features = eval_features[:eval_size]
    training_args = TrainingArguments(
        output_dir=args.output, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.learning_rate, seed=args.seed,
        logging_steps=max(1, args.max_steps // 20), eval_strategy="steps" if eval_features else "no",
        eval_steps=eval_steps or None, save_strategy="no", report_to=args.report_to,
        dataloader_pin_memory=_has_accelerator(),  # pinning without an accelerator only warns
    )
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    trainer = CausalQwenTrainer(model=model, args=training_args, train_dataset=train_features,
                                eval_dataset=eval_features, data_collator=collator,
                                value_head_start=args.value_head_start,
                                train_value_features=args.train_value_features,
                                value_learning=_value_learning(args),
                                value_start_rows=args.value_start_rows)
    if trainer.value_head_start is not None and model.config.use_numeric and model.config.value_head_fit is None:
        # The start reads the training data through the model before the first step: minutes on a CPU, in silence.
        print("fitting the value head to the training data's numbers before the first step "
              "(docs/training.md#the-value-heads-start-from-data) ...")
    with progress_bars():  # the start's bar of rows read, which the weights' quiet would hide
        trainer.train()
    learner = trainer.value_head_start.learner if trainer.value_head_start is not None else None
    if learner is not None:
        record = learner.record
        print(f"value held-out median absolute error (head space): start {record.start_error:.4g}, "
              f"after training {record.best_error:.4g}")
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    curve = plot_loss_curves(trainer.state.log_history, Path(args.output) / "loss.png")
    print(f"saved the trained model to {args.output}; loss curve in {curve}")
    return 0


def run_eval(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from .data import CausalQwenDataCollator
    from .data.texts import tokenize_examples
    from .metrics import evaluate

    model, tokenizer = _load(args.model)
    features = tokenize_examples(tokenizer, _examples(args), args.max_length)
    if not features:
        raise SystemExit("no evaluation texts")
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    batches = (collator(features[i:i + args.batch_size]) for i in range(0, len(features), args.batch_size))
    total = -(-len(features) // args.batch_size)
    metrics, stats = evaluate(model, tqdm(batches, total=total, desc="evaluating"),
                              generator=torch.Generator().manual_seed(args.seed), return_statistics=True)
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        print(f"{key:<{width}}  {value:.6g}")
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    if args.plots:
        from .plots import plot_evaluation

        for path in plot_evaluation(model, stats, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
