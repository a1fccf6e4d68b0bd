"""Training with transformers' Trainer: single process, 2-process DDP (gloo), checkpoints, evaluation."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_worker import NUM, dataset
from transformers import Trainer, TrainingArguments

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.data.collator import CausalQwenDataCollator
from causal_qwen.metrics import CausalQwenMetrics
from causal_qwen.training import CausalQwenTrainer, parameter_groups

WORKER = Path(__file__).with_name("ddp_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _run(command: list[str]) -> None:
    """Run a worker; on failure, show its output (torchrun's own message says only that a rank exited)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-8000:]}")


@pytest.mark.distributed
def test_ddp_two_processes_equal_single_process(tmp_path):
    single, ddp = tmp_path / "single.pt", tmp_path / "ddp.pt"
    _run([sys.executable, str(WORKER), str(single), "4"])
    _run([*TORCHRUN, str(WORKER), str(ddp), "2"])
    a, b = torch.load(single), torch.load(ddp)
    assert a.keys() == b.keys() and "action.cls_head.weight" in a and "numeric_embedding.w_num" in a
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_ddp_with_checkpointing_and_a_rank_without_numbers_finishes(tmp_path):
    # Under activation checkpointing DDP does not look for unused parameters: every trainable parameter must get
    # a gradient on every rank, even when a rank's batch has no number at all.
    out = tmp_path / "uneven.pt"
    _run([*TORCHRUN, str(WORKER), str(out), "2", "--uneven"])
    params = torch.load(out)
    assert all(torch.isfinite(p).all() for p in params.values())


@pytest.fixture
def model(tiny_qwen):
    return CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=1.0, abduction_scale_init=0.1)


def test_trainer_lowers_loss_keeps_backbone_and_reloads_checkpoints(model, tmp_path):
    backbone = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    data = dataset(32)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=12,
                             learning_rate=1e-2, report_to=[], save_steps=12, logging_steps=1, use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=CausalQwenDataCollator(0))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    for name, p in model.model.named_parameters():
        assert torch.equal(p, backbone[name]), name

    reloaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "checkpoint-12").eval()
    model.eval()
    batch = CausalQwenDataCollator(0)(data[:4])
    with torch.no_grad():
        expected = model(batch["input_ids"], numeric_values=batch["numeric_values"])
        got = reloaded(batch["input_ids"], numeric_values=batch["numeric_values"])
    for name in ("loc_S", "scale_S", "loc_Y", "scale_Y"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_trainer_evaluation_reports_loss_and_metrics(model, tmp_path):
    metrics = CausalQwenMetrics(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, eval_dataset=dataset(8), data_collator=CausalQwenDataCollator(0),
                      compute_metrics=metrics.compute_metrics,
                      preprocess_logits_for_metrics=metrics.preprocess_logits_for_metrics)
    assert set(trainer.label_names) == {"labels", "numeric_labels"}
    result = trainer.evaluate()
    for key in ("eval_loss", "eval_accuracy", "eval_ppl_softmax", "eval_ppl_ovr", "eval_num_f1", "eval_reg_mae",
                "eval_reg_coverage_90", "eval_dist/ovr_prob_sum_median", "eval_dist/ovr_prob_sum_median_causal"):
        assert key in result, key
    batch = CausalQwenDataCollator(0)(dataset(8))
    with torch.no_grad():
        direct = model(**batch)
    assert result["eval_loss"] == pytest.approx(direct.loss.item(), rel=1e-5)


def test_causal_qwen_trainer_logs_the_loss_parts(model, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_steps=2, use_cpu=True, disable_tqdm=True)
    trainer = CausalQwenTrainer(model=model, args=args, train_dataset=dataset(16),
                                data_collator=CausalQwenDataCollator(0))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "cls_loss_mean" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert entry["reg_loss_effective"] > 0
        # Without gradient accumulation the total is the classification part plus λ times the regression part.
        assert entry["total_loss"] == pytest.approx(
            entry["cls_loss_mean"] + model.config.reg_loss_weight * entry["reg_loss_effective"], rel=1e-4)
        assert entry["loss"] == pytest.approx(entry["total_loss"], rel=1e-3)


# Per-module learning rates, as multiples of the classification head's rate (Adam moves every weight by about
# its rate per step). Written out here, apart from causal_qwen.training.LEARNING_RATE_SCALES, so that the test checks
# the table too.
EXPECTED_SCALES = {
    "action.cls_head": 1.0, "numeric_embedding": 1.0, "action.reg_head": 1.0, "abduction": 0.01,
    "action.b_noise": 0.01, "action.threshold": 100.0, "action.reg_log_noise": 100.0,
}


def expected_rates(model, lr: float, unwrap=lambda name: name) -> dict[str, float]:
    """Each trainable parameter's rate: its module's multiple of `lr`, or `lr` outside the listed modules."""
    rates = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            bare = unwrap(name)
            scale = [s for prefix, s in EXPECTED_SCALES.items() if bare == prefix or bare.startswith(prefix + ".")]
            rates[name] = lr * (scale[0] if scale else 1.0)
    return rates


def optimizer_rates(trainer) -> dict[str, float]:
    by_id = {id(p): group["lr"] for group in trainer.optimizer.param_groups for p in group["params"]}
    return {name: by_id[id(p)] for name, p in trainer.model.named_parameters() if id(p) in by_id}


def one_rate_trainer(model, tmp_path, lr=1e-3, **kwargs):
    """A one-step trainer in which every module trains at its rate (the value's features included)."""
    kwargs.setdefault("train_value_features", True)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=1, learning_rate=lr,
                             lr_scheduler_type="constant", weight_decay=kwargs.pop("weight_decay", 0.0),
                             max_grad_norm=0.0, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                             disable_tqdm=True, seed=0)
    return CausalQwenTrainer(model=model, args=args, train_dataset=dataset(8), data_collator=CausalQwenDataCollator(0),
                             **kwargs)


