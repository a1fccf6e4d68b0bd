"""The private hooks of third-party libraries the integrations override or call, pinned: each test fails when its
library changes the hook, rather than the integration failing or misbehaving later (docs/design.md, "Private hooks").
transformers' own (`_encode_plus`) is pinned in test_tokenization.py."""

import inspect

import pytest
import torch


def _names(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_trl_prepare_dataset_takes_what_the_override_takes():
    trl = pytest.importorskip("trl")
    from causal_qwen.integrations.trl import CausalQwenSFTTrainer

    assert _names(trl.SFTTrainer._prepare_dataset) == _names(CausalQwenSFTTrainer._prepare_dataset)
    # SFTTrainer calls it for every dataset it is given: the override is where the numbers are tokenized.
    assert "self._prepare_dataset(" in inspect.getsource(trl.SFTTrainer.__init__)


def test_trainer_keeps_the_columns_its_signature_hook_sets():
    from transformers import Trainer

    from causal_qwen.integrations.trl import CausalQwenSFTTrainer

    assert _names(Trainer._set_signature_columns_if_needed) == ["self"]
    assert _names(CausalQwenSFTTrainer._set_signature_columns_if_needed) == ["self"]
    # The columns the hook sets are the ones Trainer keeps when it removes unused columns.
    assert "self._signature_columns" in inspect.getsource(Trainer._remove_unused_columns)
    assert "self._signature_columns = None" in inspect.getsource(Trainer.__init__)


@pytest.mark.parametrize("hook", ["_encode_pair", "_loglikelihood_tokens", "_model_generate"])
def test_lm_eval_hflm_hooks_take_what_the_overrides_take(hook):
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from causal_qwen.integrations.lm_eval import CausalQwenLM

    assert _names(getattr(HFLM, hook)) == _names(getattr(CausalQwenLM, hook))
    # HFLM or a base of it reaches each through `self`, so the override is the one called.
    sources = [inspect.getsource(base) for base in HFLM.__mro__ if base.__module__.startswith("lm_eval")]
    assert any(f"self.{hook}(" in source for source in sources)


def test_ddp_reports_no_active_module_outside_its_forward():
    """`distributed.sharded_training` tells DDP (which needs only a gradient per parameter) from a sharding engine
    by DDP's record of the module whose forward runs."""
    ddp = torch.nn.parallel.DistributedDataParallel
    assert isinstance(inspect.getattr_static(ddp, "_get_active_ddp_module"), classmethod)
    assert _names(ddp._get_active_ddp_module) == []
    assert ddp._get_active_ddp_module() is None
    assert "_active_ddp_module" in inspect.getsource(ddp.forward) or "_inside_ddp_forward" in inspect.getsource(ddp)
