"""`pipeline("text-generation")` for CausalQwen: prompt numbers reach the model, generated numbers come back as digits.

transformers' text-generation pipeline hands only `input_ids` and `attention_mask` to `generate` and decodes
ids alone. For a CausalQwen model this pipeline also passes the prompt's `numeric_values`, asks `generate`
for the generated ones, and decodes with them. For every other model it behaves exactly as the stock one,
which it extends; importing `causal_qwen` registers it for the task.
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.pipelines import PIPELINE_REGISTRY, TextGenerationPipeline
from transformers.pipelines.text_generation import Chat, ReturnType
from transformers.utils import logging

from .pairing import check_tokenizer_matches

__all__ = ["CausalQwenTextGenerationPipeline", "register_pipeline"]


def _is_causal_qwen(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "model_type", None) == "causal_qwen"


class CausalQwenTextGenerationPipeline(TextGenerationPipeline):
    """The text-generation pipeline, with numbers for CausalQwen models.

    Generation arguments of CausalQwen (`mode`, `generator`, `shared_individual`, ...) pass through:
    `pipe(prompt, mode="causal", generator=torch.Generator().manual_seed(0), max_new_tokens=20)`.

    A generated number is written with the digits its 50% interval supports (`model.round_generated_numbers`, as
    `causal-qwen generate` writes it: 29.21944 with an interval of ±2.85 is written 29.2); `full_precision=True`
    writes every digit of the float, and `return_tensors=True` returns the values as generated.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_tokenizer_matches(self.model, self.tokenizer)  # a mismatched pair would misread every number

    @property
    def _default_generation_config(self) -> GenerationConfig:
        # The stock default samples from the softmax, which only `traditional` mode does; CausalQwen's own modes
        # decide by argmax, so its default leaves `do_sample` to the call (`do_sample=True` selects traditional).
        if _is_causal_qwen(self.model):
            return GenerationConfig(max_new_tokens=256)
        return TextGenerationPipeline._default_generation_config

    def _sanitize_parameters(self, **kwargs):
        causal = {k: kwargs.pop(k) for k in ("mode", "shared_individual", "shared_noise", "generator") if k in kwargs}
        full_precision = kwargs.pop("full_precision", None)
        if full_precision is not None and not isinstance(full_precision, bool):
            raise TypeError(f"full_precision must be True or False, got {full_precision!r}")
        preprocess, forward, postprocess = super()._sanitize_parameters(**kwargs)
        forward.update(causal)
        if full_precision is not None:
            forward["full_precision"] = postprocess["full_precision"] = full_precision
        return preprocess, forward, postprocess

    def _forward(self, model_inputs, full_precision: bool = False, **generate_kwargs):
        if not _is_causal_qwen(self.model):
            return super()._forward(model_inputs, **generate_kwargs)
        numeric_values = model_inputs.pop("numeric_values", None)
        if numeric_values is not None and model_inputs["input_ids"].shape[1] > 0:
            generate_kwargs["numeric_values"] = numeric_values
        generate_kwargs["return_dict_in_generate"] = True
        # The intervals the written numbers are rounded to (read off the same forward passes).
        generate_kwargs["output_value_scores"] = not full_precision
        # The stock pipeline reshapes every tensor of the generate output per prompt, numeric_values included; before
        # transformers 5.20 it nests them under "additional_outputs".
        outputs = super()._forward(model_inputs, **generate_kwargs)
        nested = outputs.get("additional_outputs") or {}
        if "numeric_values" not in outputs and "numeric_values" in nested:
            outputs["numeric_values"] = nested["numeric_values"]
        return outputs

    def postprocess(self, model_outputs, return_type=ReturnType.FULL_TEXT, clean_up_tokenization_spaces=None,
                    continue_final_message=None, skip_special_tokens=None, full_precision: bool = False, **kwargs):
        if not _is_causal_qwen(self.model) or "numeric_values" not in model_outputs:
            return super().postprocess(model_outputs, return_type=return_type,
                                       clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                                       continue_final_message=continue_final_message,
                                       skip_special_tokens=skip_special_tokens, **kwargs)
        sequences = model_outputs["generated_sequence"][0]
        values = model_outputs["numeric_values"][0]
        loc_y = model_outputs.get("loc_Y")
        if return_type != ReturnType.TENSORS and not full_precision and loc_y is not None:
            base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            values = base.round_generated_numbers(sequences, values, loc_y[0], model_outputs["scale_Y"][0])
        sequences, values = sequences.tolist(), values.tolist()
        input_ids = model_outputs["input_ids"]
        prompt = model_outputs["prompt_text"]
        start = 0 if input_ids is None else input_ids.shape[-1]
        skip = True if skip_special_tokens is None else skip_special_tokens
        records = []
        for ids, row in zip(sequences, values, strict=True):
            if return_type == ReturnType.TENSORS:
                records.append({"generated_token_ids": ids, "generated_numeric_values": row})
                continue
            text = self.tokenizer.decode(ids[start:], numeric_values=row[start:], skip_special_tokens=skip)
            if return_type == ReturnType.FULL_TEXT:
                text = self._with_prompt(prompt, text, continue_final_message)
            records.append({"generated_text": text})
        return records

    @staticmethod
    def _with_prompt(prompt, text: str, continue_final_message: bool | None):
        if isinstance(prompt, str):
            return prompt + text
        if isinstance(prompt, Chat):
            messages = list(prompt.messages)
            if continue_final_message is None:
                continue_final_message = messages[-1]["role"] == "assistant"
            if continue_final_message:
                last = messages[-1]
                return messages[:-1] + [{"role": last["role"], "content": last["content"] + text}]
            return messages + [{"role": "assistant", "content": text}]
        return text


def register_pipeline() -> None:
    """Make `pipeline("text-generation")` build [`CausalQwenTextGenerationPipeline`] (a superset of the stock one)."""
    logger = logging.get_logger("transformers.pipelines.base")
    level = logger.level
    logger.setLevel(logging.ERROR)  # re-registering an existing task warns; here that is the intent
    stock = PIPELINE_REGISTRY.supported_tasks.get("text-generation", {})
    try:
        PIPELINE_REGISTRY.register_pipeline(
            "text-generation", pipeline_class=CausalQwenTextGenerationPipeline,
            pt_model=stock.get("pt", AutoModelForCausalLM), default=stock.get("default"),
            type=stock.get("type", "text"),
        )
    finally:
        logger.setLevel(level)