@pytest.mark.parametrize("learnable_threshold", [False, True])
def test_trainer_gives_each_module_its_learning_rate(tiny_qwen, tmp_path, learnable_threshold):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, learnable_threshold=learnable_threshold)
    trainer = one_rate_trainer(model, tmp_path, lr=2e-4)
    trainer.create_optimizer()
    got, want = optimizer_rates(trainer), expected_rates(model, 2e-4)
    assert got == pytest.approx(want, rel=1e-12)
    assert want["action.cls_head.weight"] == 2e-4 and want["abduction.loc_net.weight"] == pytest.approx(2e-6)
    assert ("action.threshold" in got) == learnable_threshold
    if learnable_threshold:
        assert got["action.threshold"] == pytest.approx(2e-2)
    assert not any(name.startswith("model.") for name in got)  # the frozen backbone is left out
    groups = trainer.optimizer.param_groups
    assert all(group["params"] for group in groups)
    assert len({(group["lr"], group["weight_decay"]) for group in groups}) == len(groups)
    assert groups[0]["lr"] == 2e-4  # Trainer logs the first group's rate as learning_rate: the head's


def test_trainer_weight_decay_spares_biases_and_one_rate_without_scales(model, tmp_path):
    trainer = one_rate_trainer(model, tmp_path, weight_decay=0.1)
    trainer.create_optimizer()
    decay = {id(p): group["weight_decay"] for group in trainer.optimizer.param_groups for p in group["params"]}
    params = dict(model.named_parameters())
    assert decay[id(params["action.cls_head.weight"])] == 0.1 and decay[id(params["abduction.loc_net.weight"])] == 0.1
    assert decay[id(params["action.cls_head.bias"])] == 0.0 and decay[id(params["abduction.loc_net.bias"])] == 0.0

    # {}: Trainer's own optimizer (one rate; its decay / no-decay split).
    trainer = one_rate_trainer(model, tmp_path / "one", learning_rate_scales={})
    trainer.create_optimizer()
    assert set(optimizer_rates(trainer).values()) == {1e-3}
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == sum(
        p.requires_grad for p in model.parameters())


def test_one_adam_step_moves_each_module_by_its_rate(tiny_qwen, tmp_path):
    # Adam's first step moves every weight with a nonzero gradient by lr·g/(|g| + eps) ≈ lr, so the largest change of
    # each parameter is its rate. lr = 1e-3 keeps the abduction's 1e-5 well above float32 rounding of its weights.
    # Without the context-value path: before its start from data it leaves the value to the linear law (weight
    # e^-40), so its gradients are below Adam's eps and its first step is not lr.
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=1.0, abduction_scale_init=0.1,
                                            learnable_threshold=True, context_values=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    # Without the value-head start, which would set the value head before the step (tests/test_starts.py).
    trainer = one_rate_trainer(model, tmp_path, lr=1e-3, value_head_start=False)
    trainer.train()
    assert trainer.state.global_step == 1
    want = expected_rates(model, 1e-3)
    assert want.keys() == before.keys()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters() if n in before}
    for name, rate in want.items():
        assert moved[name] == pytest.approx(rate, rel=0.03), name
    assert moved["action.cls_head.weight"] == pytest.approx(1e-3, rel=0.03)
    assert moved["abduction.loc_net.weight"] == pytest.approx(1e-5, rel=0.03)
    assert moved["action.threshold"] == pytest.approx(0.1, rel=0.03)
    assert [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e] == [1e-3]


