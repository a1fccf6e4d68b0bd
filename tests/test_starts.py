"""Starts from data: the value head's ridge read-out, leave-one-out choice, γ_Y, the <NUM> row, the trainer's hook."""

import math

import numpy as np
import pytest
import torch
from ddp_worker import NUM, dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.cauchy import symlog
from causal_qwen.data.collator import CausalQwenDataCollator
from causal_qwen.starts import fit_value_head, num_decision_start, ridge_readout
from causal_qwen.training import CausalQwenTrainer


def _numpy_ridge(x: np.ndarray, y: np.ndarray, penalty: float, scaling=None) -> tuple[np.ndarray, float]:
    """Ridge with an unpenalised intercept on unit-variance features, as an augmented least-squares problem."""
    mean, std = scaling if scaling is not None else (x.mean(0), x.std(0, ddof=1))
    a = (x - mean) / std
    n, c = a.shape
    design = np.hstack([a, np.ones((n, 1))])
    augmented = np.vstack([design, np.hstack([math.sqrt(penalty) * np.eye(c), np.zeros((c, 1))])])
    target = np.concatenate([y, np.zeros(c)])
    coef, *_ = np.linalg.lstsq(augmented, target, rcond=None)
    weight = coef[:c] / std
    return weight, float(coef[c] - (weight * mean).sum())


def _numpy_loo_median(x: np.ndarray, y: np.ndarray, penalty: float) -> float:
    """Leave-one-out by refitting n times (features standardised once, with every row)."""
    errors, scaling = [], (x.mean(0), x.std(0, ddof=1))
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        w, b = _numpy_ridge(x[keep], y[keep], penalty, scaling)
        errors.append(abs(x[i] @ w + b - y[i]))
    return float(np.median(errors))


def _numpy_loo(x: np.ndarray, y: np.ndarray, penalty: float) -> np.ndarray:
    """|Leave-one-out residuals| `[N]` by refitting n times (features standardised once, with every row)."""
    scaling = (x.mean(0), x.std(0, ddof=1))
    out = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        w, b = _numpy_ridge(x[keep], y[keep], penalty, scaling)
        out.append(abs(x[i] @ w + b - y[i]))
    return np.array(out)


def test_ridge_readout_equals_float64_ridge_and_exact_leave_one_out():
    # Fewer than 40 rows are one kind of row: the penalty of least median leave-one-out miss.
    g = np.random.default_rng(0)
    x = g.normal(size=(36, 6)) * np.array([100.0, 1.0, 0.01, 3.0, 1.0, 1.0]) + 5.0
    y = x @ np.array([0.01, -1.0, 50.0, 0.0, 0.3, 0.0]) + 2.0 + g.standard_cauchy(36) * 0.1
    penalties = (0.5, 5.0, 50.0)
    weight, bias, penalty, error = ridge_readout(torch.tensor(x), torch.tensor(y), penalties)
    loo = {p: _numpy_loo_median(x, y, p) for p in penalties}
    assert penalty == min(loo, key=loo.get)
    assert error == pytest.approx(loo[penalty], rel=1e-9)
    expected_w, expected_b = _numpy_ridge(x, y, penalty)
    np.testing.assert_allclose(weight.numpy(), expected_w, rtol=1e-9, atol=1e-12)
    assert bias == pytest.approx(expected_b, rel=1e-9)


