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
from causal_qwen.training import CausalQwenTrainer

WORKER = Path(__file__).with_name("ddp_worker.py")


def test_ddp_two_processes_equal_single_process(tmp_path):
    single, ddp = tmp_path / "single.pt", tmp_path / "ddp.pt"
    subprocess.run([sys.executable, str(WORKER), str(single), "4"], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(WORKER), str(ddp),
                    "2"], check=True, capture_output=True)
    a, b = torch.load(single), torch.load(ddp)
    assert a.keys() == b.keys() and "action.cls_head.weight" in a and "numeric_embedding.w_num" in a
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


def test_ddp_with_checkpointing_and_a_rank_without_numbers_finishes(tmp_path):
    # Under activation checkpointing DDP does not look for unused parameters: every trainable parameter must get
    # a gradient on every rank, even when a rank's batch has no number at all.
    out = tmp_path / "uneven.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(WORKER), str(out),
                    "2", "--uneven"], check=True, capture_output=True, timeout=300)
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
    logged = [entry for entry in trainer.state.log_history if "train/cls_loss_mean" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert entry["train/reg_loss_effective"] > 0
        # Without gradient accumulation the total is the classification part plus λ times the regression part.
        assert entry["train/total_loss"] == pytest.approx(
            entry["train/cls_loss_mean"] + model.config.reg_loss_weight * entry["train/reg_loss_effective"], rel=1e-4)
        assert entry["loss"] == pytest.approx(entry["train/total_loss"], rel=1e-3)
