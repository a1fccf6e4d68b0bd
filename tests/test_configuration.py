"""CausalQwenConfig: types and ranges checked at construction, on assignment and through transformers' machinery."""

import copy
import json
import math

import pytest
import torch
from conftest import tiny_qwen2_config
from transformers import AutoConfig

from causal_qwen import CausalQwenConfig, CausalQwenForCausalLM

NUM = 120
BOOL_FIELDS = ["use_numeric", "freeze_backbone", "learnable_threshold", "detach_gate", "tie_word_embeddings"]


def make(**fields) -> CausalQwenConfig:
    return CausalQwenConfig(**(tiny_qwen2_config().to_dict() | {"num_token_id": NUM} | fields))


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_bool_fields_must_be_bools(field, value):
    with pytest.raises(TypeError, match=field):
        make(**{field: value})


@pytest.mark.parametrize("field,value,kind", [
    ("num_token_id", 120.5, TypeError), ("num_token_id", 120.0, TypeError), ("num_token_id", "120", TypeError),
    ("num_token_id", True, TypeError), ("causal_size", 32.0, TypeError), ("conversion_seed", 1.5, TypeError),
    ("conversion_seed", -1, ValueError), ("num_token_id", -3, ValueError), ("value_head_fit", [1], TypeError),
    ("regression_noise", "1", TypeError), ("ovr_threshold", None, TypeError),
])
def test_int_and_other_fields_are_typed(field, value, kind):
    with pytest.raises(kind, match=field):
        make(**{field: value})


def test_valid_values_pass_and_ints_are_numbers():
    config = make(ovr_threshold=3, gate_alpha=1, use_numeric=True, conversion_seed=7, value_head_fit={"a": 1})
    assert config.ovr_threshold == 3 and config.gate_alpha == 1 and config.conversion_seed == 7


@pytest.mark.parametrize("field,value,kind", [
    ("ovr_threshold", float("nan"), ValueError), ("ovr_threshold", float("inf"), ValueError),
    ("ovr_threshold", "high", TypeError), ("gate_alpha", -1.0, ValueError), ("noise_init", -1.0, ValueError),
    ("scale_min", 0.0, ValueError), ("use_numeric", "no", TypeError), ("num_token_id", 120.5, TypeError),
    ("num_token_id", 128, ValueError), ("value_transform", "log", ValueError), ("regression_noise", None, TypeError),
    ("detach_gate", 1, TypeError), ("causal_size", 0, ValueError),
])
def test_assignment_after_construction_is_checked(field, value, kind):
    config = make()
    before = getattr(config, field)
    with pytest.raises(kind, match=field):
        setattr(config, field, value)
    assert getattr(config, field) == before  # a refused value is not stored


def test_update_and_update_from_string_are_checked():
    config = make()
    config.update({"ovr_threshold": 3.0, "gate_alpha": 0.5})
    assert (config.ovr_threshold, config.gate_alpha) == (3.0, 0.5)
    with pytest.raises(ValueError, match="gate_alpha"):
        config.update({"gate_alpha": 2.0})
    config.update_from_string("ovr_threshold=4.5,detach_gate=false")
    assert config.ovr_threshold == 4.5 and config.detach_gate is False
    with pytest.raises(ValueError, match="ovr_threshold"):
        config.update_from_string("ovr_threshold=nan")
    # Fields related to each other may be changed in either order; the pair is checked when a model is built.
    config.update({"use_numeric": False, "regression_noise": 0.0})
    assert config.use_numeric is False


def test_relations_between_fields_are_checked_when_the_model_is_built_and_saved(tmp_path):
    config = make()
    config.use_numeric = False  # regression_noise is still 1.0: allowed for now, refused at use
    with pytest.raises(ValueError, match="regression_noise"):
        CausalQwenForCausalLM(config)
    with pytest.raises(Exception, match="regression_noise"):
        config.save_pretrained(tmp_path)
    config.regression_noise = 0.0
    CausalQwenForCausalLM(config)


def test_save_load_to_dict_copy_and_auto_config(tmp_path):
    config = make(ovr_threshold=3.0, conversion_seed=5, value_head_fit={"positions": 10})
    config.save_pretrained(tmp_path)
    loaded = CausalQwenConfig.from_pretrained(tmp_path)
    auto = AutoConfig.from_pretrained(tmp_path)
    assert type(auto) is CausalQwenConfig
    def fields(c):
        return {k: v for k, v in c.to_dict().items() if k not in ("_name_or_path", "transformers_version")}

    for other in (loaded, auto, CausalQwenConfig(**config.to_dict()), copy.deepcopy(config),
                  CausalQwenConfig.from_dict(config.to_dict())):
        assert fields(other) == fields(config)
    assert json.loads(config.to_json_string())["ovr_threshold"] == 3.0
    assert CausalQwenConfig().num_token_id is None  # the defaults (used by to_diff_dict) stay valid


def test_from_pretrained_checks_overrides_and_the_saved_file(tmp_path):
    make().save_pretrained(tmp_path)
    assert CausalQwenConfig.from_pretrained(tmp_path, ovr_threshold=2.0).ovr_threshold == 2.0
    with pytest.raises(ValueError, match="ovr_threshold"):
        CausalQwenConfig.from_pretrained(tmp_path, ovr_threshold=math.inf)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps(saved | {"use_numeric": "no"}))
    with pytest.raises(TypeError, match="use_numeric"):
        CausalQwenConfig.from_pretrained(tmp_path)
    path.write_text(json.dumps(saved | {"num_token_id": 120.5}))
    with pytest.raises(TypeError, match="num_token_id"):
        CausalQwenForCausalLM.from_pretrained(tmp_path)


def test_model_from_pretrained_with_a_field_override(tmp_path, tiny_qwen):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM)
    model.save_pretrained(tmp_path)
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path, ovr_threshold=2.0)
    assert loaded.config.ovr_threshold == 2.0
    with pytest.raises(TypeError, match="use_numeric"):
        CausalQwenForCausalLM.from_pretrained(tmp_path, use_numeric="no")


def test_from_qwen_rejects_unknown_keywords(tiny_qwen):
    with pytest.raises(TypeError, match=r"ovr_treshold.*did you mean 'ovr_threshold'"):
        CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_treshold=3.0)
    with pytest.raises(TypeError, match="not_a_field"):
        CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, not_a_field=1)
    # Backbone fields and PretrainedConfig's init keywords still pass.
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=3.0, use_cache=False,
                                            attn_implementation="eager")
    assert model.config.ovr_threshold == 3.0 and model.config.use_cache is False
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).loc_S).all()