def test_the_ridge_penalty_weighs_every_kind_of_row_alike():
    """Three kinds of rows, far apart in the features: one read closely, two loosely. The penalty is the one of least
    mean over the kinds of each kind's median leave-one-out miss (computed here by refitting, with the kinds known),
    which is not the one of least pooled median miss here: that one favours the kind read closely."""
    g = np.random.default_rng(1)
    kind = np.arange(60) % 3
    x = g.normal(size=(60, 8))
    x[:, :3] += 30.0 * np.eye(3)[kind]
    slopes = g.normal(size=(3, 8))
    noise = np.array([0.002, 0.6, 0.6])[kind]
    y = (x * slopes[kind]).sum(1) + 4.0 * kind + noise * g.normal(size=60)
    penalties = (0.01, 0.1, 1.0, 10.0, 100.0)
    weight, bias, penalty, error = ridge_readout(torch.tensor(x), torch.tensor(y), penalties)
    loo = {p: _numpy_loo(x, y, p) for p in penalties}

    def lower_median(values):  # torch's median of an even count is the lower middle value
        return np.sort(values)[(len(values) - 1) // 2]

    by_kinds = {p: np.mean([lower_median(e[kind == k]) for k in range(3)]) for p, e in loo.items()}
    pooled = {p: np.median(e) for p, e in loo.items()}
    assert min(by_kinds, key=by_kinds.get) != min(pooled, key=pooled.get)  # the data tell the two rules apart
    assert penalty == min(by_kinds, key=by_kinds.get)
    assert error == pytest.approx(np.median(loo[penalty]), rel=1e-9)
    expected_w, expected_b = _numpy_ridge(x, y, penalty)
    np.testing.assert_allclose(weight.numpy(), expected_w, rtol=1e-9, atol=1e-12)


def test_ridge_readout_rejects_bad_input():
    with pytest.raises(ValueError, match="x must be"):
        ridge_readout(torch.zeros(5, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="at least 3"):
        ridge_readout(torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(ValueError, match="penalties"):
        ridge_readout(torch.rand(5, 2), torch.rand(5), penalties=(0.0,))


@pytest.fixture
def model(tiny_qwen):
    return CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=1.0, abduction_scale_init=0.1)


def test_fit_value_head_sets_the_ridge_solution_of_a_fixed_batch(model):
    batch = CausalQwenDataCollator(0)(dataset(16))
    fit = fit_value_head(model, [batch], penalties=(3.0,))
    # The rows, computed independently: the backbone's features through the identity abduction, at every position
    # whose next token is <NUM>, against the symlog of that next value.
    with torch.no_grad():
        embeds = model.model.embed_tokens(batch["input_ids"])
        embeds = model.numeric_embedding(embeds, batch["input_ids"], batch["numeric_values"])
        hidden = model.model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).last_hidden_state
    where = batch["labels"][:, 1:] == NUM
    x = hidden[:, :-1][where].double().numpy()  # abduction is the identity at conversion
    y = symlog(batch["numeric_values"][:, 1:][where]).numpy()
    expected_w, expected_b = _numpy_ridge(x, y, 3.0)
    got_w = model.action.reg_head.weight[0].detach().double().numpy()
    np.testing.assert_allclose(got_w, expected_w, rtol=1e-4, atol=1e-6)
    assert model.action.reg_head.bias.item() == pytest.approx(expected_b, rel=1e-5, abs=1e-5)
    assert fit.positions == len(y) == 32
    assert math.exp(model.action.reg_log_noise.item()) == pytest.approx(_numpy_loo_median(x, y, 3.0), rel=1e-5)
    assert model.config.value_head_fit == fit.to_dict()


def _numpy_probe(x: np.ndarray, need: np.ndarray, target: np.ndarray, penalty: float) -> np.ndarray:
    """Ridge logistic regression σ(x·a + c − s·need) by Newton's method, parameters (a, c, s), float64."""
    n, c = x.shape
    design = np.hstack([x, np.ones((n, 1)), -need[:, None]])
    ridge = np.diag(np.r_[np.full(c, 2.0 * penalty / n), 0.0, 0.0])
    theta = np.zeros(c + 2)
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-(design @ theta)))
        gradient = design.T @ (p - target) / n + ridge @ theta
        hessian = design.T @ (design * (p * (1 - p))[:, None]) / n + ridge
        step = np.linalg.solve(hessian, gradient)
        theta -= step
        if np.abs(step).max() < 1e-13:
            break
    return theta


