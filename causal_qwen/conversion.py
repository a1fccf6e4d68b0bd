"""Conversion of a Qwen2 causal LM into a CausalQwen (docs/design.md §3): CausalQwen starts as exactly its Qwen.

`CausalQwenForCausalLM.from_qwen` is `convert_qwen` as a class method: the model class comes in as `cls`, so this
module depends only on the configuration.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, Qwen2ForCausalLM
from transformers.utils import logging

from .configuration import CausalQwenConfig

__all__ = ["convert_qwen"]

logger = logging.get_logger(__name__)


def convert_qwen(
    cls,
    model_or_path: Qwen2ForCausalLM | str | os.PathLike,
    tokenizer=None,
    *,
    dtype: torch.dtype | str | None = None,
    num_row_init: str | Sequence[int] | None = None,
    seed: int = 0,
    **config_overrides,
):
    """Build a CausalQwen from a Qwen2 causal LM, initialised as in docs/design.md §3.

    The backbone is copied unchanged, the abduction network is the identity with scale γ0, the
    classification head is a copy of Qwen's `lm_head` (untied) with zero bias, so `loc_S` equals
    Qwen's logits; `w_num` is drawn with the standard deviation of the embedding matrix.

    Conversion is deterministic: the only random weights (`w_num`, then `action.reg_head.weight`) are drawn
    on the CPU from a generator seeded with `seed`, so the same checkpoint and arguments give the same model on
    any device, and the global RNG is left as it was. The seed is recorded as `config.conversion_seed`.

    Args:
        model_or_path: a `Qwen2ForCausalLM`, a local checkpoint folder, or a hub id.
        tokenizer: gives the `<NUM>` id (`tokenizer.num_token_id`, else `len(tokenizer)`); when
            omitted, the tokenizer saved beside a checkpoint folder is used.
        dtype: dtype to load a checkpoint in (default float32); an object keeps its own dtype.
        num_row_init: the `<NUM>` row of the classification head. `"digits"` (the default when a tokenizer is
            known): the mean of Qwen's rows of the tokens "0" … "9", so that `<NUM>` starts where Qwen expects
            a digit. `"copy"` (the seeds' choice): Qwen's row of that id, which for a reserved id was never
            trained, so P_<NUM> starts near 0 everywhere, the gated regression loss with it, and the trained
            model never writes a number. A sequence of ids averages those rows. Either way every other row is
            Qwen's, and since the mean of some logits never exceeds their maximum (ties go to the lower id),
            greedy `traditional` decoding of text still equals Qwen's. Without a tokenizer the default falls
            back to `"copy"`, with a warning.
        seed: seed of the random draws (a non-negative int, default 0).
        **config_overrides: any field of [`CausalQwenConfig`], e.g. `num_token_id`, `ovr_threshold`.
    """
    CausalQwenConfig.check_field_names(config_overrides, where="from_qwen()")
    generator = _conversion_generator(seed, config_overrides)
    source = _load_qwen(model_or_path, dtype)
    use_numeric = config_overrides.get("use_numeric", True)
    num_token_id = config_overrides.pop("num_token_id", None)
    if use_numeric and tokenizer is None and isinstance(model_or_path, (str, os.PathLike)):
        tokenizer = _load_tokenizer_beside(model_or_path)
    if use_numeric:
        num_token_id = _resolve_num_token_id(num_token_id, tokenizer)
    base_vocab = source.config.vocab_size
    row_ids = None
    if use_numeric:
        row_ids = _num_row_ids(_default_num_row_init(num_row_init, tokenizer), tokenizer, base_vocab)
    if num_token_id is not None and num_token_id > base_vocab:
        raise ValueError(
            f"num_token_id {num_token_id} is beyond the vocabulary ({base_vocab} rows): the tokenizer does "
            "not match this checkpoint"
        )
    vocab_size = base_vocab + 1 if num_token_id == base_vocab else base_vocab

    # New conversions read the context's values (docs/design.md §1b); a model without numbers has none to read.
    config_overrides.setdefault("context_values", use_numeric)
    config = _causal_config_from(source.config, vocab_size=vocab_size, num_token_id=num_token_id,
                                 overrides={**config_overrides, "conversion_seed": seed})
    with torch.device(source.device), _global_rng_kept(source.device):
        model = cls(config).to(source.dtype)
    _copy_qwen_weights(source, model, base_vocab, generator)
    if row_ids is not None:
        with torch.no_grad():
            model.action.cls_head.weight[num_token_id] = source.lm_head.weight[row_ids].float().mean(0)
    model.generation_config = copy.deepcopy(source.generation_config)
    return model.eval()  # as `from_pretrained` returns models


def _default_num_row_init(num_row_init, tokenizer):
    """The digits' mean when the tokenizer has the digits 0-9, else a copy of the row (with a warning)."""
    if num_row_init is not None:
        return num_row_init
    if _digit_ids(tokenizer) is not None:
        return "digits"
    logger.warning("from_qwen: no tokenizer with the digits 0-9, so the <NUM> row of the classification head copies "
                   "Qwen's row of that id (num_row_init='copy'); pass tokenizer= to start it at the digits' mean, "
                   "without which the model learns to write numbers very slowly")
    return "copy"


def _load_qwen(model_or_path, dtype) -> Qwen2ForCausalLM:
    if isinstance(model_or_path, Qwen2ForCausalLM):
        return model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        return Qwen2ForCausalLM.from_pretrained(model_or_path, dtype=dtype or torch.float32)
    raise TypeError(
        f"model_or_path must be a Qwen2ForCausalLM, a folder or a hub id, got {type(model_or_path).__name__}"
    )


def _num_row_ids(num_row_init, tokenizer, base_vocab: int) -> list[int] | None:
    """The ids whose `lm_head` rows start the `<NUM>` row (None: keep the copied row)."""
    if isinstance(num_row_init, str):
        if num_row_init == "copy":
            return None
        if num_row_init != "digits":
            raise ValueError(f"num_row_init must be 'copy', 'digits' or a sequence of ids, got {num_row_init!r}")
        if tokenizer is None:
            raise ValueError("num_row_init='digits' needs a tokenizer (pass one, or a folder with one beside it)")
        ids = _digit_ids(tokenizer)
        if ids is None:
            raise ValueError("num_row_init='digits': the tokenizer has no single token for every digit 0-9")
    else:
        ids = list(num_row_init)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"num_row_init must be 'copy', 'digits' or a non-empty sequence of ids, got {ids!r}")
    if not all(0 <= i < base_vocab for i in ids):
        raise ValueError(f"num_row_init ids must lie inside the checkpoint's vocabulary [0, {base_vocab})")
    return ids


