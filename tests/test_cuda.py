"""The model on a CUDA device: the same numbers as on the CPU, bf16 that stays finite and close, generation.

These tests need a GPU (`pytest -m cuda` on a machine with one); elsewhere they are reported as skipped.
Every comparison is against the CPU computation of the same model or against Qwen2 on the same device.
"""

import pytest
import torch
from transformers import Qwen2ForCausalLM, Trainer, TrainingArguments

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.data import CausalQwenDataCollator
from causal_qwen.loss import DecisionScores, LossOptions, LossTargets, Tiling, causal_qwen_loss

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM = 120
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _exact_matmul():
    """Full-precision fp32 products, so that CPU and GPU are compared on their arithmetic, not TF32."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def build(tiny_qwen, **overrides) -> CausalQwenForCausalLM:
    """A tiny CausalQwen whose decisions depend on the context, with a non-trivial regression head."""
    fields = dict(ovr_threshold=0.5, abduction_scale_init=0.3, noise_init=0.05) | overrides
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, **fields)
    with torch.no_grad():
        model.action.reg_head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
    return model


def batch_with_numbers(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (3, 12), generator=g)
    ids[:, 5] = NUM
    ids[1, 9] = NUM
    values = torch.zeros(3, 12, dtype=torch.float64)
    values[:, 5] = torch.tensor([3.5, -250.0, 1e6], dtype=torch.float64)
    values[1, 9] = 0.125
    labels = ids.clone()
    labels[2, :4] = -100
    return {"input_ids": ids, "numeric_values": values, "labels": labels}


def to(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}


def test_forward_outputs_equal_the_cpu(tiny_qwen):
    model = build(tiny_qwen).eval()
    batch = batch_with_numbers()
    batch.pop("labels")
    with torch.no_grad():
        cpu = model(**batch)
        gpu = model.to(CUDA)(**to(batch, CUDA))
    for name in ("loc_S", "scale_S", "loc_Y", "scale_Y", "loc_U", "scale_U"):
        torch.testing.assert_close(getattr(gpu, name).cpu(), getattr(cpu, name), rtol=1e-5, atol=1e-5)


def test_fused_training_loss_and_gradients_equal_the_cpu(tiny_qwen):
    model = build(tiny_qwen, learnable_threshold=True).train()
    batch = batch_with_numbers()
    cpu_loss, cpu_grads = loss_and_grads(model, batch)
    gpu_loss, gpu_grads = loss_and_grads(model.to(CUDA), to(batch, CUDA))
    assert gpu_loss.item() == pytest.approx(cpu_loss.item(), rel=1e-5)
    assert gpu_grads.keys() == cpu_grads.keys() and "numeric_embedding.w_num" in gpu_grads
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name].cpu(), grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item())


def test_fused_loss_at_full_vocabulary_equals_the_straightforward_loss_in_float64():
    """The tiled kernel at Qwen2.5's real head size (151,936 classes), on the GPU, against float64."""
    from causal_qwen import CausalQwenConfig
    from causal_qwen.modeling import CausalQwenAction

    torch.manual_seed(0)
    vocab, hidden, n = 151_936, 64, 96
    config = CausalQwenConfig(vocab_size=vocab, hidden_size=hidden, num_token_id=151_665, ovr_threshold=3.0,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128)
    action = CausalQwenAction(config).to(CUDA)
    with torch.no_grad():
        action.cls_head.weight.normal_(0.0, 0.3)
        action.reg_head.weight.normal_(0.0, 0.3)
    loc_u = torch.randn(2, n // 2, hidden, device=CUDA, requires_grad=True)
    scale_u = (torch.rand(2, n // 2, hidden, device=CUDA) * 0.1 + 1e-3).requires_grad_()
    labels = torch.randint(0, vocab, (2, n // 2), device=CUDA)
    labels[:, 7::9] = 151_665
    values = torch.randn(2, n // 2, device=CUDA, dtype=torch.float64) * 100
    common = dict(num_token_id=151_665, value_transform="symlog", gate_alpha=0.3)

    targets = LossTargets.from_labels(labels, values)
    fused = action(loc_u, scale_u, targets, output_distributions=False, loss_options=LossOptions(**common),
                   tiling=Tiling(memory_budget=64 * 2**20))
    fused_grads = torch.autograd.grad(fused.loss, [loc_u, scale_u, action.cls_head.weight])

    action64 = action.double()
    loc64, scale64 = loc_u.detach().double().requires_grad_(), scale_u.detach().double().requires_grad_()
    straight = causal_qwen_loss(*heads(action64, loc64, scale64), targets, LossOptions(**common))
    straight_grads = torch.autograd.grad(straight.loss, [loc64, scale64, action64.cls_head.weight])
    assert fused.loss.item() == pytest.approx(straight.loss.item(), rel=1e-5)
    for got, want in zip(fused_grads, straight_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-5 * want.abs().max().item())


def test_bfloat16_training_step_is_finite_and_close_to_float32(tiny_qwen):
    batch = to(batch_with_numbers(), CUDA)
    fp32 = build(tiny_qwen).to(CUDA).train()
    loss32, _ = loss_and_grads(fp32, batch)
    bf16 = build(tiny_qwen).to(CUDA, torch.bfloat16).train()
    loss16, grads16 = loss_and_grads(bf16, batch)
    assert torch.isfinite(loss16) and loss16.dtype == torch.float32
    assert loss16.item() == pytest.approx(loss32.item(), rel=5e-2)
    assert all(torch.isfinite(g).all() for g in grads16.values())


def test_traditional_greedy_equals_qwen2_greedy_on_the_gpu(tiny_qwen):
    qwen = tiny_qwen.to(CUDA)
    model = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=NUM).to(CUDA).eval()
    ids = torch.randint(1, 100, (3, 8), device=CUDA)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    common = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0, do_sample=False)
    want = Qwen2ForCausalLM.generate(qwen, ids, **common)
    got = model.generate(ids, mode="traditional", **common)
    assert torch.equal(got, want)


@pytest.mark.parametrize("generator_device", ["cpu", "cuda"])
def test_causal_generation_is_reproducible_and_cache_free_equal(tiny_qwen, generator_device):
    model = build(tiny_qwen).to(CUDA).eval()
    ids = torch.randint(1, 100, (2, 6), device=CUDA)
    mask = torch.ones_like(ids)

    def run(seed, use_cache=True):
        g = torch.Generator(device=generator_device).manual_seed(seed)
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, mode="causal",
                              generator=g, use_cache=use_cache, return_dict_in_generate=True)

    a, b, c, d = run(0), run(0), run(1), run(0, use_cache=False)
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.sequences, d.sequences)
    assert not torch.equal(a.sequences, c.sequences)


def test_trainer_bf16_on_the_gpu_trains_heads_and_keeps_the_backbone(tiny_qwen, tmp_path):
    model = build(tiny_qwen).train()
    backbone = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    head = model.action.cls_head.weight.detach().clone()
    rows = []
    for seed in range(8):
        b = batch_with_numbers(seed)
        rows.append({"input_ids": b["input_ids"][0].tolist(), "numeric_values": b["numeric_values"][0].tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4,
                             learning_rate=1e-3, bf16=True, report_to=[], logging_steps=1, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=CausalQwenDataCollator(pad_token_id=0))
    trainer.train()
    assert model.device.type == "cuda"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    for name, p in model.model.named_parameters():
        assert torch.equal(p.detach().cpu(), backbone[name]), name
    assert not torch.equal(model.action.cls_head.weight.detach().cpu(), head)


def test_standalone_metrics_and_plots_of_a_gpu_model(tiny_qwen, tmp_path):
    from causal_qwen.metrics import evaluate
    from causal_qwen.plots import plot_evaluation

    model = build(tiny_qwen).eval()
    batches = [batch_with_numbers(seed) for seed in range(3)]
    want = evaluate(model, batches, generator=torch.Generator().manual_seed(0))
    got, stats = evaluate(model.to(CUDA), batches, generator=torch.Generator().manual_seed(0),
                          return_statistics=True)
    assert got.keys() == want.keys() and "dist/ovr_prob_sum_median_causal" in got
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    paths = plot_evaluation(model, stats, tmp_path)
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)


def test_cauchy_sample_draws_with_a_cpu_generator_on_gpu_tensors():
    from causal_qwen.cauchy import sample

    loc, scale = torch.randn(4, 8), torch.rand(4, 8) + 0.1
    want = sample(loc, scale, torch.Generator().manual_seed(3))
    got = sample(loc.to(CUDA), scale.to(CUDA), torch.Generator().manual_seed(3))
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_bfloat16_fused_loss_runs_half_precision_products_close_to_float64():
    """On CUDA, bf16 inputs take tensor-core products with fp32 outputs; loss and gradients stay accurate."""
    import copy
    from unittest import mock

    from causal_qwen import CausalQwenConfig, chunked_loss
    from causal_qwen.modeling import CausalQwenAction

    torch.manual_seed(0)
    vocab, hidden, n = 20_000, 64, 96
    config = CausalQwenConfig(vocab_size=vocab, hidden_size=hidden, num_token_id=19_999, ovr_threshold=3.0,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, learnable_threshold=True)
    action = CausalQwenAction(config)
    with torch.no_grad():
        action.cls_head.weight.normal_(0.0, 0.3)
        action.cls_head.bias.normal_(0.0, 0.3)
        action.reg_head.weight.normal_(0.0, 0.3)
    action = action.to(CUDA, torch.bfloat16)
    loc_u = torch.randn(2, n // 2, hidden, device=CUDA).to(torch.bfloat16).requires_grad_()
    scale_u = (torch.rand(2, n // 2, hidden, device=CUDA) * 0.1 + 1e-3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (2, n // 2), device=CUDA)
    labels[:, 7::9] = 19_999
    values = torch.randn(2, n // 2, device=CUDA, dtype=torch.float64) * 100
    common = dict(num_token_id=19_999, value_transform="symlog", gate_alpha=0.3)
    inputs = [loc_u, scale_u, action.cls_head.weight, action.cls_head.bias, action.threshold]

    taken, real = [], chunked_loss._half_products
    with mock.patch.object(chunked_loss, "_half_products", side_effect=lambda *a: taken.append(real(*a)) or taken[-1]):
        targets = LossTargets.from_labels(labels, values)
        fused = action(loc_u, scale_u, targets, output_distributions=False, loss_options=LossOptions(**common),
                       tiling=Tiling(memory_budget=16 * 2**20))
        fused_grads = torch.autograd.grad(fused.loss, inputs)
    assert taken and all(taken)  # the half-precision products ran

    # The exact answer for these bf16 values, in float64; and autograd's own bf16 path for comparison.
    action64 = copy.deepcopy(action).double()
    leaves64 = [x.detach().double().requires_grad_() for x in (loc_u, scale_u)]
    straight64 = causal_qwen_loss(*heads(action64, *leaves64), targets, LossOptions(**common))
    want = torch.autograd.grad(straight64.loss, leaves64 + [action64.cls_head.weight, action64.cls_head.bias,
                                                             action64.threshold])
    straight16 = causal_qwen_loss(*heads(action, loc_u, scale_u), targets, LossOptions(**common))
    bf16_grads = torch.autograd.grad(straight16.loss, inputs)

    assert fused.loss.item() == pytest.approx(straight64.loss.item(), rel=1e-4)
    for got, plain, ref in zip(fused_grads, bf16_grads, want, strict=True):
        scale = ref.abs().max().item()
        fused_err = (got.double() - ref).abs().max().item() / scale
        plain_err = (plain.double() - ref).abs().max().item() / scale
        assert fused_err <= max(plain_err, 2e-2), (fused_err, plain_err)


def heads(action, loc_u, scale_u):
    """`(DecisionScores, loc_Y, scale_Y)` of the action module, for the straightforward loss."""
    out = action(loc_u, scale_u)
    return DecisionScores(out.loc_S, out.scale_S, action.threshold), out.loc_Y, out.scale_Y


# ---------------------------------------------------------------------------------------------------------------
# The context-value path (docs/design.md §1b) on the GPU
# ---------------------------------------------------------------------------------------------------------------


def path_model(tiny_qwen, spread: float = 0.4) -> CausalQwenForCausalLM:
    """A tiny CausalQwen whose path reads: every weight of the path random, so no term is 0 or 1 by construction."""
    model = build(tiny_qwen, context_values=True, context_values_rank=4)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.abduction.context_values.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * spread)
    return model


def test_the_context_path_forward_and_gradients_equal_the_cpu(tiny_qwen):
    model = path_model(tiny_qwen).eval()
    batch = batch_with_numbers()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        cpu = model(**inputs)
        gpu = model.to(CUDA)(**to(inputs, CUDA))
    for name in ("loc_Y", "scale_Y", "loc_U", "scale_U"):
        torch.testing.assert_close(getattr(gpu, name).cpu(), getattr(cpu, name), rtol=1e-5, atol=1e-5)
    model = model.cpu().train()
    cpu_loss, cpu_grads = loss_and_grads(model, batch)
    gpu_loss, gpu_grads = loss_and_grads(model.to(CUDA), to(batch, CUDA))
    assert gpu_loss.item() == pytest.approx(cpu_loss.item(), rel=1e-5)
    assert any(name.startswith("abduction.context_values.") for name in gpu_grads)
    assert gpu_grads.keys() == cpu_grads.keys()
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name].cpu(), grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item())


def test_the_context_path_in_bfloat16_is_finite_and_close_to_float32(tiny_qwen):
    batch = to(batch_with_numbers(), CUDA)
    fp32 = path_model(tiny_qwen).to(CUDA).train()
    loss32, _ = loss_and_grads(fp32, batch)
    with torch.no_grad():
        want = fp32.eval()(**{k: v for k, v in batch.items() if k != "labels"}).loc_Y
    bf16 = path_model(tiny_qwen).to(CUDA, torch.bfloat16).train()
    loss16, grads16 = loss_and_grads(bf16, batch)
    assert torch.isfinite(loss16) and loss16.item() == pytest.approx(loss32.item(), rel=5e-2)
    assert all(torch.isfinite(g).all() for g in grads16.values())
    with torch.no_grad():
        got = bf16.eval()(**{k: v for k, v in batch.items() if k != "labels"}).loc_Y
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * want.abs().max().item())


def test_written_numbers_join_the_context_under_the_default_compiled_static_cache(tiny_qwen):
    """On a GPU, transformers compiles the decoding forward for a static cache by default: the path's cache entries
    must survive it, and every written value is the median a full forward over the final text predicts there."""
    model = path_model(tiny_qwen, spread=0.1).to(CUDA).eval()  # products of written values that stay in range
    with torch.no_grad():
        model.action.threshold[NUM] = -1e4
        model.action.cls_head.bias[NUM] = 1e3
        model.action.reg_head.weight.mul_(0.1)  # written values of a moderate size, compared at a relative tolerance
    batch = to(batch_with_numbers(), CUDA)
    ids, values = batch["input_ids"], batch["numeric_values"]
    values[:, 5] = torch.tensor([3.5, -25.0, 12.0], dtype=values.dtype, device=CUDA)
    common = dict(attention_mask=torch.ones_like(ids), numeric_values=values, max_new_tokens=5, pad_token_id=0,
                  mode="standard", return_dict_in_generate=True)
    torch.compiler.reset()
    eager = model.generate(ids, **common)
    compiled = model.generate(ids, cache_implementation="static", **common)
    start = ids.shape[1]
    assert (compiled.sequences[:, start:] == NUM).all()
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(compiled.numeric_values, eager.numeric_values, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        full = model(compiled.sequences, numeric_values=compiled.numeric_values)
    expected = model.to_value(full.loc_Y[:, start - 1:-1].double())
    torch.testing.assert_close(compiled.numeric_values[:, start:], expected, rtol=1e-4, atol=1e-5)
    assert compiled.numeric_values[0, start:].unique().numel() > 1