def _synthetic_decisions(seed: int = 1, m: int = 600, c: int = 5):
    g = np.random.default_rng(seed)
    u = g.normal(size=(m, c)) * np.array([30.0, 1.0, 0.1, 2.0, 1.0]) + 3.0
    u_scale = np.exp(g.normal(size=(m, c))) * 0.01
    row, bias, threshold = g.normal(size=c), 0.3, 2.0
    rival = g.normal(size=m) * 50.0 + 100.0
    # Labels from a noisy rule of the same form as the decision: <NUM> where a change of the row would pick it.
    need = threshold + (u_scale @ np.abs(row)) * rival - (u @ row + bias)
    is_num = u @ np.array([0.02, -1.0, 8.0, 0.5, 0.0]) + 0.4 + g.logistic(size=m) * 0.5 > need
    return u, u_scale, row, bias, threshold, rival, is_num


def test_num_decision_start_is_the_float64_probe_and_scores_standard_mode_exactly():
    u, u_scale, row, bias, threshold, rival, is_num = _synthetic_decisions()
    args = [torch.tensor(a) for a in (u, u_scale, row)] + [bias, threshold] + [torch.tensor(rival),
                                                                                torch.tensor(is_num)]
    # One round: Newton's method on the same ridge logistic regression at the row's own `need` (how far <NUM> must
    # rise to win), rescaled to need's coefficient one, gives the change.
    delta_w, delta_b, before, after = num_decision_start(*args, penalty=5.0, rounds=1)
    need = threshold + (u_scale @ np.abs(row)) * rival - (u @ row + bias)
    mean, std = u.mean(0), u.std(0, ddof=1)
    theta = _numpy_probe((u - mean) / std, need, is_num.astype(float), 5.0)
    a, c, s = theta[:-2], theta[-2], theta[-1]
    expected_w = a / std / s
    # L-BFGS stops at a gradient tolerance, Newton at machine precision: they agree to 1e-4 of the largest entry.
    np.testing.assert_allclose(delta_w.numpy(), expected_w, rtol=0, atol=1e-4 * np.abs(expected_w).max())
    assert delta_b == pytest.approx(c / s - (expected_w * mean).sum(), rel=1e-4)

    def f1(chosen):
        hits = (chosen & is_num).sum()
        return 2 * hits / (chosen.sum() + is_num.sum())

    # Standard mode's decision, from its definition: <NUM>'s margin against the best other class's, at the new row
    # (whose |w| sets the new scale).
    margin = lambda w, b: (u @ w + b - threshold) / (u_scale @ np.abs(w))  # noqa: E731
    assert before == pytest.approx(f1(margin(row, bias) > rival), abs=1e-12)
    assert after == pytest.approx(f1(margin(row + expected_w, bias + delta_b) > rival), abs=1e-12)
    assert after > before + 0.15  # 0.73 -> 0.94 on these data
    # More rounds keep the best exact score, never a worse one.
    delta_w, delta_b, _, more = num_decision_start(*args, penalty=5.0)
    assert more >= after
    assert more == pytest.approx(f1(margin(row + delta_w.numpy(), bias + delta_b) > rival), abs=1e-12)


def test_num_decision_start_leaves_the_row_without_both_kinds_of_label():
    u, u_scale, row, bias, threshold, rival, _ = _synthetic_decisions(m=50)
    for is_num in (np.zeros(50, dtype=bool), np.ones(50, dtype=bool)):
        delta_w, delta_b, before, after = num_decision_start(
            *(torch.tensor(a) for a in (u, u_scale, row)), bias, threshold, torch.tensor(rival), torch.tensor(is_num))
        assert not delta_w.any() and delta_b == 0.0 and before == after


def test_num_decision_start_rejects_bad_input():
    u, s, row, rival, is_num = torch.ones(4, 3), torch.ones(4, 3), torch.ones(3), torch.ones(4), torch.ones(4) > 0
    with pytest.raises(ValueError, match="u and u_scale"):
        num_decision_start(u, torch.ones(4, 2), row, 0.0, 1.0, rival, is_num)
    with pytest.raises(ValueError, match="u and u_scale"):
        num_decision_start(u, s, torch.ones(2), 0.0, 1.0, rival, is_num)
    with pytest.raises(ValueError, match="rival and is_num"):
        num_decision_start(u, s, row, 0.0, 1.0, torch.ones(3), is_num)
    with pytest.raises(ValueError, match="penalty"):
        num_decision_start(u, s, row, 0.0, 1.0, rival, is_num, penalty=0.0)


