"""The four public tasks' start from data on rows read once: each task's error and 50% / 90% coverage per variant.

`keep_start.py --task benchmark` converts Qwen2.5-0.5B, starts it from the training pairs and trains it; the start
decides the value (training keeps it), and reading the rows is most of a start's time. This script reads the
training pairs' value rows and the test pairs' target rows once (`--read`, about 2 minutes on 2 cores), then fits
the read-out and the path on them by the library's procedure or a variant of it (`path_fit.arm`) in about a minute
for each order of the rows (`--orders`: each holds out other rows), and prints what `keep_start.py` prints of the
value: each task's median relative error and 50% / 90% coverage.

    python experiments/task_width.py --read                                      # once
    python experiments/task_width.py --arms library,nll-unseen,nll-unseen+locations-unseen --orders trainer,0,1,2
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import keep_start  # noqa: E402
import path_fit  # noqa: E402
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402
from causal_qwen.data import CausalQwenDataCollator, tokenize_examples  # noqa: E402
from causal_qwen.starts.readout import _read_rows_in_eval  # noqa: E402


def read(args) -> None:
    """The training pairs' value rows in the order keep_start.py trains on them, and the test targets' rows."""
    profile = experiment.PROFILES["cpu"]
    splits = keep_start.task_splits("benchmark", args.task_rows, args.seed)
    train = splits["train"]
    random.Random(args.seed).shuffle(train)
    train, test = train[:args.train_rows], experiment.with_target(splits["test"])
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = experiment.new_causal(profile, tokenizer, args.seed).eval()
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    features = tokenize_examples(tokenizer, [keep_start.pair(ex) for ex in train], max_length=128)
    t0 = time.perf_counter()
    rows = _read_rows_in_eval(model, experiment.collated(collator, features, profile.eval_batch), 4096, 0, "read")
    assert len(rows.y) == len(train), (len(rows.y), len(train))
    saved = {"train": path_fit.rows_dict(rows), "train_templates": [ex.template for ex in train],
             "medians": keep_start.table_medians(train),
             "test": path_fit.read_targets(model, tokenizer, test, profile.eval_batch)}
    print(f"{len(rows.y)} training rows, {len(saved['test']['true'])} test rows, {time.perf_counter() - t0:.0f}s")
    Path(args.rows).parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, args.rows)


def report(model, saved: dict) -> str:
    """Each task's median relative error, its 50% / 90% coverage and its mean share of the read-out π_0."""
    rows = saved["test"]
    median, loc, scale, choice = path_fit.predict(model, rows)
    true = torch.tensor(rows["true"], dtype=loc.dtype)
    covered = [((low <= true) & (true <= high)).tolist()
               for _, low, high in (model.value_interval(loc, scale, level) for level in (0.5, 0.9))]
    per: dict[str, list] = {}
    for k, task in enumerate(rows["templates"]):
        per.setdefault(task, []).append((experiment.relative_error(float(median[k]), rows["true"][k]),
                                         covered[0][k], covered[1][k], float(choice[k, 0])))
    lines, every = [], [row for values in per.values() for row in values]
    for task, values in sorted(per.items()):
        error, c50, c90, share = (statistics.median(v[0] for v in values), *(statistics.fmean(v[i] for v in values)
                                                                            for i in (1, 2, 3)))
        lines.append(f"  {task}: {error:.4f} (median {saved['baseline'][task]:.3f}), coverage {c50:.2f} / {c90:.2f},"
                     f" read-out's share {share:.2f}")
    pooled = statistics.median(v[0] for v in every)
    lines.append(f"  pooled {pooled:.4f}, coverage {statistics.fmean(v[1] for v in every):.2f} / "
                 f"{statistics.fmean(v[2] for v in every):.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--read", action="store_true", help="read and save the rows (once)")
    parser.add_argument("--rows", default="runs/task_width/rows.pt")
    parser.add_argument("--task-rows", type=int, default=400, help="rows per task (keep_start.py --rows)")
    parser.add_argument("--train-rows", type=int, default=512, help="training pairs (keep_start.py --train-rows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default="library", help="comma-separated path_fit.py arms")
    parser.add_argument("--orders", default="trainer", help="comma-separated orders of the training rows, each "
                        "holding out other rows (trainer: as CausalQwenTrainer's start reads them; 0: as read; "
                        "another number: a random permutation of that seed)")
    args = parser.parse_args()
    if args.read:
        read(args)
        return
    saved = torch.load(args.rows, weights_only=False)
    saved["baseline"] = path_fit.median_baseline(saved, "test")
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = experiment.new_causal(experiment.PROFILES["cpu"], tokenizer, args.seed).eval()
    # The fit writes the read-out (every tensor of it) and the path: the path is reset before each.
    pristine = copy.deepcopy(model.abduction.context_values.state_dict())
    saved["train_texts"] = list(range(len(saved["train"]["y"])))  # one value row per pair
    read_in = saved["train"]
    for name, order in [(name, order) for name in args.arms.split(",") for order in args.orders.split(",")]:
        model.abduction.context_values.load_state_dict(pristine)
        path_fit.arm(name)
        saved["train"] = path_fit.permuted({**saved, "train": read_in}, order if order == "trainer" else int(order),
                                           args.seed)[0]
        t0 = time.perf_counter()
        record = path_fit.fit(model, saved, args.seed, None)
        shift, reading = (", ".join(f"{v:.2f}" for v in record[key]) for key in ("context_width_shift",
                                                                                  "context_width_map"))
        print(f"{name}, order {order}: fit {time.perf_counter() - t0:.0f}s, held-out NLL "
              f"{record['context_nll']:.4f} (read-out {record['context_nll_linear']:.4f}), width shift [{shift}], "
              f"map [{reading}]", flush=True)
        print(report(model, saved), flush=True)


if __name__ == "__main__":
    main()
