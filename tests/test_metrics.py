"""Metrics against straightforward recomputations from the model's outputs."""

import math

import pytest
import torch

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.metrics import FIELDS, CausalQwenMetrics, evaluate, position_statistics, summarize

NUM = 120


@pytest.fixture
def setup(tiny_qwen):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=0.2,
                                            abduction_scale_init=0.05, value_transform="symlog").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.action.cls_head.bias[NUM] = 0.5
        model.action.reg_head.weight.normal_(0.0, 0.3, generator=g)
        model.action.reg_head.bias.fill_(2.0)
    ids = torch.randint(0, 100, (3, 10), generator=g)
    ids[:, 3], ids[:, 7] = NUM, NUM
    values = torch.zeros(3, 10, dtype=torch.float64)
    values[:, 3] = torch.tensor([5.0, 40.0, 300.0], dtype=torch.float64)
    values[:, 7] = torch.tensor([7.5, 0.5, 1e4], dtype=torch.float64)
    labels = ids.clone()
    labels[0, 8:] = -100
    return model, ids, values, labels


def test_eval_metrics_match_recomputation(setup):
    model, ids, values, labels = setup
    batch = {"input_ids": ids, "numeric_values": values, "labels": labels, "numeric_labels": values}
    metrics = evaluate(model, [batch], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, numeric_values=values)
    loc, scale = out.loc_S[:, :-1].double(), out.scale_S[:, :-1].double()
    tgt = labels[:, 1:]
    valid = tgt != -100
    p = 0.5 + torch.atan((loc - 0.2) / scale) / math.pi
    pred = p.argmax(-1)
    assert metrics["eval/accuracy"] == pytest.approx((pred == tgt)[valid].double().mean().item())
    ce = torch.nn.functional.cross_entropy(out.loc_S[:, :-1].reshape(-1, 128), tgt.reshape(-1), ignore_index=-100)
    assert metrics["eval/ppl_softmax"] == pytest.approx(math.exp(ce.item()), rel=1e-5)
    p_norm = p / p.sum(-1, keepdim=True)
    nll_ovr = -torch.log(p_norm.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1))[valid].mean()
    assert metrics["eval/ppl_ovr"] == pytest.approx(math.exp(nll_ovr.item()), rel=1e-4)
    assert metrics["dist/ovr_prob_sum_median"] == pytest.approx(p.sum(-1)[valid].median().item(), rel=1e-4)

    is_num, pred_num = (tgt == NUM) & valid, (pred == NUM) & valid
    tp = (is_num & pred_num).sum().item()
    precision = tp / pred_num.sum().item() if pred_num.any() else 0.0
    recall = tp / is_num.sum().item()
    assert metrics["eval/num_precision"] == pytest.approx(precision)
    assert metrics["eval/num_recall"] == pytest.approx(recall)

    loc_y, scale_y = out.loc_Y[:, :-1][is_num].double(), out.scale_Y[:, :-1][is_num].double()
    true = values[:, 1:][is_num]
    median = torch.sign(loc_y) * torch.expm1(loc_y.abs())
    assert metrics["eval/reg_mae"] == pytest.approx((median - true).abs().mean().item(), rel=1e-6)
    ss_res, ss_tot = (median - true).square().sum(), (true - true.mean()).square().sum()
    assert metrics["eval/reg_r2"] == pytest.approx(1 - (ss_res / ss_tot).item(), rel=1e-6)
    low50 = torch.sign(loc_y - scale_y) * torch.expm1((loc_y - scale_y).abs())  # tan(π/4) = 1
    high50 = torch.sign(loc_y + scale_y) * torch.expm1((loc_y + scale_y).abs())
    inside = ((true >= low50) & (true <= high50)).double().mean().item()
    assert metrics["eval/reg_coverage_50"] == pytest.approx(inside)
    assert true.numel() == 6
    assert metrics["eval/reg_mdae"] == pytest.approx((median - true).abs().median().item(), rel=1e-6)
    assert metrics["dist/b_noise_abs_mean"] == pytest.approx(model.config.noise_init, rel=1e-5)
    assert 0.0 < metrics["dist/ovr_prob_sum_median_causal"]


def test_trainer_hooks_equal_standalone(setup):
    model, ids, values, labels = setup
    with torch.no_grad():
        out = model(ids, numeric_values=values, labels=labels, numeric_labels=values)
    outputs = tuple(v for k, v in out.items() if k not in ("loss", "past_key_values"))
    hooks = CausalQwenMetrics(model, seed=0)
    packed = hooks.preprocess_logits_for_metrics(outputs, (labels, values))
    assert packed.shape == (3, 10, len(FIELDS))

    class Prediction:
        predictions = packed.numpy()

    from_trainer = hooks.compute_metrics(Prediction())
    standalone = evaluate(model, [{"input_ids": ids, "numeric_values": values, "labels": labels,
                                   "numeric_labels": values}], generator=torch.Generator().manual_seed(0))
    for key, value in standalone.items():
        assert from_trainer[key.removeprefix("eval/")] == pytest.approx(value, rel=1e-9, nan_ok=True), key


def test_no_valid_positions_gives_no_metrics(setup):
    model, ids, values, _ = setup
    with torch.no_grad():
        out = model(ids, numeric_values=values)
    stats = position_statistics(model, out.loc_S, out.scale_S, out.loc_Y, out.scale_Y, out.loc_U, out.scale_U,
                                torch.full_like(ids, -100), values)
    assert summarize(stats, model) == {}
