"""Serving throughput on vLLM: CausalQwen against its Qwen2.5-0.5B, and against the library's own `generate`.

One run measures, on the same batch of prompts (greedy, exactly `--new-tokens` new tokens each, `--batch` prompts):
vLLM serving the real Qwen2.5-0.5B, vLLM serving that model converted to CausalQwen (`from_qwen` with its defaults,
the context-value path on; saved with its tokenizer), and the library's `generate(mode="traditional")` on the
converted model with the same batch (left padded). Each vLLM engine runs in its own process; the first request batch
warms it up and is not timed. Then the same prompts as `--batch` concurrent completions over HTTP on loopback, to
vLLM's OpenAI-compatible server on Qwen2.5-0.5B and to the package's server on the converted model, which writes the
numbers into the text (`causal_qwen.integrations.vllm_server`). It prints generated tokens per second and the three
ratios (bars: ≥ 0.85 against vLLM's Qwen2, offline and served; ≥ 3 against `generate`). `--causal DIR` serves a
given CausalQwen folder (a trained one, which writes numbers), `--prompts numbers` asks for continuations that hold
numbers, `--served-only` times the two servers alone.

Run it in the vllm environment (docs/serving.md):

    venv-vllm/bin/python benchmarks/bench_vllm.py                 # the real Qwen2.5-0.5B, batch 16
    venv-vllm/bin/python benchmarks/bench_vllm.py --new-tokens 16 # quicker
    venv-vllm/bin/python benchmarks/bench_vllm.py --vllm-cores all  # vLLM's compute on every core

On CPU, vLLM binds its compute threads to all cores but one, which it keeps for its scheduler and front end
(`VLLM_CPU_OMP_THREADS_BIND=auto`, its default), while the library's `generate` uses every core. `--vllm-cores all`
binds vLLM's compute to every core (`VLLM_CPU_OMP_THREADS_BIND=0-N`), as the library's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is", "Write a short poem about the sea:", "Q: Why is the sky blue? A:",
    "Once upon a time, in a small village,", "The three primary colours are", "Explain recursion to a child:",
    "def fibonacci(n):", "My favourite book is", "The weather today is", "Translate to French: good morning",
    "List some fruits:", "The history of Rome begins", "A recipe for pancakes:", "The meaning of life is",
    "Dear hiring manager,", "In computer science, a hash table",
]
# Prompts whose continuations hold numbers, so that a trained CausalQwen writes `<NUM>` (`--prompts numbers`).
NUMBER_PROMPTS = [
    "A kilo of apples costs 3.5 dollars, so 4 kilos cost", "The train covered 120 km in 1.5 hours, an average of",
    "In 2019 the town had 12,400 people; by 2023 it had", "The recipe needs 250 g of flour for 4 people, so for 6",
    "A car of 2300 pounds and 78 horsepower gets", "The temperature rose from 12.5 to", "Price: 99.9, discount 15%, "
    "you pay", "The room is 4.2 m by 3.5 m, an area of",
]
QWEN25_DIR = Path(os.environ.get("CAUSAL_QWEN_QWEN25_DIR", Path.home() / ".cache" / "causal_qwen" / "qwen2.5-0.5b"))


SERVERS = {"vllm-server": "vllm.entrypoints.openai.api_server",
           "numbers-server": "causal_qwen.integrations.vllm_server"}


def prompts(batch: int) -> list[str]:
    chosen = NUMBER_PROMPTS if os.environ.get("BENCH_VLLM_PROMPTS") == "numbers" else PROMPTS
    return [chosen[i % len(chosen)] for i in range(batch)]


def vllm_rate(model_dir: str, batch: int, new_tokens: int, dtype: str) -> float:
    """Generated tokens per second of a vLLM engine on `model_dir` (run in a process of its own)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, max_model_len=512, max_num_seqs=batch, seed=0,
              kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    texts = prompts(batch)
    llm.generate(texts, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def library_rate(model_dir: str, batch: int, new_tokens: int, dtype: str) -> float:
    """Generated tokens per second of the library's `generate` on the same batch."""
    import torch

    from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer

    tokenizer = CausalQwenTokenizer.from_pretrained(model_dir, padding_side="left")
    model = CausalQwenForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    batch_inputs = tokenizer(prompts(batch), return_tensors="pt", padding=True)
    kwargs = dict(mode="traditional", do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    model.generate(**batch_inputs, mode="traditional", do_sample=False, max_new_tokens=2)  # warm-up
    start = time.perf_counter()
    out = model.generate(**batch_inputs, **kwargs)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - batch_inputs["input_ids"].shape[1]) * batch / elapsed


def served_rate(module: str, model_dir: str, batch: int, new_tokens: int, dtype: str) -> float:
    """Generated tokens per second of an OpenAI-compatible server on loopback (vLLM's own, or the package's, which
    writes the numbers into the text), answering `batch` concurrent completions; one warm-up round is not timed."""
    import socket
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", module, "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--max-model-len", "512", "--max-num-seqs", str(batch), "--seed", "0",
               "--kv-cache-memory-bytes", "1G", "--served-model-name", "served"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    written: list[int] = []

    def complete(prompt: str) -> int:
        body = {"model": "served", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.load(response)
        written.append(len(answer["choices"][0].get("numbers", [])))
        return answer["usage"]["completion_tokens"]

    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"{module} exited with {server.returncode} before it answered")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{module} did not answer /health within 600 s") from None
                time.sleep(2)
        with ThreadPoolExecutor(batch) as pool:
            list(pool.map(complete, prompts(batch)))  # warm-up
            written.clear()  # the timed round's
            start = time.perf_counter()
            tokens = sum(pool.map(complete, prompts(batch)))
            elapsed = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=120)
    print(f"{module}: {sum(written)} numbers written in {tokens} tokens", file=sys.stderr)
    return tokens / elapsed


