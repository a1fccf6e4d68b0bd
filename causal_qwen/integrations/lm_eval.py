"""The lm-evaluation-harness model `causal-qwen`: HFLM with the numbers of CausalQwen.

lm-eval's `hf` model (HFLM) encodes with `tokenizer.encode`, which returns ids only, and calls the model with
`input_ids` alone, so a CausalQwen checkpoint would get its `<NUM>` tokens without their values. The model refuses
such inputs (a ValueError naming `numeric_values`) rather than reading every number as 0; this model passes them:

- every number of a context or continuation is encoded as `<NUM>` with its value, and reaches the model as
  `numeric_values` in `loglikelihood`, `loglikelihood_rolling` and `generate_until`;
- a continuation token scores as in HFLM, the log-softmax of `logits` (`loc_S`); a `<NUM>` continuation token
  scores log P(`<NUM>`) + log P(Y in the interval the written number stands for), where Y ~ Cauchy(loc_Y, scale_Y)
  is the value head's prediction and the interval is the number ± half a unit of its last written digit (`5`:
  [4.5, 5.5], `3.14`: [3.135, 3.145], `2e3`: [1500, 2500]). This is the probability of writing that number at that
  precision, so it is at most 1 and comparable with text and between choices; the token is greedy when `<NUM>` is
  the argmax and the median value falls in the interval;
- generated numbers are written with the values the model predicts (`generate(..., mode=...)`; by default
  `traditional` for a task that asks for `do_sample`, `standard` otherwise).

Texts without numbers score exactly as with HFLM on the same model. Usage (lm_eval is an optional extra,
`pip install "causal_qwen[lm-eval]"`):

```python
import causal_qwen.integrations.lm_eval  # registers "causal-qwen" with lm-eval
import lm_eval

results = lm_eval.simple_evaluate(model="causal-qwen", model_args="pretrained=path/to/causal-qwen", tasks=[...])
```

or from the shell, `python -m causal_qwen.integrations.lm_eval run --model causal-qwen --model_args
pretrained=path/to/causal-qwen --tasks ...` (lm-eval's own command line, with this model registered).
"""

from __future__ import annotations

import sys

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import Collator, _add_special_kwargs, has_bos_prefix
    from lm_eval.models.utils_hf import pad_and_concat, stop_sequences_criteria
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "causal_qwen.integrations.lm_eval needs lm-evaluation-harness: pip install \"causal_qwen[lm-eval]\""
    ) from error

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import register as _register_causal_qwen
from ..cauchy import interval_probability, transform_values
from ..generation_options import GENERATION_MODES
from ..numbers import scan_numbers
from ..pairing import check_tokenizer_matches

__all__ = ["CausalQwenLM", "number_resolution"]

_register_causal_qwen()  # AutoModelForCausalLM / AutoTokenizer know CausalQwen before HFLM loads a folder

# A `<NUM>` travels through lm-eval's token lists (sorting, windows, truncation, tensors) as one int: an id from
# this base on, one per distinct (value, resolution), far above any vocabulary.
_VIRTUAL_BASE = 1 << 40
# Stands for a generated number while the stop sequences are looked for (no stop sequence contains it).
_NUMBER_PLACEHOLDER = "\ufffc"
_FULL_WIDTH_DIGITS = str.maketrans("\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19", "0123456789")


def number_resolution(text: str) -> float:
    """One unit of the last written digit of a number: `5` → 1, `3.14` → 0.01, `1,250` → 1, `2.5e3` → 100."""
    mantissa, _, exponent = text.translate(_FULL_WIDTH_DIGITS).replace(",", "").lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


