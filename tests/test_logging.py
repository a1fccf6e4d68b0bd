"""Training and evaluation metrics reach the reporters users pick: TensorBoard, and wandb in offline mode."""

import json
import struct
import time
import zlib

import pytest
from ddp_worker import dataset
from transformers import TrainingArguments

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.data.collator import CausalQwenDataCollator
from causal_qwen.metrics import CausalQwenMetrics
from causal_qwen.training import CausalQwenTrainer

NUM = 120
EXPECTED_TRAIN = {"train/loss", "train/total_loss", "train/cls_loss_mean", "train/reg_loss_effective"}
EXPECTED_EVAL = {"eval/loss", "eval/accuracy", "eval/ppl_softmax", "eval/ppl_ovr", "eval/num_f1", "eval/reg_mae",
                 "eval/reg_coverage_90", "eval/dist/ovr_prob_sum_median", "eval/dist/ovr_prob_sum_median_causal"}


def train_and_evaluate(tiny_qwen, tmp_path, report_to: str) -> CausalQwenTrainer:
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=0.5,
                                            abduction_scale_init=0.1)
    metrics = CausalQwenMetrics(model)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4,
                             per_device_train_batch_size=4, per_device_eval_batch_size=4, logging_steps=2,
                             eval_strategy="steps", eval_steps=4, save_strategy="no", report_to=report_to,
                             run_name="causal-qwen-test", use_cpu=True, disable_tqdm=True)
    trainer = CausalQwenTrainer(model=model, args=args, train_dataset=dataset(16), eval_dataset=dataset(8),
                                data_collator=CausalQwenDataCollator(0), compute_metrics=metrics.compute_metrics,
                                preprocess_logits_for_metrics=metrics.preprocess_logits_for_metrics)
    trainer.train()
    return trainer


def test_tensorboard_receives_the_training_and_evaluation_metrics(tiny_qwen, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = train_and_evaluate(tiny_qwen, tmp_path, "tensorboard")
    events = list((tmp_path / "out").rglob("events.out.tfevents.*"))  # under output_dir/runs/
    assert events, "no TensorBoard event file written"
    scalars: dict[str, list[float]] = {}
    for path in events:
        acc = EventAccumulator(str(path))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    assert EXPECTED_TRAIN | EXPECTED_EVAL <= scalars.keys()
    # The values are the ones Trainer logged, not just the tags.
    logged = [e["total_loss"] for e in trainer.state.log_history if "total_loss" in e]
    assert scalars["train/total_loss"] == pytest.approx(logged, rel=1e-6)
    evaluated = [e["eval_accuracy"] for e in trainer.state.log_history if "eval_accuracy" in e]
    assert scalars["eval/accuracy"] == pytest.approx(evaluated, rel=1e-6)


def wandb_history(path) -> tuple[dict[str, list], bool]:
    """Every logged history value of an offline `.wandb` run file, by key, and whether the run's exit is recorded.

    The file is a record log (a 7-byte file header, then 32 KiB blocks of chunks with a 7-byte header: checksum,
    length, kind 1 = full, 2 = first, 3 = middle, 4 = last; the checksum is CRC-32 of the kind byte and the chunk) of
    protobuf `Record`s; wandb 0.31 has no Python reader. The file is read while wandb's service writes it, so reading
    stops at the first chunk not yet whole.
    """
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    history: dict[str, list] = {}
    exited, pos, pending = False, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        # The service may still be writing this chunk: read no further than what is whole and checked.
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            break
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            exited = exited or record.WhichOneof("record_type") == "exit"
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    history.setdefault(item.key or "/".join(item.nested_key), []).append(json.loads(item.value_json))
    return history, exited


def test_wandb_offline_run_records_the_metrics(tiny_qwen, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional reporter")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "causal-qwen-test")
    trainer = train_and_evaluate(tiny_qwen, tmp_path, "wandb")
    import wandb

    wandb.finish()
    runs = list(tmp_path.rglob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    # wandb's service process writes the file after `finish` returns: wait for the run's exit record.
    deadline = time.monotonic() + 60
    history, exited = wandb_history(runs[0])
    while not exited and time.monotonic() < deadline:
        time.sleep(0.2)
        history, exited = wandb_history(runs[0])
    assert exited, "the offline run was not closed within 60 s"
    assert EXPECTED_TRAIN | EXPECTED_EVAL <= history.keys()
    logged = [e["total_loss"] for e in trainer.state.log_history if "total_loss" in e]
    assert history["train/total_loss"] == pytest.approx(logged, rel=1e-6)
    evaluated = [e["eval_ppl_ovr"] for e in trainer.state.log_history if "eval_ppl_ovr" in e]
    assert history["eval/ppl_ovr"] == pytest.approx(evaluated, rel=1e-6)
