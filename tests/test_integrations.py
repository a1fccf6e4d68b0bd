"""CausalQwen where Qwen2ForCausalLM fits: remote code, PEFT, bf16, gradient checkpointing, device_map."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from causal_qwen import CausalQwenForCausalLM

NUM = 120


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 8), generator=g)
    ids[:, 3] = NUM
    values = torch.zeros(2, 8, dtype=torch.float64)
    values[:, 3] = torch.tensor([5.0, -12.5], dtype=torch.float64)
    return ids, values


@pytest.fixture
def saved(tmp_path, tiny_qwen):
    model = CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM).eval()
    with torch.no_grad():
        model.action.reg_head.weight.mul_(10.0)
    model.save_pretrained(tmp_path / "model")
    return model, tmp_path / "model"


def test_remote_code_loads_without_the_package(saved):
    model, path = saved
    config = json.loads((path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.CausalQwenForCausalLM"
    for name in ("modeling.py", "configuration.py", "cauchy.py", "loss.py", "generation.py"):
        assert (path / name).exists(), name
    ids, values = batch()
    with torch.no_grad():
        expected = model(ids, numeric_values=values)
    torch.save({"ids": ids, "values": values}, path.parent / "inputs.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["causal_qwen"] = None  # the package must not be importable here
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(path)!r}, trust_remote_code=True, dtype=torch.float32)
        assert "causal_qwen" not in type(model).__module__.split(".")[0], type(model).__module__
        inputs = torch.load({str(path.parent / "inputs.pt")!r})
        with torch.no_grad():
            out = model(inputs["ids"], numeric_values=inputs["values"])
        torch.save({{"loc_S": out.loc_S, "loc_Y": out.loc_Y, "module": type(model).__module__}},
                   {str(path.parent / "remote.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=path.parent)
    remote = torch.load(path.parent / "remote.pt")
    assert remote["module"].startswith("transformers_modules")
    assert torch.equal(remote["loc_S"], expected.loc_S) and torch.equal(remote["loc_Y"], expected.loc_Y)


def test_model_card_is_written_and_kept(saved):
    model, path = saved
    card = (path / "README.md").read_text()
    assert "CausalQwen" in card and "trust_remote_code=True" in card
    assert f"| `num_token_id` | `{NUM}` |" in card and "| `ovr_threshold` |" in card
    assert f"| `context_values` | `{model.config.context_values}` |" in card
    assert f"| `context_values_log` | `{model.config.context_values_log}` |" in card
    (path / "README.md").write_text("my own card")
    model.save_pretrained(path)
    assert (path / "README.md").read_text() == "my own card"


def test_lora_trains_saves_and_reloads_with_causal_heads(saved, tmp_path):
    _, path = saved
    base = CausalQwenForCausalLM.from_pretrained(path)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["numeric_embedding", "abduction", "action"])
    model = get_peft_model(base, lora)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("action" in n and "cls_head" in n for n in trainable)
    ids, values = batch()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        out = model(input_ids=ids, numeric_values=values, labels=ids)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids, numeric_values=values)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(CausalQwenForCausalLM.from_pretrained(path), tmp_path / "adapter").eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids, numeric_values=values)
    for name in ("loc_S", "scale_S", "loc_Y", "scale_Y"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=0, atol=1e-6)
    merged = reloaded.merge_and_unload()
    assert isinstance(merged, CausalQwenForCausalLM)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids, numeric_values=values).loc_S, expected.loc_S, rtol=1e-5, atol=1e-5)


def test_bf16_forward_finite_and_close_to_fp32(saved):
    _, path = saved
    fp32 = CausalQwenForCausalLM.from_pretrained(path, dtype=torch.float32)
    bf16 = CausalQwenForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    ids, values = batch()
    out32 = fp32(ids, numeric_values=values, labels=ids)
    out16 = bf16(ids, numeric_values=values, labels=ids)
    for name in ("loc_S", "scale_S", "loc_Y", "scale_Y", "loc_U", "scale_U"):
        got, want = getattr(out16, name).float(), getattr(out32, name)
        assert torch.isfinite(got).all(), name
        assert (got - want).abs().max() <= 0.05 * want.abs().max() + 1e-3, name
    assert out16.loss.dtype == torch.float32 and torch.isfinite(out16.loss)
    assert out16.loss.item() == pytest.approx(out32.loss.item(), rel=0.05)
    out16.loss.backward()
    assert torch.isfinite(bf16.action.cls_head.weight.grad.float()).all()


@pytest.mark.parametrize("freeze", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(saved, freeze):
    _, path = saved
    grads = []
    for checkpointing in (False, True):
        model = CausalQwenForCausalLM.from_pretrained(path, freeze_backbone=freeze).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        ids, values = batch()
        model(ids, numeric_values=values, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "numeric_embedding.w_num" in grads[0]
    assert ("model.layers.0.mlp.up_proj.weight" in grads[0]) == (not freeze)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_device_map_auto_loads(saved):
    model, path = saved
    loaded = CausalQwenForCausalLM.from_pretrained(path, device_map="auto", dtype=torch.float32)
    assert loaded.device.type == "cpu"
    assert not loaded.model.embed_tokens.weight.requires_grad  # loading keeps the backbone frozen
    ids, values = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, numeric_values=values).loc_S, model(ids, numeric_values=values).loc_S)
