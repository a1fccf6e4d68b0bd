"""Train CausalQwen on the numeric corpus with transformers' Trainer, evaluate it, save it and plot it.

    python examples/train.py --output runs/train                 # the real Qwen2.5-0.5B (slow on a CPU)
    python examples/train.py --tiny --max-steps 20 --output runs/tiny   # a tiny random Qwen2, in seconds

Steps: load Qwen2.5-0.5B from the local cache (or build a tiny random Qwen2 with the real tokenizer), convert it
with `from_qwen` (it starts as exactly its Qwen), train the causal heads with the backbone frozen, evaluate every
metric of DESIGN §6 on the test and extrapolation splits, save the model and its tokenizer, and write PNG plots:
the loss curves, predicted vs true values with their 50% / 90% Cauchy intervals, and the distribution of scale_U.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainingArguments

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer
from causal_qwen.data import CausalQwenDataCollator, make_splits, tokenize_examples
from causal_qwen.metrics import evaluate
from causal_qwen.plots import plot_evaluation, plot_loss_curves
from causal_qwen.training import CausalQwenTrainer

QWEN_DIR = Path(os.environ.get("CAUSAL_QWEN_QWEN25_DIR", Path.home() / ".cache" / "causal_qwen" / "qwen2.5-0.5b"))
MAX_LENGTH = 128  # corpus texts are one to three sentences, far shorter


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 (hidden 32, 2 layers) instead of 0.5B")
    parser.add_argument("--output", default="runs/train", help="folder for the model, metrics and plots")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-train", type=int, default=2000, help="training texts of the corpus")
    parser.add_argument("--num-eval", type=int, default=200, help="texts in each evaluation split")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="learning rate of the classification head; the other modules use fixed multiples of it")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def load_qwen(tiny: bool) -> Qwen2ForCausalLM:
    """The real Qwen2.5-0.5B, or a tiny random Qwen2 with its vocabulary (151,936 rows)."""
    if not tiny:
        return Qwen2ForCausalLM.from_pretrained(QWEN_DIR, dtype=torch.float32)
    config = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def main() -> None:
    args = parse_args()
    out = Path(args.output)
    torch.manual_seed(args.seed)

    # Model: Qwen2 -> CausalQwen. The tokenizer gives the <NUM> id (the first spare row, 151,665).
    tokenizer = CausalQwenTokenizer.from_pretrained(QWEN_DIR)
    model = CausalQwenForCausalLM.from_qwen(load_qwen(args.tiny), tokenizer=tokenizer)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"CausalQwen: {sum(p.numel() for p in model.parameters()):,} parameters, {trainable:,} trainable "
          f"(backbone frozen), <NUM> id {model.config.num_token_id}")

    # Data: the numeric corpus (numbers become <NUM> tokens with their values in numeric_values).
    n_eval = args.num_eval
    splits = make_splits(args.num_train, max(16, n_eval // 4), n_eval, n_eval, seed=args.seed)
    features = {name: tokenize_examples(tokenizer, [ex.text for ex in examples], MAX_LENGTH)
                for name, examples in splits.items()}
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)

    # Training: Trainer calls the model with labels, which takes the fused chunked OvR loss. CausalQwenTrainer's
    # AdamW gives each module its own rate: learning_rate is the classification head's, and the other modules use
    # fixed multiples of it (causal_qwen.training.LEARNING_RATE_SCALES).
    training_args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, seed=args.seed, logging_steps=max(1, args.max_steps // 20),
        eval_strategy="steps", eval_steps=max(1, args.max_steps // 4), save_strategy="no", report_to="none",
        learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinning without an accelerator only warns
    )
    trainer = CausalQwenTrainer(model=model, args=training_args, train_dataset=features["train"],
                                eval_dataset=features["validation"], data_collator=collator)
    trainer.train()

    # Evaluation in standard mode, on the test split and on the extrapolation split (values above training).
    out.mkdir(parents=True, exist_ok=True)
    plots = [plot_loss_curves(trainer.state.log_history, out / "loss.png")]
    all_metrics = {}
    for split in ("test", "extrapolation"):
        data = features[split]
        batches = (collator(data[i:i + args.batch_size]) for i in range(0, len(data), args.batch_size))
        metrics, stats = evaluate(model, tqdm(batches, total=-(-len(data) // args.batch_size), desc=f"eval {split}"),
                                  generator=torch.Generator().manual_seed(args.seed), return_statistics=True)
        all_metrics[split] = metrics
        plots += plot_evaluation(model, stats, out / f"plots_{split}")
        print(f"\n{split}:")
        for key in ("eval/accuracy", "eval/ppl_softmax", "eval/ppl_ovr", "eval/num_f1", "eval/reg_mdae",
                    "eval/reg_rel_err_median", "eval/reg_coverage_90", "dist/ovr_prob_sum_median"):
            if key in metrics:
                print(f"  {key:<28} {metrics[key]:.6g}")
    (out / "metrics.json").write_text(json.dumps(all_metrics, indent=2), encoding="utf-8")

    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    print(f"\nsaved the model and tokenizer to {out / 'model'}")
    for path in plots:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