def test_lora_adapters_train_at_the_head_rate_and_saved_modules_at_theirs(model, tmp_path):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["numeric_embedding", "abduction", "action"])
    peft_model = get_peft_model(model, lora)
    # By default the value read-out and the features it reads are held out of the optimizer, through PEFT's copies
    # too; the LoRA adapters and the class head train.
    held = one_rate_trainer(peft_model, tmp_path, lr=1e-3, train_value_features=False)
    held.create_optimizer()
    rates = optimizer_rates(held)
    for name in ("action.modules_to_save.default.reg_head.weight", "numeric_embedding.modules_to_save.default.w_num",
                 "abduction.modules_to_save.default.loc_net.weight"):
        assert f"base_model.model.{name}" not in rates, name
    assert "base_model.model.action.modules_to_save.default.cls_head.weight" in rates
    assert any("lora_" in name for name in rates)
    for param in held.value_head_start._held:
        param.requires_grad_(True)
    # Trained with the other heads, the read-out gets its rate.
    trainer = one_rate_trainer(peft_model, tmp_path, lr=1e-3, refit_value_readout=False)
    trainer.create_optimizer()
    got = optimizer_rates(trainer)

    def unwrap(name):
        return name.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".")

    assert got == pytest.approx(expected_rates(peft_model, 1e-3, unwrap), rel=1e-12)
    lora_names = [n for n in got if "lora_" in n]
    assert lora_names and all(got[n] == 1e-3 for n in lora_names)
    assert got["base_model.model.action.modules_to_save.default.cls_head.weight"] == 1e-3
    assert got["base_model.model.action.modules_to_save.default.reg_head.weight"] == pytest.approx(1e-3)
    assert got["base_model.model.numeric_embedding.modules_to_save.default.w_num"] == pytest.approx(1e-3)
    assert got["base_model.model.abduction.modules_to_save.default.loc_net.weight"] == pytest.approx(1e-5)
    assert got["base_model.model.action.modules_to_save.default.b_noise"] == pytest.approx(1e-5)
    assert not any("original_module" in n for n in got)  # PEFT's frozen originals stay out


def test_parameter_groups_rejects_bad_inputs(model):
    for bad in (0, 0.0, -1e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="learning_rate"):
            parameter_groups(model, bad)
    with pytest.raises(ValueError, match="scales"):
        parameter_groups(model, 1e-4, scales={"abduction": -0.01})
    with pytest.raises(ValueError, match="scales"):
        parameter_groups(model, 1e-4, scales={"abduction": 0.0})
    with pytest.raises(TypeError):
        parameter_groups("not a model", 1e-4)
    with pytest.raises(ValueError, match="scales"):
        CausalQwenTrainer(model=model, learning_rate_scales={"action.cls_head": float("nan")})


def test_parameter_groups_matches_whole_components_and_the_longest_prefix(model):
    groups = parameter_groups(model, 1.0, scales={"action": 2.0, "action.cls_head.bias": 3.0, "loc_net": 5.0,
                                                  "cls": 7.0})
    rate = {id(p): group["lr"] for group in groups for p in group["params"]}
    params = dict(model.named_parameters())
    assert rate[id(params["action.cls_head.weight"])] == 2.0  # "cls" is not a whole component
    assert rate[id(params["action.cls_head.bias"])] == 3.0  # the longest matching key wins
    assert rate[id(params["abduction.loc_net.weight"])] == 5.0  # a key may match anywhere in the name
    assert rate[id(params["abduction.scale_net.weight"])] == 1.0


