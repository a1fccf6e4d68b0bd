"""Would a read-out of the context's earlier values let the value head copy and combine numbers?

The value head of docs/design.md §1 is a linear read-out of loc_U at the predicting position. Through a frozen
backbone, a number stated earlier reaches that position only as far as the backbone carries its embedding's
`symlog(v)·w_num` direction there (experiments/value_features.py measures how little). This script measures,
on the converted Qwen2.5-0.5B with nothing trained, what a read-out that also sees the earlier values would give:

- `linear (whole loc_U)`: ridge on loc_U at the predicting position, as the library's value-head start
  (`ridge_readout`);
- `additive`: a linear read-out plus Σ_j a_j·y_j over the earlier `<NUM>` tokens j of the text, with y_j their
  values in the head's space and a_j = (Q·z)·(K·z_j) a rank-r bilinear weight of the predicting position's
  features z and of token j's;
- `copy-or-compute`: a gate g(z) mixes the linear read-out with a softmax pointer over the earlier values, so a
  copy can be exact.

The features z are the leading principal components of loc_U. The read-outs start at the linear part's ridge
solution and fit by AdamW on the L1 loss (the median) in the head's space, keeping the step of least validation
loss, for several seeds.

loc_U is read once (teacher forced). Both read-outs fit on every `<NUM>` position of the training texts (every
number, with the numbers before it as its context) over the same principal components of loc_U, and are scored
on the targets of the test splits, per template, as `run_experiment.py` scores them.

    python experiments/context_values.py                   # about 8 minutes on 2 CPU cores
    python experiments/context_values.py --n-train 1280    # four times the corpus texts, about 14 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_experiment as experiment  # noqa: E402

from causal_qwen import CausalQwenTokenizer  # noqa: E402
from causal_qwen.cauchy import transform_values, untransform_values  # noqa: E402
from causal_qwen.data.collator import CausalQwenDataCollator  # noqa: E402
from causal_qwen.starts import ridge_readout  # noqa: E402


@dataclass
class Rows:
    """One row per predicted number: loc_U where it is predicted, its value, and the earlier numbers of its text."""

    u: torch.Tensor  # [N, C]
    y: torch.Tensor  # [N] in the head's space
    context_u: torch.Tensor  # [N, J, C] loc_U at the earlier <NUM> tokens (zeros where there are fewer than J)
    context_y: torch.Tensor  # [N, J]
    context_mask: torch.Tensor  # [N, J]
    examples: list  # the text of each row


@torch.no_grad()
def read_rows(model, tokenizer, examples, batch_size: int, every_number: bool, max_context: int = 8) -> Rows:
    """loc_U at each predicted number (every `<NUM>`, or the target only) and at the numbers before it."""
    collator = CausalQwenDataCollator.from_tokenizer(tokenizer)
    transform = model.config.value_transform
    u, y, cu, cy, cm, texts = [], [], [], [], [], []
    for k in range(0, len(examples), batch_size):
        chunk = examples[k:k + batch_size]
        batch = collator(experiment.tokenize_examples(tokenizer, [ex.text for ex in chunk]))
        out = model(batch["input_ids"], numeric_values=batch["numeric_values"],
                    attention_mask=batch["attention_mask"], output_distributions=False)
        loc = out.loc_U.double()
        for b, ex in enumerate(chunk):
            where = (batch["input_ids"][b] == tokenizer.num_token_id).nonzero().flatten().tolist()
            if ex.target_value is not None and (not where or float(batch["numeric_values"][b, where[-1]])
                                                != ex.target_value):
                continue  # the tokenizer did not read the target as the text's last number
            picked = [i for i, p in enumerate(where) if p > 0] if every_number else (
                [len(where) - 1] if ex.target_value is not None else [])
            values = transform_values(batch["numeric_values"][b].double(), transform)
            for i in picked:
                before = where[max(0, i - max_context):i]
                c = torch.zeros(max_context, loc.shape[-1], dtype=torch.float64)
                v = torch.zeros(max_context, dtype=torch.float64)
                m = torch.zeros(max_context, dtype=torch.bool)
                if before:
                    c[:len(before)] = loc[b, before]
                    v[:len(before)] = values[before]
                    m[:len(before)] = True
                u.append(loc[b, where[i] - 1])
                y.append(values[where[i]])
                cu.append(c)
                cy.append(v)
                cm.append(m)
                texts.append(ex)
    return Rows(torch.stack(u), torch.stack(y), torch.stack(cu), torch.stack(cy), torch.stack(cm), texts)


class _Readout(torch.nn.Module):
    """The linear read-out b + w·z of principal components z of loc_U, started at its ridge solution."""

    def __init__(self, dim: int, weight: torch.Tensor, bias: float):
        super().__init__()
        self.linear = torch.nn.Linear(dim, 1, dtype=torch.float64)
        with torch.no_grad():
            self.linear.weight.copy_(weight[None])
            self.linear.bias.fill_(bias)


class Additive(_Readout):
    """ŷ = b + w·z + Σ_j (Q·z)·(K·z_j)·y_j over the earlier numbers j."""

    def __init__(self, dim: int, rank: int, weight: torch.Tensor, bias: float):
        super().__init__(dim, weight, bias)
        self.q = torch.nn.Linear(dim, rank, dtype=torch.float64)
        self.k = torch.nn.Linear(dim, rank, dtype=torch.float64)
        for layer in (self.q, self.k):
            torch.nn.init.normal_(layer.weight, std=0.01)
            torch.nn.init.zeros_(layer.bias)
        with torch.no_grad():  # a gain of 0 whose gradient is not: both factors at 0 would be a saddle
            self.q.bias.fill_(rank ** -0.5)

    def forward(self, z, context_z, context_y, context_mask):
        gain = torch.einsum("nr,njr->nj", self.q(z), self.k(context_z)) * context_mask
        return self.linear(z).squeeze(-1) + (gain * context_y).sum(-1)


class CopyOrCompute(_Readout):
    """ŷ = (1 − g)·(b + w·z) + g·Σ_j softmax_j((Q·z)·(K·z_j))·y_j, with the gate g = σ(G·z) (0 without context).

    A copy is exact when the gate and the attention saturate; the linear part computes the rest."""

    def __init__(self, dim: int, rank: int, weight: torch.Tensor, bias: float):
        super().__init__(dim, weight, bias)
        self.q = torch.nn.Linear(dim, rank, dtype=torch.float64)
        self.k = torch.nn.Linear(dim, rank, dtype=torch.float64)
        self.gate = torch.nn.Linear(dim, 1, dtype=torch.float64)
        with torch.no_grad():  # start mostly at the linear read-out
            self.gate.weight.zero_()
            self.gate.bias.fill_(-2.0)

    def forward(self, z, context_z, context_y, context_mask):
        score = torch.einsum("nr,njr->nj", self.q(z), self.k(context_z)).masked_fill(~context_mask, -1e9)
        copied = (score.softmax(-1) * context_y).sum(-1)
        gate = torch.sigmoid(self.gate(z).squeeze(-1)) * context_mask.any(-1)
        return (1 - gate) * self.linear(z).squeeze(-1) + gate * copied


READOUTS = {"additive": Additive, "copy-or-compute": CopyOrCompute}


def project(rows: Rows, mean: torch.Tensor, basis: torch.Tensor, scale: torch.Tensor):
    z = (rows.u - mean) @ basis / scale
    cz = ((rows.context_u - mean) @ basis / scale) * rows.context_mask[..., None]
    return z, cz


def principal_components(train: Rows, dims: int):
    mean = train.u.mean(0)
    _, s, vh = torch.linalg.svd(train.u - mean, full_matrices=False)
    dims = min(dims, len(s))
    return mean, vh[:dims].T, (s[:dims] / (len(train.u) - 1) ** 0.5).clamp(min=1e-9)


def fit_readout(kind: str, train: Rows, validation: Rows, projection, rank: int, steps: int, seed: int):
    """Ridge for the linear part, then AdamW on the L1 loss, keeping the step of least validation L1."""
    torch.manual_seed(seed)
    z, cz = project(train, *projection)
    vz, vcz = project(validation, *projection)
    weight, bias, _, _ = ridge_readout(z, train.y)
    model = READOUTS[kind](z.shape[1], rank, weight, bias)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    best = (float("inf"), None, 0)
    for step in range(steps):
        optimizer.zero_grad()
        loss = (model(z, cz, train.context_y, train.context_mask) - train.y).abs().mean()
        loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == steps - 1:
            with torch.no_grad():
                error = (model(vz, vcz, validation.context_y, validation.context_mask) - validation.y).abs().mean()
            if error < best[0]:
                best = (float(error), {k: v.clone() for k, v in model.state_dict().items()}, step)
    model.load_state_dict(best[1])
    return model, best[0], best[2]


def scored(predicted: torch.Tensor, rows: Rows, transform: str) -> dict[str, float]:
    """Median relative error of the targets per template, and their mean (rows of the targets only)."""
    return experiment.per_template(untransform_values(predicted, transform).tolist(), rows.examples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="cpu", choices=sorted(experiment.PROFILES))
    parser.add_argument("--dims", type=int, default=64, help="principal components of loc_U the read-outs use")
    parser.add_argument("--rank", type=int, default=16, help="rank of the score of each earlier number")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0, help="the data's seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the read-outs' seeds")
    parser.add_argument("--n-train", type=int, help="corpus training texts (the profile's by default)")
    parser.add_argument("--rows", type=Path, help="a file to keep the loc_U rows in (read once, reused after)")
    args = parser.parse_args()
    profile = experiment.PROFILES[args.profile]
    if args.n_train is not None:
        profile = dataclasses.replace(profile, n_train=args.n_train)
    t0 = time.perf_counter()
    data = experiment.load_data(profile, args.seed)
    tokenizer = CausalQwenTokenizer.from_pretrained(experiment.QWEN_DIR)
    model = experiment.new_causal(profile, tokenizer, args.seed).eval()
    transform = model.config.value_transform
    key = {"profile": args.profile, "n_train": profile.n_train, "seed": args.seed}
    if args.rows is not None and args.rows.exists():
        saved = torch.load(args.rows, weights_only=False)
        if saved.get("key") != key:
            raise ValueError(f"--rows {args.rows} holds the rows of {saved.get('key')}, not of {key}")
        train, validation = Rows(**saved["train"]), Rows(**saved["validation"])
        tests = {name: Rows(**fields) for name, fields in saved["tests"].items()}
    else:
        train = read_rows(model, tokenizer, data["train"], profile.eval_batch, every_number=True)
        validation = read_rows(model, tokenizer, data["validation"], profile.eval_batch, every_number=True)
        tests = {name: read_rows(model, tokenizer, data[name], profile.eval_batch, every_number=False)
                 for name in ("test", "real_test", "extrapolation")}
        if args.rows is not None:
            torch.save({"key": key, "train": vars(train), "validation": vars(validation),
                        "tests": {name: vars(rows) for name, rows in tests.items()}}, args.rows)
    print(f"loc_U read: {len(train.y)} training rows, {len(validation.y)} validation rows, "
          f"{ {k: len(v.y) for k, v in tests.items()} } targets; {time.perf_counter() - t0:.0f}s", flush=True)

    weight, bias, penalty, _ = ridge_readout(train.u, train.y)
    print(f"ridge on the whole loc_U (the library's start): penalty {penalty:g}")
    projection = principal_components(train, args.dims)
    results = {name: {"linear (whole loc_U)": scored(rows.u @ weight + bias, rows, transform)}
               for name, rows in tests.items()}
    for kind in READOUTS:
        for seed in args.seeds:
            readout, error, step = fit_readout(kind, train, validation, projection, args.rank, args.steps, seed)
            print(f"{kind}, seed {seed}: best validation L1 {error:.3f} at step {step}; "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
            with torch.no_grad():
                for name, rows in tests.items():
                    z, cz = project(rows, *projection)
                    predicted = readout(z, cz, rows.context_y, rows.context_mask)
                    results[name][f"{kind}, seed {seed}"] = scored(predicted, rows, transform)
    for name, arms in results.items():
        templates = list(arms["linear (whole loc_U)"])
        print(f"\n{name}: median relative error of the target")
        print("| read-out | " + " | ".join(templates) + " |")
        print("|---" * (1 + len(templates)) + "|")
        for arm, table in arms.items():
            print(f"| {arm} | " + " | ".join(f"{table[t]:.3g}" for t in templates) + " |")
    print(f"\n{time.perf_counter() - t0:.0f}s in all")


if __name__ == "__main__":
    main()