def test_fit_value_head_starts_the_num_row_for_standard_mode(model):
    batch = CausalQwenDataCollator(0)(dataset(16))
    weight_before = model.action.cls_head.weight.detach().clone()
    bias_before = model.action.cls_head.bias.detach().clone()

    def num_f1() -> float:
        # Standard mode through the full forward: the class of largest P_k, at every labelled position.
        with torch.no_grad():
            out = model(batch["input_ids"], numeric_values=batch["numeric_values"],
                        attention_mask=batch["attention_mask"])
        labelled = batch["labels"][:, 1:] != -100
        p = model.ovr_probabilities(out.loc_S[:, :-1].double(), out.scale_S[:, :-1].double())
        chosen = (p.argmax(-1) == NUM)[labelled]
        truth = (batch["labels"][:, 1:] == NUM)[labelled]
        return 2 * (chosen & truth).sum().item() / (chosen.sum() + truth.sum()).item()

    before = num_f1()
    fit = fit_value_head(model, [batch], num_row_penalty=1.0)  # 144 positions: a lighter penalty than for 8,192
    assert fit.num_positions == 16 * 9
    assert fit.num_f1_before == pytest.approx(before, abs=1e-9)
    assert fit.num_f1_after == pytest.approx(num_f1(), abs=1e-9)
    assert fit.num_f1_after > fit.num_f1_before
    weight_moved = (model.action.cls_head.weight.detach() - weight_before).abs().sum(1)
    bias_moved = model.action.cls_head.bias.detach() - bias_before
    assert torch.nonzero(weight_moved).flatten().tolist() == [NUM]  # no other class moves
    assert torch.nonzero(bias_moved).flatten().tolist() == [NUM]
    assert bias_moved[NUM].item() == pytest.approx(fit.num_bias_offset, rel=1e-5, abs=1e-6)
    change = ((model.action.cls_head.weight[NUM] - weight_before[NUM]).norm() / weight_before[NUM].norm()).item()
    assert fit.num_row_change == pytest.approx(change, rel=1e-5) and change > 0
    assert model.config.value_head_fit == fit.to_dict()


def test_fit_value_head_can_leave_the_num_row(model):
    weight_before = model.action.cls_head.weight.detach().clone()
    bias_before = model.action.cls_head.bias.detach().clone()
    fit = fit_value_head(model, [CausalQwenDataCollator(0)(dataset(16))], num_row=False)
    assert torch.equal(model.action.cls_head.bias, bias_before)
    assert torch.equal(model.action.cls_head.weight, weight_before)
    assert fit.num_bias_offset is None and fit.num_f1_before is None and fit.num_positions is None
    with pytest.raises(TypeError, match="num_row"):
        fit_value_head(model, [CausalQwenDataCollator(0)(dataset(16))], num_row=1)
    with pytest.raises(ValueError, match="max_decision_positions"):
        fit_value_head(model, [CausalQwenDataCollator(0)(dataset(16))], max_decision_positions=0)


def test_fit_value_head_caps_the_decision_positions(model):
    fit = fit_value_head(model, [CausalQwenDataCollator(0)(dataset(16))], max_decision_positions=50)
    assert fit.num_positions == 50 and fit.positions == 32


def test_fit_value_head_reads_only_labelled_positions(model):
    # Prompt positions (label −100) are not rows, even when their next token is <NUM>.
    features = dataset(16)
    for f in features:
        f["labels"] = [-100] * 5 + f["input_ids"][5:]  # the <NUM> at index 3 is in the prompt, the one at 7 is not
    fit = fit_value_head(model, [CausalQwenDataCollator(0)(features)])
    assert fit.positions == 16


def test_fit_value_head_errors(model, tiny_qwen):
    batch = CausalQwenDataCollator(0)([{"input_ids": list(range(1, 9))}])
    with pytest.raises(ValueError, match="nothing to fit"):
        fit_value_head(model, [batch])
    text_only = CausalQwenForCausalLM.from_qwen(tiny_qwen, use_numeric=False)
    with pytest.raises(ValueError, match="use_numeric=True"):
        fit_value_head(text_only, [batch])