class CausalQwenLM(HFLM):
    """lm-eval's HFLM for CausalQwen checkpoints: numbers reach the model as values and are scored as values.

    Args:
        pretrained: a CausalQwen folder (or model), with its `CausalQwenTokenizer`; any other model behaves
            exactly as with HFLM.
        mode: the generation mode of `generate_until` (`standard`, `causal` or `traditional`); by default
            `traditional` when a task samples, `standard` otherwise (`generate`'s rule).
        **kwargs: every argument of HFLM (`batch_size`, `device`, `dtype`, `max_length`, ...).
    """

    def __init__(self, pretrained, mode: str | None = None, **kwargs):
        if mode is not None and mode not in GENERATION_MODES:
            raise ValueError(f"mode must be one of {GENERATION_MODES}, got {mode!r}")
        kwargs.setdefault("backend", "causal")  # transformers' causal-LM table does not list causal_qwen
        super().__init__(pretrained, **kwargs)
        self.mode = mode
        config = getattr(self.model, "config", None)
        check_tokenizer_matches(self.model, self.tokenizer)
        self._numeric = (
            getattr(config, "model_type", None) == "causal_qwen" and bool(config.use_numeric)
            and bool(getattr(self.tokenizer, "use_numeric", False)) and self.backend == "causal"
        )
        self._num_token_id = self.tokenizer.num_token_id if self._numeric else None
        self._numbers: list[tuple[float, float]] = []  # virtual id - _VIRTUAL_BASE → (value, resolution)
        self._number_ids: dict[tuple[float, float], int] = {}

    # --------------------------------------------------------------------------------------------------------
    # Numbers as virtual ids
    # --------------------------------------------------------------------------------------------------------

    def _virtual_id(self, value: float, resolution: float) -> int:
        key = (float(value), float(resolution))
        found = self._number_ids.get(key)
        if found is None:
            found = self._number_ids[key] = _VIRTUAL_BASE + len(self._numbers)
            self._numbers.append(key)
        return found

    def _split(self, tokens) -> tuple[list[int], list[float], list[float]]:
        """Virtual token list → real ids, values (0 where no number) and resolutions (0 where no number)."""
        ids, values, resolutions = [], [], []
        for token in tokens:
            token = int(token)
            if token >= _VIRTUAL_BASE:
                value, resolution = self._numbers[token - _VIRTUAL_BASE]
                ids.append(self._num_token_id)
                values.append(value)
                resolutions.append(resolution)
            else:
                ids.append(token)
                values.append(0.0)
                resolutions.append(0.0)
        return ids, values, resolutions

    def _virtualize(self, text: str, ids: list[int], values: list[float]) -> list[int]:
        resolutions = iter([number_resolution(text[start:end]) for start, end, _ in scan_numbers(text)])
        tokens = []
        for token, value in zip(ids, values, strict=True):
            if token == self._num_token_id:
                tokens.append(self._virtual_id(value, next(resolutions)))
            else:
                tokens.append(int(token))
        return tokens

    # --------------------------------------------------------------------------------------------------------
    # Encoding and decoding
    # --------------------------------------------------------------------------------------------------------

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        if not self._numeric:
            return super().tok_encode(string, add_special_tokens=add_special_tokens,
                                      left_truncate_len=left_truncate_len, **kwargs)
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoded = self.tokenizer(string, **special)
        tokens = self._virtualize(string, encoded["input_ids"], encoded["numeric_values"])
        return tokens[-left_truncate_len:] if left_truncate_len else tokens

    def tok_batch_encode(self, strings: list[str], padding_side: str = "left", left_truncate_len: int | None = None,
                         truncation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._numeric:
            return super().tok_batch_encode(strings, padding_side=padding_side, left_truncate_len=left_truncate_len,
                                            truncation=truncation)
        special = {}
        if has_bos_prefix(strings[0], getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        rows = [self.tok_encode(string, **special) if special else self.tok_encode(string) for string in strings]
        if left_truncate_len:
            rows = [row[-left_truncate_len:] for row in rows]
        width = max(len(row) for row in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            span = slice(width - len(row), width) if padding_side == "left" else slice(0, len(row))
            ids[index, span] = torch.tensor(row, dtype=torch.long)
            mask[index, span] = 1
        return ids, mask

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        if not self._numeric:
            return super().tok_decode(tokens, skip_special_tokens=skip_special_tokens)
        if isinstance(tokens, int):
            tokens = [tokens]
        ids, values, _ = self._split(tokens)
        return self.tokenizer.decode(ids, numeric_values=values, skip_special_tokens=skip_special_tokens)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not self._numeric:
            return super()._encode_pair(context, continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_enc = self.tok_encode(context)
        if whole[: len(context_enc)] != context_enc and any(t >= _VIRTUAL_BASE for t in whole + context_enc):
            # The context's last number runs on into the continuation (`1` + `2` reads as `12`): encode apart.
            return context_enc, self.tok_encode(continuation, add_special_tokens=False)
        return context_enc, whole[len(context_enc):]

    # --------------------------------------------------------------------------------------------------------
    # Scoring
    # --------------------------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if not self._numeric:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

        def by_length(request):
            tokens = request[1] + request[2]
            return -len(tokens), tuple(tokens)

        ordered = Collator(requests, sort_fn=by_length)
        batch_size = self.batch_size if self.batch_size != "auto" else override_bs if override_bs is not None else 0
        batch_fn = (self._batch_scheduler if self.batch_size == "auto" and len(ordered) > 0 and not override_bs
                    else None)
        if batch_fn is not None:
            self.batch_sizes = {}
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests")
        results = []
        for chunk in ordered.get_batched(n=batch_size, batch_fn=batch_fn):
            inputs, values, lengths = [], [], []
            for _, context_enc, continuation_enc in chunk:
                if not context_enc or not continuation_enc:
                    raise ValueError("an empty context or continuation cannot be scored")
                window = (context_enc + continuation_enc)[-(self.max_length + 1):][:-1]
                ids, row_values, _ = self._split(window)
                inputs.append(torch.tensor(ids, dtype=torch.long, device=self.device))
                values.append(torch.tensor(row_values, dtype=torch.float64, device=self.device))
                lengths.append(len(ids))
            width = max(lengths)
            batch_ids = pad_and_concat(width, inputs, padding_side="right")
            batch_values = pad_and_concat(width, values, padding_side="right").to(torch.float64)
            out = self._numeric_call(batch_ids, batch_values)
            log_probs = F.log_softmax(out.logits, dim=-1, dtype=self.softmax_dtype)
            for (request_str, _, continuation_enc), row_log_probs, loc_y, scale_y, length in zip(
                chunk, log_probs, out.loc_Y, out.scale_Y, lengths, strict=True
            ):
                answer = self._score(continuation_enc, row_log_probs, loc_y, scale_y, length)
                results.append(answer)
                if request_str is not None:
                    self.cache_hook.add_partial("loglikelihood", request_str, answer)
                progress.update(1)
        progress.close()
        return ordered.get_original(results)

    def _numeric_call(self, input_ids: torch.Tensor, numeric_values: torch.Tensor):
        autocast = torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                  enabled=self.mixed_precision_dtype is not None)
        with torch.no_grad(), autocast:
            return self.model(input_ids=input_ids, numeric_values=numeric_values)

    def _score(self, continuation_enc, log_probs, loc_y, scale_y, length: int) -> tuple[float, bool]:
        """(log-likelihood, greedy) of one continuation from its row of the batch."""
        targets, values, resolutions = self._split(continuation_enc)
        positions = torch.arange(length - len(targets), length, device=log_probs.device)
        rows = log_probs[positions]
        target_ids = torch.tensor(targets, dtype=torch.long, device=log_probs.device)
        total = rows.gather(1, target_ids[:, None]).squeeze(1).double().sum()
        greedy = bool((rows.argmax(-1) == target_ids).all())
        is_num = target_ids == self._num_token_id
        if bool(is_num.any()):
            at = positions[is_num]
            value = torch.tensor(values, dtype=torch.float64, device=log_probs.device)[is_num]
            half = torch.tensor(resolutions, dtype=torch.float64, device=log_probs.device)[is_num] / 2
            loc, scale = loc_y[at].double(), scale_y[at].double()
            transform = self.model.config.value_transform
            lower, upper = transform_values(value - half, transform), transform_values(value + half, transform)
            probability = interval_probability(lower, upper, loc, scale)
            total = total + torch.log(probability).sum()
            median = self.model.to_value(loc)
            greedy = greedy and bool(((median - value).abs() <= half).all())
        return float(total), greedy

    # --------------------------------------------------------------------------------------------------------
    # Generation
    # --------------------------------------------------------------------------------------------------------

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        if not self._numeric:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        do_sample = generation_kwargs.get("do_sample")
        if (temperature := generation_kwargs.get("temperature")) == 0.0 and do_sample is None:
            generation_kwargs["do_sample"] = do_sample = False
        if do_sample is False and temperature == 0.0:
            generation_kwargs.pop("temperature", None)
        ids, values = [], []
        for row in context.tolist():
            row_ids, row_values, _ = self._split(row)
            ids.append(row_ids)
            values.append(row_values)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        numeric_values = torch.tensor(values, dtype=torch.float64, device=self.device)
        stopping = stop_sequences_criteria(_StopSequenceReader(self.tokenizer), stop, input_ids.shape[1],
                                           input_ids.shape[0])
        autocast = torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                  enabled=self.mixed_precision_dtype is not None)
        with autocast:
            out = self.model.generate(
                input_ids=input_ids, numeric_values=numeric_values, mode=self.mode, max_length=max_length,
                stopping_criteria=stopping, pad_token_id=self.tokenizer.pad_token_id, use_cache=True,
                return_dict_in_generate=True, **generation_kwargs,
            )
        sequences = out.sequences.tolist()
        generated_values = out.numeric_values.tolist()
        rows = []
        for row_ids, row_values in zip(sequences, generated_values, strict=True):
            rows.append([self._virtual_id(value, 0.0) if token == self._num_token_id else token
                         for token, value in zip(row_ids, row_values, strict=True)])
        return torch.tensor(rows, dtype=torch.long)


if __name__ != "__main__":  # run as a script, the module registers when `main` imports it under its own name
    register_model("causal-qwen", "causal_qwen")(CausalQwenLM)


class _StopSequenceReader:
    """What lm-eval's stop-sequence criteria ask of a tokenizer, with each `<NUM>` read as a placeholder.

    While generating, the values of the numbers are not at hand to the stopping criteria; a number cannot contain a
    stop sequence that matters to a task (they are text such as "\\n\\n" or "Question:"), and the final text is cut at
    the first stop sequence by lm-eval after decoding with the values.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def batch_decode(self, sequences) -> list[str]:
        num_token_id = self.tokenizer.num_token_id
        texts = []
        for row in sequences.tolist():
            runs, run = [], []
            for token in row:
                if token == num_token_id:
                    runs.append(run)
                    run = []
                else:
                    run.append(token)
            runs.append(run)
            texts.append(_NUMBER_PLACEHOLDER.join(self.tokenizer.decode(part) for part in runs))
        return texts


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with `causal-qwen` registered: `python -m causal_qwen.integrations.lm_eval run ...`."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    from causal_qwen.integrations.lm_eval import main as _main

    _main()
