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


def _saved(tmp_path, tiny_qwen, **fields):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, **fields)
    model.save_pretrained(tmp_path)
    return model


def test_a_field_given_to_from_pretrained_fills_the_tensors_it_initialises(tmp_path, tiny_qwen):
    _saved(tmp_path, tiny_qwen, learnable_threshold=True)
    loaded = CausalQwenForCausalLM.from_pretrained(tmp_path, ovr_threshold=20.0, noise_init=0.25,
                                                   abduction_scale_init=0.5, regression_noise=0.125)
    assert isinstance(loaded.action.threshold, torch.nn.Parameter)
    assert (loaded.config.ovr_threshold, loaded.config.noise_init) == (20.0, 0.25)
    assert torch.equal(loaded.action.threshold, torch.full((128,), 20.0))
    assert torch.equal(loaded.action.b_noise.detach(), torch.full((32,), 0.25))
    assert loaded.action.reg_log_noise.exp().item() == pytest.approx(0.125)
    out = loaded(torch.tensor([[1, 2, 3]]))
    torch.testing.assert_close(out.scale_U, torch.full_like(out.scale_U, 0.5))
    # What it saves now loads as the same model.
    loaded.save_pretrained(tmp_path / "again")
    again = CausalQwenForCausalLM.from_pretrained(tmp_path / "again")
    assert again.config.ovr_threshold == 20.0 and torch.equal(again.action.threshold, loaded.action.threshold)
    # So does a config object whose value differs from the saved one; one that agrees keeps the loaded tensor.
    with torch.no_grad():
        loaded.action.threshold[:3] = -1.0
    loaded.save_pretrained(tmp_path / "learned")
    config = CausalQwenConfig.from_pretrained(tmp_path / "learned")
    kept = CausalQwenForCausalLM.from_pretrained(tmp_path / "learned", config=config)
    assert kept.action.threshold[0].item() == -1.0 and kept.action.threshold[5].item() == 20.0
    config.ovr_threshold = 4.0
    assert torch.equal(CausalQwenForCausalLM.from_pretrained(tmp_path / "learned", config=config).action.threshold,
                       torch.full((128,), 4.0))
    # A regression noise the checkpoint had not (0 when saved) is created at the value given.
    _saved(tmp_path / "quiet", tiny_qwen, regression_noise=0.0)
    noisy = CausalQwenForCausalLM.from_pretrained(tmp_path / "quiet", regression_noise=0.5)
    assert noisy.action.reg_log_noise.exp().item() == pytest.approx(0.5)


def test_set_initial_values_fills_the_tensors_a_config_edit_leaves(tmp_path, tiny_qwen):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, learnable_threshold=True).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model.action.threshold[:3] = -1.0  # as training leaves it
    learned = model.action.threshold.detach().clone()
    # The config is plain data: an edit of a field that starts tensors changes the config alone.
    model.config.ovr_threshold = 7.0
    assert torch.equal(model.action.threshold.detach(), learned)
    # The explicit edit changes both, and overwrites what was learned.
    model.set_initial_values(ovr_threshold=20.0, noise_init=0.25, abduction_scale_init=0.5, regression_noise=0.125)
    assert (model.config.ovr_threshold, model.config.noise_init) == (20.0, 0.25)
    assert isinstance(model.action.threshold, torch.nn.Parameter)
    assert torch.equal(model.action.threshold.detach(), torch.full((128,), 20.0))
    assert torch.equal(model.action.b_noise.detach(), torch.full((32,), 0.25))
    assert model.action.reg_log_noise.exp().item() == pytest.approx(0.125)
    with torch.no_grad():
        out = model(ids)
    torch.testing.assert_close(out.scale_U, torch.full_like(out.scale_U, 0.5))
    # Refused, naming the field, with nothing changed: a field that is not one of these, a bad value, and a
    # regression noise that would remove γ_Y.
    for fields, kind, name in (({"scale_min": 1.0}, TypeError, "scale_min"),
                               ({"noise_init": 0.5, "ovr_threshold": math.nan}, ValueError, "ovr_threshold"),
                               ({"ovr_threshold": "high"}, TypeError, "ovr_threshold"),
                               ({"noise_init": 0.5, "regression_noise": 0.0}, ValueError, "regression_noise")):
        with pytest.raises(kind, match=name):
            model.set_initial_values(**fields)
        assert model.config.noise_init == 0.25 and model.action.b_noise[0].item() == 0.25
    # A regression noise between positive values decides no module: the config takes it, γ_Y keeps its value.
    model.config.regression_noise = 0.5
    assert model.action.reg_log_noise.exp().item() == pytest.approx(0.125)
    # A field read at every use applies at once, in the abduction network and in both heads.
    model.config.scale_min = 1.0
    with torch.no_grad():
        out = model(ids)
    for scale in (out.scale_U, out.scale_S, out.scale_Y):
        assert scale.min().item() >= 1.0
    # The saved model is the live one.
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        reloaded = CausalQwenForCausalLM.from_pretrained(tmp_path)(ids)
    for name in ("loc_S", "scale_S", "scale_U", "loc_Y", "scale_Y"):
        torch.testing.assert_close(getattr(reloaded, name), getattr(out, name))
    # A copy's edit is its own.
    copied = copy.deepcopy(model)
    copied.set_initial_values(ovr_threshold=3.0)
    assert copied.action.threshold[0].item() == 3.0 and model.action.threshold[0].item() == 20.0