def _scaled(examples: list[dict], factor: float) -> list[dict]:
    return [{**e, "numeric_values": [v * factor for v in e["numeric_values"]]} for e in examples]


@pytest.mark.parametrize("factor", [1e37, 1e300])
def test_fit_value_head_refuses_a_read_out_the_head_cannot_hold(tiny_qwen, factor):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=1.0, abduction_scale_init=0.1,
                                            value_transform="identity")
    batch = CausalQwenDataCollator(0)(_scaled(dataset(16), factor))  # values up to 100 * factor
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"value_transform='identity'.*torch.float32.*3.403e\+38.*symlog"):
        fit_value_head(model, [batch])
    # Nothing was written: the model is as it was.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config.value_head_fit is None


def test_fit_value_head_with_identity_values_near_the_float32_range(tiny_qwen):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=1.0, abduction_scale_init=0.1,
                                            value_transform="identity")
    batch = CausalQwenDataCollator(0)(_scaled(dataset(16), 1e34))  # values up to 1e36
    fit_value_head(model, [batch], penalties=(3.0,), num_row=False)
    with torch.no_grad():
        out = model(batch["input_ids"], numeric_values=batch["numeric_values"])
    where = batch["labels"][:, 1:] == NUM
    x = out.loc_U[:, :-1][where].double().numpy()
    y = batch["numeric_values"][:, 1:][where].numpy()
    expected_w, expected_b = _numpy_ridge(x, y, 3.0)
    assert model.action.reg_head.bias.item() == pytest.approx(expected_b, rel=1e-5)
    np.testing.assert_allclose(model.action.reg_head.weight[0].detach().double().numpy(), expected_w, rtol=1e-4,
                               atol=1e-6 * np.abs(expected_w).max())
    assert torch.isfinite(out.loc_Y).all()


def _args(tmp_path, steps: int, learning_rate: float = 1e-2, **kw) -> TrainingArguments:
    kw.setdefault("save_strategy", "no")
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=steps,
                             learning_rate=learning_rate, report_to=[], logging_steps=1, use_cpu=True,
                             disable_tqdm=True, seed=0, **kw)


def _value_nll(model, data) -> float:
    """Mean Cauchy NLL of the true next value (symlog space) where the next token is <NUM>, ungated."""
    batch = CausalQwenDataCollator(0)(data)
    model.eval()
    with torch.no_grad():
        out = model(batch["input_ids"], numeric_values=batch["numeric_values"])
    where = batch["input_ids"][:, 1:] == NUM
    y = symlog(batch["numeric_values"][:, 1:][where])
    loc, scale = out.loc_Y[:, :-1][where].double(), out.scale_Y[:, :-1][where].double()
    return (torch.log(math.pi * scale) + torch.log1p(((y - loc) / scale) ** 2)).mean().item()


def test_trainer_starts_the_value_head_then_keeps_learning(model, tmp_path):
    data = dataset(50)  # 100 value rows: the path holds out 20, enough for the end-of-training check
    before = {"w_num": model.numeric_embedding.w_num.detach().clone(),
              "b_reg": model.action.reg_head.bias.detach().clone(),
              "log_noise": model.action.reg_log_noise.detach().clone()}
    nll_start = _value_nll(model, data)
    last_step = {}

    class LastStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            last_step["w_num"] = model.numeric_embedding.w_num.detach().clone()

    trainer = CausalQwenTrainer(model=model, args=_args(tmp_path, 30), train_dataset=data,
                                data_collator=CausalQwenDataCollator(0), callbacks=[LastStep()],
                                train_value_features=True)
    trainer.train()
    fit = trainer.value_head_start.fit
    assert fit is not None and fit.positions == 100
    assert model.config.value_head_fit == fit.to_dict()
    nll_end = _value_nll(model, data)
    assert nll_end < nll_start
    # The features trained; at the end they are kept, or restored to the start's where they predict worse.
    assert not torch.equal(last_step["w_num"], before["w_num"]), "w_num"
    kept = trainer.value_head_start.kept_trained_features
    assert kept is not None
    assert torch.equal(model.numeric_embedding.w_num.detach(), last_step["w_num"] if kept else before["w_num"])
    for name, param in (("b_reg", model.action.reg_head.bias), ("log_noise", model.action.reg_log_noise)):
        assert not torch.equal(param.detach(), before[name]), name
    # Kept, the trained features moved the refitted head away from the start; restored, the head is the start's.
    noise = model.action.reg_log_noise.exp().item()
    if kept:
        assert noise != pytest.approx(fit.regression_noise, rel=1e-6)
    else:
        assert noise == pytest.approx(fit.regression_noise, rel=1e-6)


