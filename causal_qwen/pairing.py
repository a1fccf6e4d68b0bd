"""The check that a CausalQwen model and a tokenizer agree on the id of `<NUM>`.

A config's `num_token_id` and a tokenizer's `<NUM>` id are set apart (the config by `from_qwen`, the tokenizer by
the token it adds at the end of its vocabulary), and `from_pretrained` loads each on its own, so a checkpoint whose
two files disagree loads without a word: the model then reads every number as some other token. They are compared
where the two meet: the `text-generation` pipeline, `CausalQwenTrainer`, the `causal-qwen` command and the
lm-evaluation-harness model (`causal_qwen.integrations.lm_eval`).
"""

from __future__ import annotations

__all__ = ["check_tokenizer_matches"]


def check_tokenizer_matches(model_or_config, tokenizer) -> None:
    """Raise a ValueError when a CausalQwen model (or config) and a tokenizer disagree on the `<NUM>` id.

    Nothing is checked for other models, for a model with `use_numeric=False`, or for a tokenizer that does not
    encode numbers as `<NUM>` (a plain Qwen2 tokenizer, or a `CausalQwenTokenizer` with `use_numeric=False`): the
    model then reads numbers as digits, as Qwen does.
    """
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(model_or_config, "get_base_model"):  # a PEFT model
        config = getattr(model_or_config.get_base_model(), "config", config)
    if tokenizer is None or getattr(config, "model_type", None) != "causal_qwen" or not config.use_numeric:
        return
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor
    if not getattr(tokenizer, "use_numeric", False) or getattr(tokenizer, "num_token", None) is None:
        return
    tokenizer_id = tokenizer.num_token_id
    if tokenizer_id != config.num_token_id:
        raise ValueError(
            f"The tokenizer's <NUM> id is {tokenizer_id} but the model's config.num_token_id is "
            f"{config.num_token_id}: the model would read every number as another token. Use the tokenizer saved "
            "with the model (CausalQwenTokenizer.from_pretrained of the same folder), or convert again with "
            "CausalQwenForCausalLM.from_qwen(..., tokenizer=tokenizer)."
        )