def test_a_config_knows_no_model(tiny_qwen):
    """Two models built on one config: an edit of it reaches neither's tensors, and the config keeps neither alive."""
    import gc
    import weakref

    first = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM)
    second = CausalQwenForCausalLM(first.config)
    assert second.config is first.config
    first.config.ovr_threshold = 2.0
    first.config.noise_init = 0.5
    for model in (first, second):
        assert torch.equal(model.action.threshold, torch.full((128,), 15.0))
        assert torch.equal(model.action.b_noise.detach(), torch.full((32,), 1e-5))
    config, gone = first.config, weakref.ref(first)
    del first, second, model
    gc.collect()
    assert gone() is None and config.ovr_threshold == 2.0


@pytest.mark.parametrize("name,value", [("use_numeric", False), ("learnable_threshold", True),
                                        ("regression_noise", 0.0), ("abduction_anchor_weight", 0.5)])
def test_a_field_that_decides_the_modules_stops_the_forward_and_the_save(tmp_path, tiny_qwen, name, value):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval()
    ids = torch.tensor([[1, 2, 3]])
    kept = getattr(model.config, name)
    setattr(model.config, name, value)  # plain data: the config takes it
    with pytest.raises(ValueError, match=name):
        model(ids)
    with pytest.raises(ValueError, match=name):
        model.generate(ids, max_new_tokens=1)
    with pytest.raises(ValueError, match=name):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()
    setattr(model.config, name, kept)  # set back, the model runs and saves again
    with torch.no_grad():
        assert torch.isfinite(model(ids).loc_S).all()
    model.save_pretrained(tmp_path)
    # A config copied off the model builds a model of its own.
    free = copy.deepcopy(model.config)
    free.use_numeric, free.regression_noise, free.context_values = False, 0.0, False
    assert CausalQwenForCausalLM(free).numeric_embedding is None


def test_a_checkpoint_missing_a_causal_tensor_is_refused(tmp_path, tiny_qwen):
    from safetensors.torch import load_file, save_file

    _saved(tmp_path, tiny_qwen)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for key in ("action.threshold", "action.reg_head.weight", "numeric_embedding.w_num", "abduction.scale_net.bias"):
        save_file({k: v for k, v in tensors.items() if k != key}, path, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            CausalQwenForCausalLM.from_pretrained(tmp_path)
    # A checkpoint without a value noise is the model of regression_noise=0, which the error says.
    save_file({k: v for k, v in tensors.items() if k != "action.reg_log_noise"}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"regression_noise=0\.0"):
        CausalQwenForCausalLM.from_pretrained(tmp_path)
    assert CausalQwenForCausalLM.from_pretrained(tmp_path, regression_noise=0.0).action.reg_log_noise is None
    # A backbone key keeps transformers' behaviour (initialised, reported as missing), and so does a checkpoint of the
    # backbone alone (a base model loaded into the class with the heads).
    save_file({k: v for k, v in tensors.items() if k.startswith("model.")}, path, metadata={"format": "pt"})
    _, info = CausalQwenForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert "action.threshold" in info["missing_keys"] and not any(k.startswith("model.") for k in info["missing_keys"])
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, path, metadata={"format": "pt"})
    _, info = CausalQwenForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"model.norm.weight"}


def test_the_early_field_lists_are_the_configs():
    """`causal-qwen convert --set` checks names against `config_fields` before transformers loads: its lists must be
    the installed transformers' fields and the config's own causal fields."""
    import dataclasses

    from transformers import Qwen2Config

    from causal_qwen import config_fields

    qwen2 = {field.name for field in dataclasses.fields(Qwen2Config)} | set(Qwen2Config.attribute_map)
    assert config_fields.QWEN2_FIELDS == qwen2
    causal = {field.name for field in dataclasses.fields(CausalQwenConfig)} - qwen2
    assert config_fields.CHECKED_FIELDS - {"tie_word_embeddings"} == causal


@pytest.mark.parametrize(("field", "value"), [
    ("ovr_threshold", "20"), ("ovr_threshold", float("inf")), ("gate_alpha", 1.5), ("use_numeric", 1),
    ("context_values_rank", 0), ("causal_size", 2.0), ("value_transform", "log"), ("context_values_log", "ln"),
    ("value_head_fit", [1]), ("scale_min", 0.0), ("regression_noise", -1.0),
])
def test_the_early_check_refuses_what_the_config_refuses(tiny_qwen, field, value):
    from causal_qwen.config_fields import check_field

    with pytest.raises((TypeError, ValueError), match=field) as by_config:
        CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, **{field: value})
    with pytest.raises(by_config.type, match=field):
        check_field(field, value)