def test_trainer_does_not_refit_a_reloaded_model(model, tmp_path):
    data = dataset(16)
    CausalQwenTrainer(model=model, args=_args(tmp_path / "a", 2), train_dataset=data,
                      data_collator=CausalQwenDataCollator(0)).train()
    model.save_pretrained(tmp_path / "saved")
    reloaded = CausalQwenForCausalLM.from_pretrained(tmp_path / "saved")
    assert reloaded.config.value_head_fit == model.config.value_head_fit is not None
    head = reloaded.action.reg_head.weight.detach().clone()
    bias = reloaded.action.reg_head.bias.detach().clone()
    # The read-out held (no learning): nothing fits it again.
    again = CausalQwenTrainer(model=reloaded, args=_args(tmp_path / "b", 1, learning_rate=1e-12), train_dataset=data,
                              data_collator=CausalQwenDataCollator(0), value_learning=None)
    again.train()
    assert again.value_head_start.fit is None
    torch.testing.assert_close(reloaded.action.reg_head.bias, bias, rtol=0, atol=1e-9)
    # Learning (the default): it trains from the reloaded read-out, which reads these rows as it was fitted to.
    learning = CausalQwenTrainer(model=reloaded, args=_args(tmp_path / "c", 1, learning_rate=1e-12),
                                 train_dataset=data, data_collator=CausalQwenDataCollator(0))
    learning.train()
    learner = learning.value_head_start.learner
    assert learning.value_head_start.fit is None and not learner.restarted
    torch.testing.assert_close(learner.readout.w0.float(), head[0], rtol=0, atol=0)


def test_trainer_does_not_refit_when_resuming(tiny_qwen, tmp_path):
    data = dataset(16)

    def fresh():
        return CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=1.0,
                                               abduction_scale_init=0.1)

    first = CausalQwenTrainer(model=fresh(), args=_args(tmp_path, 2, save_strategy="steps", save_steps=2),
                              train_dataset=data, data_collator=CausalQwenDataCollator(0))
    first.train()
    assert first.value_head_start.fit is not None
    resumed = CausalQwenTrainer(model=fresh(), args=_args(tmp_path, 3, save_strategy="steps", save_steps=2),
                                train_dataset=data, data_collator=CausalQwenDataCollator(0))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.value_head_start.fit is None


def test_plain_trainer_with_the_public_function(model, tmp_path):
    data = dataset(16)
    trainer = Trainer(model=model, args=_args(tmp_path, 1), train_dataset=data, data_collator=CausalQwenDataCollator(0))
    fit = fit_value_head(model, trainer.get_eval_dataloader(data))
    assert fit.positions == 32 and model.config.value_head_fit is not None


def test_value_head_start_can_be_turned_off(model, tmp_path):
    trainer = CausalQwenTrainer(model=model, args=_args(tmp_path, 1), train_dataset=dataset(8),
                                data_collator=CausalQwenDataCollator(0), value_head_start=False)
    trainer.train()
    assert trainer.value_head_start is None and model.config.value_head_fit is None
    with pytest.raises(TypeError, match="value_head_start"):
        CausalQwenTrainer(model=model, args=_args(tmp_path, 1), train_dataset=dataset(8), value_head_start="yes")