def convert(target: str, dtype: str) -> None:
    import torch

    from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer

    tokenizer = CausalQwenTokenizer.from_pretrained(QWEN25_DIR)
    model = CausalQwenForCausalLM.from_qwen(QWEN25_DIR, tokenizer=tokenizer, dtype=getattr(torch, dtype))
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def vllm_environment(cores: str) -> dict[str, str]:
    """The environment of a vLLM child: vLLM's own CPU binding, or its compute bound to every core."""
    env = dict(os.environ)
    if cores == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
    return env


def run_child(*args: str, env: dict[str, str] | None = None) -> float:
    """One measurement in a fresh process, so that each engine has the machine to itself."""
    result = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True,
                            env=env)
    sys.stderr.write("".join(line + "\n" for line in result.stderr.splitlines() if "numbers written" in line))
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"rate"')]
    return json.loads(lines[-1])["rate"]


def _print_served(qwen_served: float, causal_served: float) -> None:
    print(f"  served: vLLM's server, Qwen2.5-0.5B              {qwen_served:9.1f}")
    print(f"  served: the package's server, numbers written    {causal_served:9.1f}")
    print(f"ratio served with the numbers written / Qwen2.5 on vLLM's server: {causal_served / qwen_served:.2f} "
          "(bar 0.85)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--vllm-cores", default="reserved", choices=["reserved", "all"],
                        help="vLLM's default CPU binding (one core kept for its front end), or every core")
    parser.add_argument("--causal", help="a CausalQwen folder to serve (e.g. a trained one) instead of a fresh "
                                         "conversion of Qwen2.5-0.5B")
    parser.add_argument("--prompts", default="text", choices=["text", "numbers"],
                        help="the prompts: plain text, or texts whose continuations hold numbers")
    parser.add_argument("--served-only", action="store_true", help="time the two servers only")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["BENCH_VLLM_PROMPTS"] = args.prompts  # the children read it
    if args.child:
        kind, model_dir = args.child
        if kind in SERVERS:
            rate = served_rate(SERVERS[kind], model_dir, args.batch, args.new_tokens, args.dtype)
        else:
            rate = (vllm_rate if kind == "vllm" else library_rate)(model_dir, args.batch, args.new_tokens,
                                                                   args.dtype)
        print(json.dumps({"rate": rate}))
        return
    common = ["--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as converted:
        if args.causal:
            converted = args.causal
        else:
            convert(converted, args.dtype)
        env = vllm_environment(args.vllm_cores)
        if not args.served_only:
            qwen = run_child("vllm", str(QWEN25_DIR), *common, env=env)
            causal = run_child("vllm", converted, *common, env=env)
            library = run_child("library", converted, *common)
        qwen_served = run_child("vllm-server", str(QWEN25_DIR), *common, env=env)
        causal_served = run_child("numbers-server", converted, *common, env=env)
    print(f"batch {args.batch}, {args.new_tokens} new tokens, {args.dtype}, {os.cpu_count()} CPUs, vLLM cores "
          f"{args.vllm_cores}, {args.prompts} prompts, generated tokens/s:")
    if args.served_only:
        _print_served(qwen_served, causal_served)
        return
    print(f"  vLLM, Qwen2.5-0.5B           {qwen:9.1f}")
    print(f"  vLLM, CausalQwen (converted) {causal:9.1f}")
    print(f"  library generate, CausalQwen {library:9.1f}")
    print(f"ratio CausalQwen on vLLM / Qwen2.5 on vLLM: {causal / qwen:.2f} (bar 0.85)")
    _print_served(qwen_served, causal_served)
    print(f"ratio CausalQwen on vLLM / library generate: {causal / library:.2f} (bar 3)")


if __name__ == "__main__":
    main()