def test_gradient_accumulation_over_micro_batches_without_numbers_equals_one_batch(tmp_path):
    # Every other micro-batch has no number. CausalQwenTrainer counts the step's <NUM> targets, so two accumulated
    # micro-batches of 2 train as one batch of 4 (plain Trainer's share weighting would halve the value term).
    from sharded_worker import build_model
    from sharded_worker import dataset as uneven_dataset

    params = []
    for batch, accumulation in ((4, 1), (2, 2)):
        model = build_model()
        args = TrainingArguments(output_dir=str(tmp_path / f"b{batch}"), per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulation, max_steps=3, learning_rate=1e-2,
                                 train_sampling_strategy="sequential", report_to=[], use_cpu=True,
                                 save_strategy="no", disable_tqdm=True)
        trainer = CausalQwenTrainer(model=model, args=args, train_dataset=uneven_dataset(uneven=True),
                                    data_collator=CausalQwenDataCollator(0), value_head_start=False)
        trainer.train()
        params.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    one, accumulated = params
    assert "action.reg_head.weight" in one
    for name in one:
        torch.testing.assert_close(accumulated[name], one[name], rtol=1e-5, atol=1e-6, msg=name)


def test_logged_loss_parts_are_on_the_footing_of_loss_under_gradient_accumulation(tmp_path):
    # Trainer's `loss` is the mean over each optimizer step's labelled positions, however the step is split into
    # micro-batches; the parts logged beside it must be the same means (not a micro-batch's share of them).
    from sharded_worker import build_model
    from sharded_worker import dataset as uneven_dataset

    logs = {}
    for batch, accumulation in ((4, 1), (1, 4)):
        args = TrainingArguments(output_dir=str(tmp_path / f"ga{accumulation}"), per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulation, max_steps=4, learning_rate=1e-2,
                                 train_sampling_strategy="sequential", report_to=[], use_cpu=True, logging_steps=2,
                                 save_strategy="no", disable_tqdm=True)
        model = build_model()
        trainer = CausalQwenTrainer(model=model, args=args, train_dataset=uneven_dataset(uneven=True),
                                    data_collator=CausalQwenDataCollator(0), value_head_start=False)
        trainer.train()
        logs[accumulation] = [entry for entry in trainer.state.log_history if "total_loss" in entry]
    assert len(logs[1]) == len(logs[4]) == 2
    weight = model.config.reg_loss_weight
    for one, four in zip(logs[1], logs[4], strict=True):
        assert four["loss"] == pytest.approx(one["loss"], rel=1e-4)
        for entry in (one, four):
            assert entry["total_loss"] == pytest.approx(entry["loss"], rel=1e-5)
            assert entry["total_loss"] == pytest.approx(entry["cls_loss_mean"] + weight * entry["reg_loss_effective"],
                                                        rel=1e-5)
        for key in ("cls_loss_mean", "reg_loss_effective"):
            assert four[key] == pytest.approx(one[key], rel=1e-4), key


def test_text_only_data_trains_without_the_value_head_start(model, tmp_path, caplog):
    # No number anywhere (text-only data, or a tokenizer that writes numbers as digits): nothing to fit the value
    # head on, so the start is skipped with one warning and training goes on.
    texts = [{"input_ids": example["input_ids"][:3] + example["input_ids"][4:7], "numeric_values": [0.0] * 6}
             for example in dataset(16)]
    assert not any(NUM in text["input_ids"] for text in texts)
    before = model.action.cls_head.weight.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True)
    trainer = CausalQwenTrainer(model=model, args=args, train_dataset=texts, data_collator=CausalQwenDataCollator(0))
    with caplog.at_level("WARNING", logger="causal_qwen.starts.callback"):
        trainer.train()
    skipped = [r for r in caplog.records if "value head start skipped" in r.getMessage()]
    assert len(skipped) == 1 and "no position whose label is <NUM>" in skipped[0].getMessage()
    assert trainer.state.global_step == 2 and model.config.value_head_fit is None
    assert not torch.equal(model.action.cls_head.weight, before)


def test_an_empty_dataset_is_refused_by_name(model, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
    with pytest.raises(ValueError, match="train_dataset holds no examples"):
        CausalQwenTrainer(model=model, args=args, train_dataset=[], data_collator=CausalQwenDataCollator(0))
    with pytest.raises(ValueError, match=r"eval_dataset\['b'\] holds no examples"):
        CausalQwenTrainer(model=model, args=args, train_dataset=dataset(4), eval_dataset={"a": dataset(2), "b": []},
                          data_collator=CausalQwenDataCollator(0))
    trainer = CausalQwenTrainer(model=model, args=args, data_collator=CausalQwenDataCollator(0))
    trainer.train_dataset = []
    with pytest.raises(ValueError, match="train_dataset holds no examples"):
        trainer.train()
