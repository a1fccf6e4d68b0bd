"""transformers' own generic model tests, run against CausalQwen with the stock Qwen2 as the control.

The tests are those of transformers' test tree (`CausalLMModelTest`: `ModelTesterMixin`, `GenerationTesterMixin`,
the pipeline, training, tensor-parallel and FSDP mixins), read at run time from the folder that
CAUSAL_QWEN_TRANSFORMERS_TESTS names (a tree assembled for the installed transformers; CI sets it); nothing of it is
copied here. The module skips without it, and fails under CAUSAL_QWEN_REQUIRE_REAL=1 (CI), so it cannot pass unrun.

Both classes below run the same checks on the same tiny configuration (transformers' text-model tester defaults):
`TestQwen2Generic` on `Qwen2Model` and `Qwen2ForCausalLM`, `TestCausalQwenGeneric` on `CausalQwenModel` (the
`Qwen2Model` that `AutoModel` gives for a CausalQwen config) and `CausalQwenForCausalLM`. Qwen2's task heads (question
answering, sequence and token classification), which CausalQwen has no counterpart of, are left out of both. A check
that passes for Qwen2 and fails for CausalQwen is a bug of CausalQwen; none is excluded or expected to fail.
`TestCausalQwenGeneric` adapts two hooks of the mixins so that their inputs and targets never hold `<NUM>` without
values (CausalQwen's forward rejects that), asks for one check that transformers runs only for its newer models, and
tells the weight-conversion check that its conversion keeps the key (the mixin's own argument); each says why where it
is set.
"""

from __future__ import annotations

import os
import sys
import unittest
from pathlib import Path
from unittest import mock

import pytest

TREE = Path(os.environ.get("CAUSAL_QWEN_TRANSFORMERS_TESTS", "")).expanduser()

if not os.environ.get("CAUSAL_QWEN_TRANSFORMERS_TESTS") or not (TREE / "tests" / "causal_lm_tester.py").exists():
    _reason = (f"transformers' generic test tree is not at CAUSAL_QWEN_TRANSFORMERS_TESTS={str(TREE)!r}: point it at "
               "a tree holding tests/causal_lm_tester.py for the installed transformers")
    if os.environ.get("CAUSAL_QWEN_REQUIRE_REAL", "") not in ("", "0"):
        raise RuntimeError(_reason)
    pytest.skip(_reason, allow_module_level=True)

pytest.importorskip("parameterized", reason="transformers' test tree needs parameterized")

pytestmark = pytest.mark.generic

# The tree's modules import each other as the package `tests` (relatively, and in places as `tests.*`).
if str(TREE) not in sys.path:
    sys.path.insert(0, str(TREE))

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

from causal_qwen import CausalQwenConfig, CausalQwenForCausalLM, CausalQwenModel  # noqa: E402

_tree_tests = sys.modules.get("tests")
if _tree_tests is not None and not str(getattr(_tree_tests, "__file__", "") or "").startswith(str(TREE)):
    pytest.skip("another package named `tests` is already imported; run this module on its own",
                allow_module_level=True)


def _installed_transformers(path, file="__init__.py"):
    """The tree's mixins import transformers from its source folder (`src/transformers`), which the tree lacks; the
    installed transformers (the one under test) stands in for it."""
    import transformers

    return transformers


with mock.patch("transformers.utils.direct_transformers_import", _installed_transformers):
    from tests.causal_lm_tester import CausalLMModelTest, CausalLMModelTester
    from tests.test_modeling_common import ids_tensor

# The mixins tell a causal LM (which gets `labels`, and the shift-labels and training checks) and a bare backbone
# (which has no loss) by their class names in transformers' static tables MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and
# MODEL_MAPPING_NAMES, where a model registered with `AutoModel*.register` never appears. The tree's modules (used by
# this module only) get copies of those tables that name CausalQwen's classes too; transformers' own are left alone.
_NAME_TABLES = {
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, CausalQwenForCausalLM),
    "MODEL_MAPPING_NAMES": (MODEL_MAPPING_NAMES, CausalQwenModel),
}
for _module in [m for name, m in sys.modules.items() if name == "tests" or name.startswith("tests.")]:
    for _table_name, (_table, _model_class) in _NAME_TABLES.items():
        if getattr(_module, _table_name, None) is _table:
            setattr(_module, _table_name, {**_table, CausalQwenConfig.model_type: _model_class.__name__})

