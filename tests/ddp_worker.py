"""Train a tiny CausalQwen with Trainer for a few steps; run alone or under torchrun (gloo, CPU).

Usage: python tests/ddp_worker.py OUT_FILE PER_DEVICE_BATCH [--uneven]
The final trainable parameters are written to OUT_FILE by the main process. With --uneven, activation
checkpointing is on and every other pair of examples has no number, so that under 2 processes one rank's batches
leave the numeric embedding and the regression head out of its graph.
"""

import os
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments
from worker_exit import exit_worker

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.data.collator import CausalQwenDataCollator

NUM = 120


def dataset(n: int = 16, length: int = 10, uneven: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    examples = []
    for i in range(n):
        ids = torch.randint(1, 100, (length,), generator=g)
        values = torch.zeros(length, dtype=torch.float64)
        if not (uneven and i % 4 >= 2):
            ids[3] = ids[7] = NUM
            values[3], values[7] = torch.rand(2, generator=g, dtype=torch.float64) * 100
        examples.append({"input_ids": ids.tolist(), "numeric_values": values.tolist()})
    return examples


def main(out_file: str, per_device_batch: int, uneven: bool = False) -> None:
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=NUM, ovr_threshold=1.0, abduction_scale_init=0.1)
    args = TrainingArguments(
        output_dir=out_file + ".run", per_device_train_batch_size=per_device_batch, max_steps=3, learning_rate=1e-2,
        train_sampling_strategy="sequential", report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None, seed=0, disable_tqdm=True,
        gradient_checkpointing=uneven,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset(uneven=uneven),
                      data_collator=CausalQwenDataCollator(0))
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, out_file)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), uneven="--uneven" in sys.argv[3:])
    exit_worker()
