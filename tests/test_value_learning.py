"""The value side learns from its start (docs/design.md §7b): the read-out's whitened gradient steps against an
independent float64 computation, the held-out guard, order-insensitive starts, the global random state, the settings
object, and the value a prompt asks for next."""

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from test_keep_start import NUM, args, eval_forward, fresh, keyed
from transformers import TrainerCallback

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer
from causal_qwen.data.collator import CausalQwenDataCollator
from causal_qwen.starts import LearningRows, ValueLearner, ValueLearning, fit_value_head, start_on_new_data
from causal_qwen.training import CausalQwenTrainer


class _Action:
    """The two parameters of the value head the learner writes, and what it reads of the action network."""

    def __init__(self, w: torch.Tensor, b: float, noise: float):
        self.reg_head = torch.nn.Linear(len(w), 1).double()
        with torch.no_grad():
            self.reg_head.weight.copy_(w[None])
            self.reg_head.bias.fill_(b)
        self.reg_log_noise = torch.tensor([math.log(noise)], dtype=torch.float64)
        self.scale_min = 1e-6


def _rows(n: int = 40, c: int = 5, seed: int = 0, w: torch.Tensor | None = None, b: float = 0.0) -> LearningRows:
    """Random rows; with `w`, targets that the read-out (w, b) reads to within noise of 0.3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1, 3.0, 100.0])[:c]
    s = torch.rand(n, c, generator=g, dtype=torch.float64) * 1e-3
    linear = torch.rand(n, generator=g, dtype=torch.float64)
    offset = torch.randn(n, generator=g, dtype=torch.float64)
    width = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    y = torch.randn(n, generator=g, dtype=torch.float64) * (2 if w is None else 0.3)
    if w is not None:
        y = y + linear * (x @ w + b) + offset
    return LearningRows(x, s, linear, offset, width, y, torch.arange(n) % 5)


def _numpy_step(rows: LearningRows, w0: np.ndarray, b0: float, noise: float, penalty: float, picks: np.ndarray,
                lr: float, fitted_rows: np.ndarray) -> tuple[np.ndarray, float]:
    """Adam's first step on (v, δ) from 0, whitened on the rows `fitted_rows`, in float64 numpy: −lr·g/(|g| + ε) for
    the gradient g of the mean Cauchy NLL over `picks` (Adam's bias-corrected moments are g and g² at its first
    step)."""
    x, s = rows.x.numpy(), rows.s.numpy()
    fitted = x[fitted_rows]
    mean, std = fitted.mean(0), np.maximum(fitted.std(0, ddof=1), 1e-6)
    a = (fitted - mean) / std
    cov = a.T @ a / len(fitted) + penalty / len(fitted) * np.eye(x.shape[1])
    values, vectors = np.linalg.eigh(cov)
    whiten = vectors @ np.diag(values ** -0.5) @ vectors.T
    grad_v, grad_d = np.zeros(x.shape[1]), 0.0
    for i in picks:
        pi0, m, rho, y = (float(t[i]) for t in (rows.linear_weight, rows.offset, rows.width, rows.y))
        loc = pi0 * (x[i] @ w0 + b0) + m
        scale = pi0 * (s[i] @ np.abs(w0)) + noise * rho
        r = (y - loc) / scale
        d_loc = -2 * r / (scale * (1 + r * r))
        d_scale = 1 / scale - 2 * r * r / (scale * (1 + r * r))
        grad_v += d_loc * pi0 * (whiten @ ((x[i] - mean) / std)) + d_scale * pi0 * (whiten @ (np.sign(w0) * s[i] / std))
        grad_d += d_loc * pi0
    grad_v, grad_d = grad_v / len(picks), grad_d / len(picks)
    rate = lr / math.sqrt(len(grad_v))  # per whitened coordinate: a prediction moves by about lr
    v, d = -rate * grad_v / (np.abs(grad_v) + 1e-8), -lr * grad_d / (abs(grad_d) + 1e-8)
    shift = whiten @ v / std
    return w0 + shift, b0 + d - float(shift @ mean)


def test_a_step_of_the_learner_is_the_independent_float64_update():
    """Every read-out from the model's: each monitor on the rows of the other folds, the model's on every row."""
    w0 = torch.tensor([0.5, -0.02, 3.0, 0.1, 0.004], dtype=torch.float64)
    rows = _rows(w=w0, b=1.5)  # read well by the model's read-out: the learner starts from it
    action = _Action(w0, 1.5, 0.7)
    settings = ValueLearning(learning_rate=1e-2, batch_rows=16, seed=3)
    learner = ValueLearner(action, rows, settings, penalty=2.0)
    assert len(learner.monitors) == 5 and not learner.restarted
    learner.step()
    learner._write()  # the state of this step, whether or not it is the best held out
    states = [((rows.fold != k).nonzero().flatten(), monitor.weights()) for k, monitor in enumerate(learner.monitors)]
    states.append((torch.arange(len(rows.y)), (action.reg_head.weight.detach()[0], action.reg_head.bias)))
    for fitted, (w, b) in states:
        picks = fitted[torch.randint(len(fitted), (16,), generator=torch.Generator().manual_seed(3))].numpy()
        expected_w, expected_b = _numpy_step(rows, w0.numpy(), 1.5, 0.7, 2.0, picks, 1e-2, fitted.numpy())
        np.testing.assert_allclose(w.detach().numpy(), expected_w, rtol=1e-9, atol=1e-12)
        assert float(b.detach()) == pytest.approx(expected_b, rel=1e-9, abs=1e-12)


def test_a_checkpoint_on_rows_its_read_out_misses_starts_from_their_ridge():
    """A read-out fitted on another table: the ridge of the new rows reads them better on the folds, and the model
    gets it (an independent float64 ridge on the standardised rows) before any step."""
    rows = _rows(n=200, w=torch.tensor([0.2, 0.05, -1.0, 0.3, 0.001], dtype=torch.float64), b=-0.5)
    w0 = torch.tensor([0.5, -0.02, 3.0, 0.1, 0.004], dtype=torch.float64)
    action = _Action(w0, 1.5, 0.7)
    learner = ValueLearner(action, rows, ValueLearning(), penalty=2.0)
    assert learner.restarted
    x, y = rows.x.numpy(), rows.y.numpy()
    mean, std = x.mean(0), np.maximum(x.std(0, ddof=1), 1e-6)
    a = (x - mean) / std
    v = np.linalg.solve(a.T @ a + 2.0 * np.eye(x.shape[1]), a.T @ (y - y.mean()))
    np.testing.assert_allclose(action.reg_head.weight.detach()[0].numpy(), v / std, rtol=1e-9)
    assert float(action.reg_head.bias.detach()) == pytest.approx(y.mean() - float((v / std) @ mean), rel=1e-9)
    # Read by its own read-out, a checkpoint keeps it.
    kept = _Action(w0, 1.5, 0.7)
    assert not ValueLearner(kept, _rows(n=200, w=w0, b=1.5), ValueLearning(), penalty=2.0).restarted
    assert torch.equal(kept.reg_head.weight.detach()[0], w0)


def _unseen_error(rows: LearningRows, states: list) -> float:
    """The median |loc − y| of every row at the state (w, b) of the monitor of its fold."""
    misses = torch.empty_like(rows.y)
    for k, (w, b) in enumerate(states):
        at = rows.fold == k
        loc = rows.linear_weight[at] * (rows.x[at] @ w.detach() + float(b.detach())) + rows.offset[at]
        misses[at] = (loc - rows.y[at]).abs()
    return float(misses.median())


def test_the_guard_keeps_the_best_state_when_training_diverges():
    rows = _rows(n=60)
    w0 = torch.tensor([0.5, -0.02, 3.0, 0.1, 0.004], dtype=torch.float64)
    action = _Action(w0, 1.5, 0.7)
    learner = ValueLearner(action, rows, ValueLearning(learning_rate=50.0), penalty=1.0, fitted_on_rows=True)
    monitored = [[m.weights() for m in learner.monitors]]
    trained = [learner.readout.weights()]
    for _ in range(30):
        learner.step()
        monitored.append([m.weights() for m in learner.monitors])
        trained.append(learner.readout.weights())
    # The error on the rows each monitor did not see, at each of their states, computed here from their weights.
    errors = [_unseen_error(rows, states) for states in monitored]
    assert [error for _, error in learner.record.curve] == pytest.approx(errors, rel=1e-9)
    assert max(errors) > 10 * errors[0]  # it diverged
    best = learner.record.best_step
    assert learner.record.best_error == errors[best] == min(errors)
    # The model holds the state of the read-out trained on every row after as many steps (the start at step 0).
    w, b = trained[best]
    torch.testing.assert_close(action.reg_head.weight.detach()[0], w0 if best == 0 else w.detach())
    assert float(action.reg_head.bias.detach()) == pytest.approx(1.5 if best == 0 else float(b.detach()), rel=1e-12)


class _Abduction(torch.nn.Module):
    """What the learner reads of the abduction network: loc_U = W·z + b, and the path's width map of z (or none)."""

    def __init__(self, hidden: int, causal: int, path: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.loc_net = torch.nn.Linear(hidden, causal).double()
        self.context_values = None
        if path:
            self.context_values = torch.nn.Module()
            self.context_values.width = torch.nn.Linear(hidden, 1).double()


def _two_kinds(n: int = 1000, hidden: int = 6, causal: int = 5):
    """Rows of two kinds far apart in loc_U, every width 1 (γ_Y = 1, ρ = 1, no spread of the read-out's own), a
    read-out of 0 that the path's offsets leave missing every row by 1; and the misses of a read-out that misses the
    first kind by 0.25 and the second by 1, as it did."""
    g = torch.Generator().manual_seed(5)
    abduction = _Abduction(hidden, causal, path=True)
    z = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    kind = torch.arange(n) % 2 == 0
    z[kind, 0] += 8.0
    with torch.no_grad():
        x = abduction.loc_net(z)
    ones = torch.ones(n, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    rows = LearningRows(x, torch.zeros_like(x), ones, y + sign, ones, y, torch.arange(n) % 5)
    action = _Action(torch.zeros(causal, dtype=torch.float64), 0.0, 1.0)
    return abduction, z, kind, rows, action, torch.where(kind, 0.25, 1.0).double()


def test_the_widths_follow_the_misses_of_each_kind_of_row():
    """A kind of row the read-out learnt to miss 4× less gets a width 4× narrower; the other keeps its own. The map
    is written in the path's width map of z, through loc_U = W·z + b."""
    abduction, z, kind, rows, action, learnt = _two_kinds()
    width = abduction.context_values.width
    before = width(z).detach().squeeze(-1)
    learner = ValueLearner(action, rows, ValueLearning(), penalty=1.0, abduction=abduction)
    torch.testing.assert_close(learner.start_misses, torch.ones_like(rows.y))  # the monitors' misses at step 0
    assert torch.equal(width(z).detach().squeeze(-1), before)  # nothing moves before a state is written
    alpha, beta = learner.width_map(learnt)
    moved = rows.x @ alpha + beta
    # The ridge holds the map a little short of log 4 between the kinds: within 10% of each width.
    assert float(moved[kind].exp().median()) == pytest.approx(0.25, rel=0.1)
    assert float(moved[~kind].exp().median()) == pytest.approx(1.0, rel=0.1)
    learner._follow_widths(learnt)
    torch.testing.assert_close(width(z).detach().squeeze(-1) - before, moved, rtol=1e-9, atol=1e-9)
    learner._follow_widths(learner.start_misses)  # the start's misses again: its widths, not a sum of moves
    torch.testing.assert_close(width(z).detach().squeeze(-1), before, rtol=1e-9, atol=1e-9)


def test_without_the_path_the_value_width_moves_by_the_maps_mean():
    abduction, z, kind, rows, action, learnt = _two_kinds()
    abduction.context_values = None
    learner = ValueLearner(action, rows, ValueLearning(), penalty=1.0, abduction=abduction)
    alpha, beta = learner.width_map(learnt)
    learner._follow_widths(learnt)
    mean = float((rows.x @ alpha + beta).mean())
    assert float(action.reg_log_noise) == pytest.approx(mean, rel=1e-9)
    assert mean == pytest.approx((math.log(0.25) + 0.0) / 2, rel=0.1)  # half the rows of each kind


def test_settings_are_frozen_and_checked():
    settings = ValueLearning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.learning_rate = 1.0
    for bad in ({"learning_rate": 0.0}, {"learning_rate": math.nan}, {"batch_rows": 0}, {"batch_rows": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ValueLearning(**bad)
    with pytest.raises(TypeError, match="seed"):
        ValueLearning(seed="0")


@pytest.mark.parametrize("context_values", [False, True])
def test_training_trains_the_readout_and_never_ends_worse(tiny_qwen, tmp_path, context_values):
    # A rate above the default's: on this toy data 40 steps at the default move the held-out rows too little for a
    # state to pass the guard's rule for every kind.
    train, held_out = keyed(256, seed=1), keyed(128, seed=2)
    model = fresh(tiny_qwen, context_values=context_values)
    trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 40), train_dataset=train,
                                data_collator=CausalQwenDataCollator(0),
                                value_learning=ValueLearning(learning_rate=1e-2))
    start = {}

    class Start(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if not start:
                start["w"] = model.action.reg_head.weight.detach().clone()
                out, where, y = eval_forward(model, held_out)
                start["error"] = float((out.loc_Y[:, :-1][where].double() - y).abs().median())

    trainer.add_callback(Start())
    trainer.train()
    record = trainer.value_head_start.learner.record
    out, where, y = eval_forward(model, held_out)
    error = float((out.loc_Y[:, :-1][where].double() - y).abs().median())
    assert record.best_error <= record.start_error
    if context_values:
        # With the path, one kind of held-out row (a cluster of 11) ends worse while the pooled error falls, and the
        # guard keeps the start: no worse on texts it never saw.
        assert error <= start["error"] + 1e-6
        return
    assert record.best_step > 0 and record.best_error < record.start_error  # it learnt on the held-out fifth
    assert not torch.equal(model.action.reg_head.weight, start["w"])
    assert error < start["error"]  # and on texts it never saw


def _orders(data: list[dict]) -> tuple[list[dict], list[dict]]:
    return data, data[::-1]


def test_the_same_data_in_two_orders_gives_the_same_start(tiny_qwen):
    data = keyed(200, seed=4)
    fits = []
    for order in _orders(data):
        model = fresh(tiny_qwen, context_values=True)
        collate = CausalQwenDataCollator(0)
        fit_value_head(model, [collate(order[i:i + 8]) for i in range(0, len(order), 8)], context_starts=1)
        fits.append({name: p.detach().clone() for name, p in model.named_parameters()
                     if name.startswith(("action.reg_head", "abduction.context_values"))})
    for name in fits[0]:
        torch.testing.assert_close(fits[0][name], fits[1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_start_leaves_the_global_random_state(tiny_qwen):
    model = fresh(tiny_qwen, context_values=True)
    collate = CausalQwenDataCollator(0)
    data = keyed(64, seed=5)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    fit_value_head(model, [collate(data[i:i + 8]) for i in range(0, len(data), 8)], context_starts=1)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.slow
def test_the_next_value_reads_after_the_separator_the_model_writes(qwen25_dir):
    """With the real tokenizer: where standard mode's next token at the prompt's end is a space, the value is read
    after it, so a prompt without its trailing space gives the value of the prompt with it; where the next token is
    not <NUM>, a warning says so."""
    from conftest import tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    tokenizer = CausalQwenTokenizer.from_pretrained(qwen25_dir)
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).eval()
    num_id = tokenizer.convert_tokens_to_ids("<NUM>")
    model = CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer, context_values=False).eval()
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    assert len(space) == 1
    with torch.no_grad():
        model.action.cls_head.bias[space[0]] = 1e3  # standard mode writes a space everywhere
    with pytest.warns(UserWarning, match="not <NUM>"):
        bare, spaced = model.next_value(tokenizer, ["The car weighs 2300 pounds and gets",
                                                    "The car weighs 2300 pounds and gets "])
    assert bare.separator == " " and spaced.separator == ""
    # The same tokens, read in batches of other padding: equal to float32's rounding.
    assert bare.median == pytest.approx(spaced.median, rel=1e-5)
    for level in (0.5, 0.9):
        assert bare.intervals[level] == pytest.approx(spaced.intervals[level], rel=1e-5)
    assert not bare.writes_number
    with torch.no_grad():
        model.action.cls_head.bias[space[0]] = 0.0
        model.action.cls_head.bias[num_id] = 1e3  # now <NUM> comes first
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (value,) = model.next_value(tokenizer, "The car weighs 2300 pounds and gets ", levels=0.9)
    assert value.writes_number and value.separator == ""
    low, high = value.intervals[0.9]
    assert low <= value.median <= high
    with pytest.raises(ValueError, match="levels"):
        model.next_value(tokenizer, "x", levels=(1.5,))
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        model.next_value(tokenizer, [""])


def test_the_trainer_starts_the_same_from_data_in_any_order_and_seed(tiny_qwen, tmp_path):
    """Texts of several lengths (so batches of other compositions pad differently): the trainer's start, with the
    context-value path, is the same to every bit whatever order the dataset holds them in and whatever the seed."""
    data = keyed(96, seed=7)
    for k, example in enumerate(data):  # uneven lengths
        cut = 8 + k % 3
        example["input_ids"], example["numeric_values"] = example["input_ids"][:cut], example["numeric_values"][:cut]
    states = []
    for seed, order in ((0, data), (5, data[::-1])):
        model = fresh(tiny_qwen, context_values=True)
        trainer = CausalQwenTrainer(model=model, args=args(tmp_path / str(seed), 1, seed=seed,
                                                           train_sampling_strategy="random"),
                                    train_dataset=order, data_collator=CausalQwenDataCollator(0), value_learning=None)
        trainer.value_head_start.on_train_begin(trainer.args, trainer.state, trainer.control, model=model)
        states.append({name: p.detach().clone() for name, p in model.named_parameters()
                       if name.startswith(("action.reg_head", "action.reg_log_noise", "abduction.context_values"))})
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name


def _copied(n: int, seed: int) -> list[dict]:
    """Texts whose second number repeats the first: the context-value path learns to copy it."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        ids = torch.randint(1, 100, (10,), generator=g)
        ids[3] = ids[7] = NUM
        values = [0.0] * 10
        values[3] = values[7] = float(torch.rand((), generator=g, dtype=torch.float64)) * 1000
        examples.append({"input_ids": ids.tolist(), "numeric_values": values})
    return examples


def _batches(data: list[dict]) -> list[dict]:
    collate = CausalQwenDataCollator(0)
    return [collate(data[i:i + 8]) for i in range(0, len(data), 8)]


def _value_side(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if name.startswith(("action.reg_head", "action.reg_log_noise", "abduction.context_values"))}


def _held_out_error(model, data: list[dict]) -> float:
    out, where, y = eval_forward(model, data)
    return float((out.loc_Y[:, :-1][where].double() - y).abs().median())


def test_a_checkpoint_on_another_table_gets_a_value_side_fitted_afresh(tiny_qwen):
    """Fitted on copies, then started on keyed texts (whose answer no earlier number gives): the value side is fitted
    afresh on them, exactly as a start of the checkpoint's copy fits it, and reads new keyed texts better than the
    checkpoint's."""
    model = fresh(tiny_qwen, context_values=True)
    fit_value_head(model, _batches(_copied(200, seed=6)), context_starts=1)
    decision = {k: v for k, v in model.config.value_head_fit.items() if k.startswith("num_")}
    checkpoint = copy.deepcopy(model)
    new, held_out = keyed(200, seed=7), keyed(128, seed=8)
    start = start_on_new_data(model, _batches(new), context_starts=1)
    assert start.fitted_on_rows
    assert _held_out_error(model, held_out) < 0.5 * _held_out_error(checkpoint, held_out)
    reference = copy.deepcopy(checkpoint)
    fit_value_head(reference, _batches(new), num_row=False, context_starts=1)
    for name, value in _value_side(reference).items():
        torch.testing.assert_close(_value_side(model)[name], value, rtol=0, atol=0, msg=name)
    # The <NUM> decision is the checkpoint's, and its record.
    assert torch.equal(model.action.cls_head.weight, checkpoint.action.cls_head.weight)
    assert {k: v for k, v in model.config.value_head_fit.items() if k.startswith("num_")} == decision


def test_a_checkpoint_on_a_few_rows_of_its_own_table_keeps_its_value_side(tiny_qwen):
    """Fitted on 400 keyed texts, then started on 25 more: a fit of the 25 reads them worse on the folds, the
    checkpoint's value side stays to the bit, and it reads new keyed texts better than that fit would."""
    model = fresh(tiny_qwen, context_values=True)
    fit_value_head(model, _batches(keyed(400, seed=9)), context_starts=1)
    before, record = _value_side(model), dict(model.config.value_head_fit)
    few, held_out = keyed(25, seed=10), keyed(128, seed=11)
    afresh = copy.deepcopy(model)
    fit_value_head(afresh, _batches(few), num_row=False, context_starts=1)
    start = start_on_new_data(model, _batches(few), context_starts=1)
    assert not start.fitted_on_rows
    for name, value in before.items():
        assert torch.equal(_value_side(model)[name], value), name
    assert model.config.value_head_fit == record
    assert _held_out_error(model, held_out) < _held_out_error(afresh, held_out)


def test_the_trainer_starts_a_checkpoint_on_another_table_afresh(tiny_qwen, tmp_path):
    """`CausalQwenTrainer` on a checkpoint fitted on copies, trained on keyed texts: its start fits the value side
    afresh, so the trained model reads new keyed texts as a fresh conversion trained on them does."""
    held_out = keyed(128, seed=8)
    results = {}
    for name in ("checkpoint", "fresh"):
        model = fresh(tiny_qwen, context_values=True)
        if name == "checkpoint":
            fit_value_head(model, _batches(_copied(200, seed=6)), context_starts=1)
            before = _held_out_error(model, held_out)
        trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 2), train_dataset=keyed(200, seed=7),
                                    data_collator=CausalQwenDataCollator(0))
        trainer.train()
        results[name] = _held_out_error(model, held_out)
    assert results["checkpoint"] < 0.5 * before
    assert results["checkpoint"] <= 1.2 * results["fresh"]
