"""TRL's `SFTTrainer` for CausalQwen: the model's own loss, with its numbers (extra `trl`).

`trl.SFTTrainer` does three things that do not fit CausalQwen (trl 1.16):

- it replaces the model's forward with a fused LM head (`trl.trainer.utils.add_fused_lm_head`): the bare backbone,
  then a softmax cross-entropy over `get_output_embeddings()`. That skips the numeric embedding, the abduction
  network and the One-vs-Rest and regression losses; only `cls_head` trains, as a softmax classifier. No `SFTConfig`
  option turns the fused head off, so CausalQwen refuses it (`ValueError` when the trainer is built);
- its dataset preparation keeps only `input_ids` of the tokenizer's output, and `remove_unused_columns` keeps only
  `input_ids`, `labels` and `seq_lengths`: the `numeric_values` of the CausalQwen tokenizer are lost;
- its collator pads `input_ids` and `labels` only, so `<NUM>` would be trained as a class without its value.

`CausalQwenSFTTrainer` takes `SFTTrainer`'s arguments and datasets (plain text, prompt/completion, conversational,
already tokenized) and trains what `CausalQwenTrainer` trains: the model's own loss (`loss = cls_loss + λ·reg_loss`,
docs/design.md §4) on batches of `CausalQwenDataCollator` that carry `numeric_values` and `numeric_labels`, with
the per-module learning rates and the value head's start from data.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset
from transformers import Trainer
from trl import SFTConfig, SFTTrainer
from trl.data_utils import is_conversational

from ..data.collator import CausalQwenDataCollator
from ..data.texts import tokenize_examples
from ..forward_guard import keeping_own_forward
from ..training import CausalQwenTrainer, _check_not_empty

__all__ = ["CausalQwenSFTTrainer"]

# Columns the collator reads; `remove_unused_columns` keeps these (TRL keeps input_ids, labels and seq_lengths).
_COLUMNS = ["input_ids", "attention_mask", "labels", "numeric_values", "numeric_labels", "completion_mask"]


def _text_tokenizer(processing_class):
    """The tokenizer of `processing_class` (a processor's `tokenizer`, or the tokenizer itself)."""
    return getattr(processing_class, "tokenizer", processing_class)


class CausalQwenSFTTrainer(CausalQwenTrainer, SFTTrainer):
    """`trl.SFTTrainer` that trains CausalQwen's own loss with its numbers.

    Same arguments as `SFTTrainer` (`args` an `SFTConfig` or `TrainingArguments`), plus `learning_rate_scales`,
    `value_head_start`, `refit_value_readout` and `train_value_features` of [`CausalQwenTrainer`]. What differs
    from `SFTTrainer`:

    - the loss is the model's own (`Trainer.compute_loss`: the forward with `labels`, which takes the fused OvR
      path of docs/design.md §4.1), never TRL's softmax head; `loss` in the logs is that loss, and `total_loss`,
      `cls_loss_mean`, `reg_loss_effective` are logged beside it. TRL's `entropy` and `mean_token_accuracy` are not
      logged (no softmax is computed); `eval_accuracy` of `CausalQwenMetrics` measures the accuracy.
    - datasets are tokenized by the CausalQwen tokenizer (`processing_class`) with `tokenize_examples`, so numbers
      become `<NUM>` with their values: a text column (`dataset_text_field`, or `formatting_func`) gets the
      end-of-sequence token appended as TRL does; a `prompt`/`completion` pair has labels −100 on the prompt (unless
      `completion_only_loss=False`) and `max_length` cuts the prompt from its start, keeping the completion;
      conversational data (`messages`, or conversational prompt/completion) is rendered with the tokenizer's chat
      template first. A dataset that already has `input_ids` is used as it is (give it `numeric_values`).
    - the default collator is `CausalQwenDataCollator.from_tokenizer(processing_class)`.
    - a tokenizer that does not read numbers (the base model's plain Qwen2 tokenizer) trains the model as text, as
      SFTTrainer would: numbers stay digits, `numeric_values` are 0, the value head's start is skipped, and a
      warning names the `CausalQwenTokenizer` that trains the numbers.

    Not supported (a `ValueError` names them): `packing`, `padding_free`, `assistant_only_loss`, `loss_type` other
    than `"nll"`, `compute_loss_func` and label smoothing (each would replace the model's loss), `truncation_mode=
    "keep_end"`.
    """

    def __init__(self, model, args: SFTConfig | None = None, *rest,
                 learning_rate_scales: dict[str, float] | None = None, value_head_start: bool = True, **kwargs: Any):
        _check_supported(args, kwargs)
        collator_given = (rest[0] if rest else kwargs.get("data_collator")) is not None
        # SFTTrainer reads the first example of each dataset before anything else: refuse an empty one first.
        for i, name in ((1, "train_dataset"), (2, "eval_dataset")):
            _check_not_empty(name, rest[i] if len(rest) > i else kwargs.get(name))
        with keeping_own_forward():  # the model leaves out the fused head SFTTrainer installs
            super().__init__(model, args, *rest, learning_rate_scales=learning_rate_scales,
                             value_head_start=value_head_start, **kwargs)
        if not collator_given:
            self.data_collator = CausalQwenDataCollator.from_tokenizer(_text_tokenizer(self.processing_class))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's own loss, as `Trainer` computes it (SFTTrainer's would call TRL's fused softmax head)."""
        loss_inputs = self._loss_inputs(inputs, num_items_in_batch)
        loss, outputs = Trainer.compute_loss(self, model, loss_inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        self._record_loss_parts(model, loss_inputs, outputs, loss, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Trainer's: it returns every label (labels and numeric_labels), which CausalQwenMetrics reads.
        return Trainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(_COLUMNS)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if packing:
            raise ValueError("packing is not supported by CausalQwenSFTTrainer: it would drop numeric_values")
        columns = dataset.column_names or list(next(iter(dataset)).keys())
        if "input_ids" not in columns:
            tokenizer = _text_tokenizer(processing_class)
            completion_only = self.completion_only_loss
            map_kwargs = {"num_proc": args.dataset_num_proc} if isinstance(dataset, Dataset) else {}

            def tokenize(batch: dict[str, list]) -> dict[str, list]:
                rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
                features = _tokenize_rows(tokenizer, rows, args, formatting_func, completion_only)
                return {key: [f[key] for f in features] for key in features[0]}

            dataset = dataset.map(tokenize, batched=True, remove_columns=columns, **map_kwargs)
        if args.shuffle_dataset:
            dataset = dataset.shuffle(seed=args.seed)
        return dataset


def _check_supported(args, kwargs: dict) -> None:
    if args is not None:
        for name, bad in (("packing", getattr(args, "packing", False)), ("eval_packing", getattr(args, "eval_packing",
                          None)), ("padding_free", getattr(args, "padding_free", False)),
                          ("assistant_only_loss", getattr(args, "assistant_only_loss", False)),
                          ("label_smoothing_factor", getattr(args, "label_smoothing_factor", 0) > 0)):
            if bad:
                raise ValueError(f"{name} is not supported by CausalQwenSFTTrainer (it would drop numeric_values or "
                                 "replace the model's loss)")
        if getattr(args, "loss_type", "nll") != "nll":
            raise ValueError(f"loss_type={args.loss_type!r} is not supported: CausalQwenSFTTrainer trains the model's "
                             "own loss")
        if getattr(args, "truncation_mode", "keep_start") != "keep_start":
            raise ValueError("truncation_mode must be 'keep_start' with CausalQwenSFTTrainer")
    if kwargs.get("compute_loss_func") is not None:
        raise ValueError("compute_loss_func is not supported: CausalQwenSFTTrainer trains the model's own loss")


def _tokenize_rows(tokenizer, rows: list[dict], args, formatting_func, completion_only: bool) -> list[dict]:
    """Feature dicts (`input_ids`, `attention_mask`, `numeric_values`, and `labels` for pairs) for `rows`."""
    eos = tokenizer.eos_token_id
    first = rows[0]
    if formatting_func is not None:
        texts = [formatting_func(row) for row in rows]
    elif "prompt" in first and "completion" in first:
        pairs, add_eos = [_pair(tokenizer, row) for row in rows], not is_conversational(first)
        if add_eos:  # appended once, as an id (TRL appends it to completions that do not end with it)
            eos_text = tokenizer.eos_token
            pairs = [{**pair, "completion": pair["completion"].removesuffix(eos_text)} for pair in pairs]
        features = tokenize_examples(tokenizer, pairs, max_length=args.max_length, add_eos=add_eos)
        if not completion_only:
            for feature in features:
                del feature["labels"]  # the collator labels every position
        return features
    elif is_conversational(first):
        texts = [_render(tokenizer, row["messages"], row) for row in rows]
    else:
        texts = [row[args.dataset_text_field] for row in rows]
    features = tokenize_examples(tokenizer, texts)
    for feature in features:
        # TRL appends the end-of-sequence token to plain texts (a chat template writes its own end of turn).
        if (formatting_func is not None or not is_conversational(first)) and feature["input_ids"][-1:] != [eos]:
            for key, value in (("input_ids", eos), ("attention_mask", 1), ("numeric_values", 0.0)):
                feature[key].append(value)
        if args.max_length is not None:
            for key in feature:
                feature[key] = feature[key][:args.max_length]
    return features


def _pair(tokenizer, row: dict) -> dict:
    """A prompt/completion row as strings; a conversational one rendered with the chat template."""
    if not is_conversational(row):
        return {"prompt": row["prompt"], "completion": row["completion"]}
    prompt = _render(tokenizer, row["prompt"], row, add_generation_prompt=True)
    full = _render(tokenizer, row["prompt"] + row["completion"], row)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the prompt differently alone and with its completion; render "
                         "the examples to prompt/completion strings first")
    return {"prompt": prompt, "completion": full[len(prompt):]}


def _render(tokenizer, messages: list, row: dict, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=row.get("tools"), **(row.get("chat_template_kwargs") or {}))