def _digit_ids(tokenizer) -> list[int] | None:
    """The ids of the tokens "0" … "9", or None when the tokenizer has no single token for each."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return None
    ids = [convert(str(d)) for d in range(10)]
    unknown = getattr(tokenizer, "unk_token_id", None)
    return None if any(not isinstance(i, int) or i == unknown for i in ids) else ids


def _resolve_num_token_id(num_token_id: int | None, tokenizer) -> int:
    """The `<NUM>` id: the override, else the tokenizer's (given, or saved beside the checkpoint)."""
    from_tokenizer = None
    if tokenizer is not None:
        from_tokenizer = getattr(tokenizer, "num_token_id", None)
        if from_tokenizer is None:
            from_tokenizer = len(tokenizer)
    if num_token_id is None and from_tokenizer is None:
        raise ValueError(
            "Cannot tell the <NUM> id: pass tokenizer= (its length gives the first spare row) or num_token_id="
        )
    if num_token_id is not None and from_tokenizer is not None and num_token_id != from_tokenizer:
        raise ValueError(f"num_token_id={num_token_id} disagrees with the tokenizer's <NUM> id {from_tokenizer}")
    return num_token_id if num_token_id is not None else from_tokenizer


def _load_tokenizer_beside(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _conversion_generator(seed, config_overrides: dict) -> torch.Generator:
    """A CPU generator for the random weights of a conversion: the same draws on every device."""
    if "conversion_seed" in config_overrides:
        raise ValueError("conversion_seed is recorded by from_qwen: pass seed= instead")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return torch.Generator(device="cpu").manual_seed(seed)


def _global_rng_kept(device: torch.device):
    """Building the model draws throwaway initial weights from the global RNG; restore it afterwards."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def _causal_config_from(qwen_config, *, vocab_size: int, num_token_id: int | None, overrides: dict):
    fields = qwen_config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path",
                "tie_word_embeddings", "vocab_size", "num_token_id"):
        fields.pop(key, None)
    fields.update(overrides)
    return CausalQwenConfig(**fields, vocab_size=vocab_size, num_token_id=num_token_id, tie_word_embeddings=False,
                            architectures=["CausalQwenForCausalLM"])


@torch.no_grad()
def _copy_qwen_weights(
    source: Qwen2ForCausalLM, model: PreTrainedModel, base_vocab: int, generator: torch.Generator
) -> None:
    """Backbone unchanged, lm_head → cls_head (a separate copy); a grown `<NUM>` row starts at zero.

    The weights that are not copied but drawn (w_num, w_reg, the context path's scores) come from `generator`, in
    that order, in float32.
    """
    state = source.model.state_dict()
    embed_key = "embed_tokens.weight"
    if model.config.vocab_size != base_vocab:
        grown = torch.zeros_like(model.model.embed_tokens.weight)
        grown[:base_vocab] = state[embed_key]
        state = {**state, embed_key: grown}
    model.model.load_state_dict(state)
    model.action.cls_head.weight.zero_()
    model.action.cls_head.weight[:base_vocab] = source.lm_head.weight
    model.action.cls_head.bias.zero_()
    if model.numeric_embedding is not None:
        std = source.model.embed_tokens.weight.float().std().item()
        model.numeric_embedding.w_num.copy_(_normal(model.numeric_embedding.w_num.shape, std, generator))
    if model.action.reg_head is not None:
        weight = model.action.reg_head.weight
        weight.copy_(_normal(weight.shape, model.config.initializer_range, generator))
    if model.abduction.context_values is not None:
        model.abduction.context_values.reset_parameters(generator, keep_loaded=False, linear_only=True)


def _normal(shape: torch.Size, std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std
