"""The lm-evaluation-harness model `causal-qwen` against stock HFLM (skipped where lm_eval is not installed)."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import tiny_qwen2_config
from transformers import AutoTokenizer, Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer
from causal_qwen.cauchy import symlog

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from causal_qwen.integrations.lm_eval import CausalQwenLM, number_resolution  # noqa: E402

TEXT = [("The capital of France is", " Paris"), ("Hello, my name is", " John and I like cats."),
        ("Colourless green ideas", " sleep furiously")]
NUMBERS = [("2 + 3 =", " 5"), ("2 + 3 =", " 6"), ("2 + 4 =", " 5"), ("She bought 12 apples for", " 3.5 dollars")]
ROLLING = ["Plain text without any digits at all.", "In 1969, 3 astronauts flew 384,400 km to the Moon."]


def loglikelihood(lm, pairs):
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    return lm.loglikelihood(requests, disable_tqdm=True)


def rolling(lm, texts):
    requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i)
                for i, t in enumerate(texts)]
    return lm.loglikelihood_rolling(requests, disable_tqdm=True)


def generate(lm, prompts, max_gen_toks=4, until=("\n",)):
    requests = [Instance(request_type="generate_until", doc={},
                         arguments=(p, {"until": list(until), "max_gen_toks": max_gen_toks}), idx=i)
                for i, p in enumerate(prompts)]
    return lm.generate_until(requests, disable_tqdm=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, qwen25_dir):
    """A tiny random Qwen2 with the real tokenizer (plain folder) and its CausalQwen conversion (with its tokenizer)."""
    root = tmp_path_factory.mktemp("lm_eval")
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=151936)).eval()
    qwen.save_pretrained(root / "qwen")
    AutoTokenizer.from_pretrained(qwen25_dir).save_pretrained(root / "qwen")
    tokenizer = CausalQwenTokenizer.from_pretrained(qwen25_dir)
    model = CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer)
    model.save_pretrained(root / "cq")
    tokenizer.save_pretrained(root / "cq")
    return root


@pytest.fixture(scope="module")
def stock(folders):
    return HFLM(pretrained=str(folders / "qwen"), device="cpu", dtype="float32", batch_size=2)


@pytest.fixture(scope="module")
def ours(folders):
    return CausalQwenLM(pretrained=str(folders / "cq"), device="cpu", dtype="float32", batch_size=2)


def test_number_resolution():
    assert number_resolution("5") == 1 and number_resolution("-12") == 1
    assert number_resolution("3.14") == pytest.approx(0.01) and number_resolution("1,234.5") == pytest.approx(0.1)
    assert number_resolution("2e3") == 1000 and number_resolution("2.5e3") == 100
    assert number_resolution("1e-5") == pytest.approx(1e-5) and number_resolution("３.５") == pytest.approx(0.1)


@pytest.mark.slow
def test_text_scores_as_stock_hflm(stock, ours):
    expected, got = loglikelihood(stock, TEXT), loglikelihood(ours, TEXT)
    for (e, e_greedy), (g, g_greedy) in zip(expected, got, strict=True):
        assert g == pytest.approx(e, abs=1e-4)
        assert g_greedy == e_greedy
    assert rolling(ours, ROLLING[:1])[0] == pytest.approx(rolling(stock, ROLLING[:1])[0], abs=1e-4)


@pytest.mark.slow
def test_numbers_reach_the_model_and_are_scored_as_values(folders, ours):
    scores = [s for s, _ in loglikelihood(ours, NUMBERS)]
    assert all(math.isfinite(s) and s < 0 for s in scores)
    assert scores[0] != scores[1]  # the continuation's value is scored
    assert scores[0] != scores[2]  # the context's value reached the model
    # By hand: log P(" ") + log P(<NUM>) + log P(Y in [4.5, 5.5]) under the value head.
    model, tokenizer = ours.model, ours.tokenizer
    batch = tokenizer("2 + 3 = 5", return_tensors="pt")
    ids, values = batch["input_ids"], batch["numeric_values"]
    context_length = len(tokenizer("2 + 3 =")["input_ids"])
    with torch.no_grad():
        out = model(ids, numeric_values=values)
    log_probs = torch.log_softmax(out.logits[0].double(), -1)
    token_part = sum(log_probs[p - 1, ids[0, p]].item() for p in range(context_length, ids.shape[1]))
    loc, scale = out.loc_Y[0, -2].double(), out.scale_Y[0, -2].double()
    upper = torch.atan((symlog(torch.tensor(5.5, dtype=torch.float64)) - loc) / scale)
    lower = torch.atan((symlog(torch.tensor(4.5, dtype=torch.float64)) - loc) / scale)
    assert scores[0] == pytest.approx(token_part + math.log((upper - lower).item() / math.pi), abs=1e-4)
    # Batched, rolling and alone agree.
    alone = loglikelihood(ours, NUMBERS[:1])[0][0]
    assert alone == pytest.approx(scores[0], abs=1e-4)
    assert all(math.isfinite(s) for s in rolling(ours, ROLLING))


@pytest.mark.slow
def test_a_value_head_that_knows_the_answer_prefers_it(folders):
    lm = CausalQwenLM(pretrained=str(folders / "cq"), device="cpu", dtype="float32", batch_size=3)
    with torch.no_grad():  # Y ~ Cauchy(symlog(5), ~0.01) everywhere
        lm.model.action.reg_head.weight.zero_()
        lm.model.action.reg_head.bias.fill_(math.log(6.0))
        lm.model.action.reg_log_noise.fill_(math.log(0.01))
    five, six, fifty, five_point_zero = (s for s, _ in loglikelihood(
        lm, [("2 + 3 =", " 5"), ("2 + 3 =", " 6"), ("2 + 3 =", " 50"), ("2 + 3 =", " 5.0")]))
    assert five > six + 3 and five > fifty + 3
    assert five > five_point_zero  # a finer written precision is a smaller interval


@pytest.mark.slow
def test_generated_numbers_are_written_with_their_values(folders, ours):
    prompts = ["价格是99.9元, and 12 apples cost", "Hello"]
    lm = CausalQwenLM(pretrained=str(folders / "cq"), device="cpu", dtype="float32", batch_size=2)
    with torch.no_grad():  # every next token is <NUM>
        lm.model.action.threshold[lm.tokenizer.num_token_id] = -1e4
        lm.model.action.reg_head.bias.fill_(3.0)
    texts = generate(lm, prompts, max_gen_toks=3)
    tokenizer = lm.tokenizer
    # lm-eval generates the two in one batch, the longer first, padded on the left: the same computation gives the
    # same text to every digit. Each value is float32 arithmetic, which a batch of another shape may round otherwise
    # in its last bit (19.013065 and 19.013062 on some CPUs), so the prompts alone agree in tokens and to 1e-6.
    batch = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    assert batch["input_ids"][0, 0] != tokenizer.pad_token_id  # the first prompt is the longer
    out = lm.model.generate(**batch, max_new_tokens=3, return_dict_in_generate=True)
    start = batch["input_ids"].shape[1]
    for row, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        ids, values = out.sequences[row, start:], out.numeric_values[row, start:]
        assert text == tokenizer.decode(ids, numeric_values=values)
        assert "<NUM>" not in text and any(c.isdigit() for c in text)
        single = tokenizer(prompt, return_tensors="pt")
        alone = lm.model.generate(**single, max_new_tokens=3, return_dict_in_generate=True)
        length = single["input_ids"].shape[1]
        assert torch.equal(alone.sequences[0, length:], ids)
        torch.testing.assert_close(alone.numeric_values[0, length:], values, rtol=1e-6, atol=0)
    # Text generation in traditional mode equals stock HFLM's greedy generation.
    traditional = CausalQwenLM(pretrained=str(folders / "cq"), device="cpu", dtype="float32", mode="traditional")
    stock = HFLM(pretrained=str(folders / "qwen"), device="cpu", dtype="float32")
    assert generate(traditional, ["Hello, my name is"], 6) == generate(stock, ["Hello, my name is"], 6)


@pytest.mark.slow
def test_plain_hflm_on_a_causal_qwen_folder_is_exact_or_refuses(folders, stock):
    plain = HFLM(pretrained=str(folders / "cq"), device="cpu", dtype="float32", batch_size=2)
    for (e, _), (g, _) in zip(loglikelihood(stock, TEXT), loglikelihood(plain, TEXT), strict=True):
        assert g == pytest.approx(e, abs=1e-4)
    with pytest.raises(ValueError, match="numeric_values"):
        loglikelihood(plain, NUMBERS[:1])
    with pytest.raises(ValueError, match="numeric_values"):
        generate(plain, ["2 + 3 ="])


@pytest.mark.slow
def test_a_tokenizer_that_disagrees_with_the_config_is_refused(folders, tmp_path):
    import shutil

    shutil.copytree(folders / "cq", tmp_path / "cq")
    config = json.loads((tmp_path / "cq" / "config.json").read_text())
    (tmp_path / "cq" / "config.json").write_text(json.dumps(config | {"num_token_id": 151700}))
    with pytest.raises(ValueError, match="151665.*151700"):
        CausalQwenLM(pretrained=str(tmp_path / "cq"), device="cpu", dtype="float32")


SUMS = [(2, 3), (1, 1), (4, 4)]


def _write_task(folder):
    rows = [{"question": f"{a} + {b} =", "answer": str(a + b)} for a, b in SUMS]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tiny_sums.yaml").write_text(
        "task: tiny_sums\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
        "output_type: loglikelihood\n"
        "test_split: test\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_target: ' {{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )


def _answering_five(folders, folder):
    """The tiny model, saved in `folder`, whose greedy continuation of "... =" is " 5" (" ", then `<NUM>` of 5)."""
    model = CausalQwenForCausalLM.from_pretrained(folders / "cq", dtype=torch.float32)
    tokenizer = CausalQwenTokenizer.from_pretrained(folders / "cq")
    equals, space = tokenizer(" =")["input_ids"][-1], tokenizer(" ")["input_ids"][-1]
    with torch.no_grad():
        # Layers that add nothing: the features z are the normalised embedding of the token itself, and loc_U = z.
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.abduction.loc_net.weight.copy_(torch.eye(model.config.hidden_size))
        model.abduction.loc_net.bias.zero_()
        # RMSNorm gives every z the norm √H, so a row 1e3·z/|z|² scores 1e3 at its own token and less at any other
        # (Cauchy-Schwarz), where every other row scores 0: after " =" the greedy token is " ", after " " <NUM>.
        z = model.model.norm(model.model.embed_tokens.weight[[equals, space]])
        model.action.cls_head.weight.zero_()
        model.action.cls_head.bias.zero_()
        model.action.cls_head.weight[[space, model.config.num_token_id]] = 1e3 * z / z.square().sum(-1, keepdim=True)
        model.action.reg_head.weight.zero_()
        model.action.reg_head.bias.fill_(math.log(6.0))  # symlog(5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_simple_evaluate_and_the_command_line_on_a_local_task(folders, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_task(tmp_path)
    model = _answering_five(folders, tmp_path / "five")
    # acc of a loglikelihood task: the share of answers that are the greedy continuation, here " 5" alone (<NUM>
    # with a median of 5 within the written precision ±0.5).
    expected = sum(a + b == 5 for a, b in SUMS) / len(SUMS)
    assert expected == 1 / 3
    results = lm_eval.simple_evaluate(
        model="causal-qwen", model_args=f"pretrained={model},device=cpu,dtype=float32",
        tasks=["tiny_sums"], task_manager=TaskManager(include_path=str(tmp_path)), batch_size=2,
    )
    assert results["results"]["tiny_sums"]["acc,none"] == pytest.approx(expected)
    assert [sample["acc"] for sample in results["samples"]["tiny_sums"]] == [int(a + b == 5) for a, b in SUMS]
    command = [sys.executable, "-m", "causal_qwen.integrations.lm_eval", "run", "--model", "causal-qwen",
               "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu", "--tasks", "tiny_sums",
               "--include_path", str(tmp_path), "--batch_size", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"tiny_sums.*\|acc\s*\|[^|]*\|0\.3333\|", done.stdout), done.stdout


@pytest.mark.slow
def test_real_qwen25(qwen25_dir, tmp_path):
    """Qwen2.5-0.5B converted by from_qwen: text scores as Qwen's, numbers reach the model, plain HFLM refuses."""
    tokenizer = CausalQwenTokenizer.from_pretrained(qwen25_dir)
    model = CausalQwenForCausalLM.from_qwen(qwen25_dir, tokenizer=tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    qwen = HFLM(pretrained=str(qwen25_dir), device="cpu", dtype="float32", batch_size=4)
    ours = CausalQwenLM(pretrained=str(tmp_path), device="cpu", dtype="float32", batch_size=4)
    for (e, e_greedy), (g, g_greedy) in zip(loglikelihood(qwen, TEXT), loglikelihood(ours, TEXT), strict=True):
        assert g == pytest.approx(e, abs=2e-3)
        assert g_greedy == e_greedy
    assert rolling(ours, ROLLING[:1])[0] == pytest.approx(rolling(qwen, ROLLING[:1])[0], abs=5e-3)
    scores = [s for s, _ in loglikelihood(ours, NUMBERS)]
    assert all(math.isfinite(s) and s < 0 for s in scores)
    assert len(set(scores)) == len(scores)
    plain = HFLM(pretrained=str(tmp_path), device="cpu", dtype="float32", batch_size=4)
    with pytest.raises(ValueError, match="numeric_values"):
        loglikelihood(plain, NUMBERS[:1])


@pytest.mark.slow
def test_a_task_that_samples_runs_in_traditional_mode(ours):
    """Without a named mode, a task's do_sample selects traditional mode, as in `generate`."""
    prompt, options = "She bought 12 apples for", {"until": ["\n"], "max_gen_toks": 4, "do_sample": True,
                                                  "temperature": 0.7}
    requests = [Instance(request_type="generate_until", doc={}, arguments=(prompt, options), idx=0)]
    torch.manual_seed(0)
    answer = ours.generate_until(requests, disable_tqdm=True)[0]
    # The same draw, made by `generate` itself in traditional mode. Without do_sample the call is greedy, in the
    # standard mode by default, and `generate` refuses do_sample in any mode but traditional: each differs or fails.
    batch = ours.tokenizer(prompt, return_tensors="pt")

    def continuation(**kwargs) -> str:
        torch.manual_seed(0)
        out = ours.model.generate(**batch, max_new_tokens=4, return_dict_in_generate=True, **kwargs)
        start = batch["input_ids"].shape[1]
        text = ours.tokenizer.decode(out.sequences[0, start:], numeric_values=out.numeric_values[0, start:])
        return text.split("\n")[0]

    sampled = continuation(mode="traditional", do_sample=True, temperature=0.7)
    assert answer == sampled
    assert sampled != continuation(mode="traditional", do_sample=False)
    assert sampled != continuation()