_MODEL_CLASSES = ("base_model_class", "causal_lm_class")
_TASK_HEADS = ("question_answering_class", "sequence_classification_class", "token_classification_class")


class _TwoClassTester(CausalLMModelTester):
    """A `CausalLMModelTester` over the backbone and the causal LM only (CausalQwen has no task heads)."""

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        for name in _TASK_HEADS:
            setattr(self, name, None)

    @property
    def all_model_classes(self):
        return [getattr(self, name) for name in _MODEL_CLASSES]

    @property
    def pipeline_model_mapping(self):
        return {"feature-extraction": self.base_model_class, "text-generation": self.causal_lm_class}


class Qwen2ControlTester(_TwoClassTester):
    base_model_class = Qwen2Model
    config_class = Qwen2Config
    causal_lm_class = Qwen2ForCausalLM


class CausalQwenModelTester(_TwoClassTester):
    """The Qwen2 tester with CausalQwen's config and causal LM; the inputs it draws never hold `<NUM>`.

    `<NUM>` is id 3, the first after pad, bos and eos (0, 1, 2): the resizing checks shrink the vocabulary to
    `vocab_size − 15` and to 4 ids, and CausalQwen refuses a vocabulary without `<NUM>` (tests/test_modeling.py).
    `ids_tensor(shape, n)` draws ids in [0, n − 1]; drawing among `vocab_size − 1` ids and stepping over
    `num_token_id` gives every other id: a `<NUM>` without `numeric_values` is an error of CausalQwen's forward.
    """

    num_token_id = 3

    base_model_class = CausalQwenModel
    config_class = CausalQwenConfig
    causal_lm_class = CausalQwenForCausalLM

    def prepare_config_and_inputs(self):
        config, _, token_type_ids, _, sequence_labels, token_labels, choice_labels = super().prepare_config_and_inputs()
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 1)
        input_ids = input_ids + (input_ids >= self.num_token_id).long()
        input_mask = torch.tril(torch.ones_like(input_ids)) if self.use_input_mask else None
        return config, input_ids, token_type_ids, input_mask, sequence_labels, token_labels, choice_labels


class _GenericTest(CausalLMModelTest):
    def is_pipeline_test_to_skip(self, *args, **kwargs):
        return True  # as Qwen2's own test: the pipeline tests need hub tokenizers


class TestQwen2Generic(_GenericTest, unittest.TestCase):
    model_tester_class = Qwen2ControlTester


class TestCausalQwenGeneric(_GenericTest, unittest.TestCase):
    model_tester_class = CausalQwenModelTester
    # The weight-initialisation check runs only for models whose config file carries a copyright year from 2023 on
    # (transformers' way to pick its newer models); CausalQwen's files carry none, so it is asked for here.
    test_can_init_all_missing_weights_before_2023 = True

    def test_reverse_loading_mapping(self):
        # CausalQwen's one weight conversion changes a weight, not its key: it reads the 0-dim `reg_log_noise` of
        # older checkpoints as the [1] vector it now is. The mixin's argument for such conversions says so.
        super().test_reverse_loading_mapping(check_keys_were_modified=False)

    def _create_text_training_batch(self, batch_size, seq_length, vocab_size):
        # The overfit check trains on the ids 1-19 in a row; step over <NUM> as the tester does.
        batch = super()._create_text_training_batch(batch_size, seq_length, vocab_size)
        num_token_id = self.model_tester.num_token_id
        return {name: ids + (ids >= num_token_id).long() for name, ids in batch.items()}

    def _logits_scored_by_loss(self, model, logits):
        # The shift-labels check takes the most and least likely ids as targets; a `<NUM>` target needs its value,
        # which the check does not pass, so the `<NUM>` score is set to its row's mean (neither the max nor the min).
        logits = logits.clone()
        logits[..., self.model_tester.num_token_id] = logits.mean(-1)
        return logits
