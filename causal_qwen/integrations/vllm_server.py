"""An OpenAI-compatible server for CausalQwen on vLLM whose responses carry the numbers the model writes.

vLLM's own server runs its engine in another process, and vLLM's outputs have no per-token field a model can fill, so
the value of a written `<NUM>` cannot reach its responses (docs/serving.md). This server runs vLLM's `LLMEngine` in
its own process, where the plugin keeps each request's numbers ([`generated_numbers`]), and answers vLLM's
`/v1/completions` and `/v1/chat/completions` with their request fields and response shapes, plus:

- the text holds each written number as digits, rounded to the digits its 50% interval supports, as the text of the
  library's `generate` (`causal-qwen generate`, the pipeline) writes it;
- each choice has `numbers`: per written number its character span in the text (`start`, `end`), its `value` (the
  median fed back to the model) and its 50% and 90% intervals; a streamed chunk carries the numbers its text adds;
- a text prompt or chat messages with numbers are read by the CausalQwen tokenizer, with their values.

    python -m causal_qwen.integrations.vllm_server --model causal-qwen-dir --dtype float32 \\
        --kv-cache-memory-bytes 1G --port 8000

It takes vLLM's engine options (`--dtype`, `--max-model-len`, `--kv-cache-memory-bytes`, ...) and `--host`,
`--port`, `--served-model-name`. One engine step serves every running request (vLLM's continuous batching); `n > 1`
runs as n requests, each with its numbers.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (`Request`) at run time.
import argparse
import asyncio
import functools
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# The engine must run in this process for the plugin's numbers to be read here.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from .vllm import KEY_ARG, MODE_ARG, VALUES_ARG, GeneratedNumber, generated_numbers  # noqa: E402

_LOG = logging.getLogger(__name__)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "response_format")


class RequestError(ValueError):
    """A request the server refuses, answered with an HTTP status (400 unless said)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineFailed(RuntimeError):
    """The engine stopped with an error: the request is answered with a 500."""


@dataclass
class Progress:
    """What one engine step left of a request: its generated ids, its numbers so far, and how it ended."""

    token_ids: list[int]
    numbers: list[GeneratedNumber]
    finish_reason: str | None
    finished: bool


class EngineLoop:
    """vLLM's `LLMEngine`, stepped in a thread of its own; requests come in from the event loop and their progress
    goes back to it, one `Progress` per step, on an `asyncio.Queue` per request."""

    def __init__(self, engine, num_token_id: int):
        self.engine = engine
        self.num_token_id = num_token_id
        self._incoming: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]] = {}
        self._numbers: dict[str, list[GeneratedNumber]] = {}  # per request, its numbers as last read
        self._closed = threading.Event()
        self.failed: Exception | None = None  # the error that stopped the engine
        self._thread = threading.Thread(target=self._run, name="causal-qwen-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: dict, params) -> tuple[str, asyncio.Queue]:
        """Queue one request; its `Progress` (or the exception that refused or ended it) arrives on the returned
        queue."""
        request_id = uuid.uuid4().hex
        sink: asyncio.Queue = asyncio.Queue()
        if self.failed is not None:
            sink.put_nowait(EngineFailed(f"the engine failed earlier: {self.failed}"))
            return request_id, sink
        self._incoming.put(("add", request_id, prompt, params, asyncio.get_running_loop(), sink))
        return request_id, sink

    def abort(self, request_id: str) -> None:
        self._incoming.put(("abort", request_id))

    def close(self) -> None:
        self._closed.set()
        self._incoming.put(("close",))
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._closed.is_set():
            # Block for work when the engine is idle; otherwise take what came in and step.
            self._take(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # noqa: BLE001 - every waiting request is told, then the server stops serving
                _LOG.exception("the engine failed; the running requests end with its error")
                self.failed = error  # first: a handler told of the error reads it to answer with a 500
                for loop, sink, _ in self._sinks.values():
                    loop.call_soon_threadsafe(sink.put_nowait, error)
                self._sinks.clear()
                self._numbers.clear()
                return
            for output in outputs:
                self._send(output)

    def _take(self, block: bool) -> None:
        while True:
            try:
                item = self._incoming.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item[0] == "add":
                _, request_id, prompt, params, loop, sink = item
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as error:  # noqa: BLE001 - the handler answers it
                    loop.call_soon_threadsafe(sink.put_nowait, error)
                    continue
                self._sinks[request_id] = (loop, sink, params)
            elif item[0] == "abort" and item[1] in self._sinks:
                self._forget(item[1])
                self.engine.abort_request([item[1]])

    def _send(self, output) -> None:
        held = self._sinks.get(output.request_id)
        if held is None:
            return
        loop, sink, params = held
        request_id, completion = output.request_id, output.outputs[0]
        token_ids = list(completion.token_ids)
        numbers = self._numbers.get(request_id, [])
        try:
            # Read here, in the engine's thread, where the plugin fills them; again only when a step wrote a number
            # (a written number's value and intervals never change).
            if token_ids.count(self.num_token_id) != len(numbers):
                numbers = self._numbers[request_id] = generated_numbers(params)
        except (KeyError, ValueError, RuntimeError) as error:  # this request's numbers are lost: it ends with a 500
            self._forget(request_id)
            if not output.finished:
                self.engine.abort_request([request_id])
            loop.call_soon_threadsafe(sink.put_nowait, EngineFailed(f"the request's numbers cannot be read: {error}"))
            return
        progress = Progress(token_ids, numbers, completion.finish_reason, output.finished)
        loop.call_soon_threadsafe(sink.put_nowait, progress)
        if output.finished:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._numbers.pop(request_id, None)


class Renderer:
    """The text of generated ids with their numbers written, and the numbers' spans in it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.num_token_id = tokenizer.num_token_id

    def text(self, token_ids: list[int], numbers: list[GeneratedNumber]) -> tuple[str, list[dict]]:
        """The text of `token_ids` with `numbers` written, as `tokenizer.decode` writes it with their values, and per
        number its span and distribution. One pass: the tokenizer decodes the runs between numbers apart, so the text
        is the runs' texts and the numbers' digits end to end."""
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        pieces, spans, length, after = [], [], 0, 0
        for number in numbers:
            run = decode(token_ids[after:number.index])
            digits = decode([self.num_token_id], numeric_values=[number.written])
            start, length = length + len(run), length + len(run) + len(digits)
            pieces += [run, digits]
            after = number.index + 1
            spans.append({"start": start, "end": length, "text": digits, "value": number.value,
                          "lower_50": number.lower_50, "upper_50": number.upper_50, "lower_90": number.lower,
                          "upper_90": number.upper})
        pieces.append(decode(token_ids[after:]))
        return "".join(pieces), spans

    def prompt(self, body: dict, chat: bool) -> list[tuple[list[int], list[float]]]:
        """The prompts of a request as ids and values: chat messages through the chat template, text through the
        tokenizer (its numbers read with their values), ids with `vllm_xargs.numeric_values` (as vLLM takes them)."""
        xargs = body.get("vllm_xargs") or {}
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("messages must be a non-empty list")
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return [self._read(text, xargs)]
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [self._read(prompt, xargs)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            return [self._ids(prompt, xargs.get(VALUES_ARG))]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self._read(p, xargs) for p in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            values = xargs.get(VALUES_ARG)
            if values is not None and (not isinstance(values, list) or len(values) != len(prompt)):
                raise RequestError("vllm_xargs.numeric_values must hold one list of values per prompt")
            return [self._ids(p, None if values is None else values[i]) for i, p in enumerate(prompt)]
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of them")

    def _read(self, text: str, xargs: dict) -> tuple[list[int], list[float]]:
        if VALUES_ARG in xargs:
            raise RequestError("vllm_xargs.numeric_values go with token ids; a text prompt's numbers are read from it")
        encoded = self.tokenizer(text)
        return list(encoded["input_ids"]), [float(v) for v in encoded["numeric_values"]]

    def _ids(self, ids: list, values) -> tuple[list[int], list[float] | None]:
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestError("a prompt of token ids must hold integers only")
        if values is not None and (not isinstance(values, list) or len(values) != len(ids)):
            raise RequestError("vllm_xargs.numeric_values must hold one value per prompt id")
        return list(ids), values


def sampling_params(body: dict, values: list[float] | None, chat: bool, choice: int):
    """vLLM's `SamplingParams` of one choice of a request, with its numbers' key; `choice` offsets a given seed, so
    that the n choices of a sampled request differ."""
    from vllm import SamplingParams

    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise RequestError(f"{name} is not supported by this server")
    # OpenAI's completions default 16 tokens; a chat runs to its end or the context's (`max_completion_tokens` is the
    # chat's newer name of `max_tokens`).
    max_tokens = body.get("max_tokens", None if chat else 16)
    if chat:
        max_tokens = body.get("max_completion_tokens", max_tokens)
    fields = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    fields.setdefault("temperature", 1.0)
    if "seed" in fields:
        fields["seed"] = int(fields["seed"]) + choice
    extra = {key: value for key, value in (body.get("vllm_xargs") or {}).items() if key != VALUES_ARG}
    unknown = set(extra) - {MODE_ARG}
    if unknown:
        raise RequestError(f"vllm_xargs takes {VALUES_ARG!r} and {MODE_ARG!r}, got {sorted(unknown)}")
    if values is not None:
        extra[VALUES_ARG] = [float(v) for v in values]
    extra[KEY_ARG] = uuid.uuid4().hex
    try:
        return SamplingParams(max_tokens=max_tokens, extra_args=extra, **fields)
    except (TypeError, ValueError) as error:
        raise RequestError(str(error)) from error


def build_app(engine_loop: EngineLoop, tokenizer, model_name: str):
    """The FastAPI application: `/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    renderer = Renderer(tokenizer)

    def error(message: str, status: int) -> JSONResponse:
        kind = {404: "NotFoundError", 500: "InternalServerError"}.get(status, "BadRequestError")
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "causal_qwen"}]}

    async def answer(request: Request, chat: bool):
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error("the body is not JSON", 400)
        if body.get("model") not in (None, model_name):
            return error(f"The model `{body.get('model')}` does not exist.", 404)
        try:
            prompts = renderer.prompt(body, chat)
            n = body.get("n", 1)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise RequestError(f"n must be a positive integer, got {n!r}")
            runs = [(ids, sampling_params(body, values, chat, choice)) for ids, values in prompts
                    for choice in range(n)]
        except RequestError as refused:
            return error(str(refused), refused.status)
        call = Call(engine_loop, renderer, model_name, chat, runs)
        try:
            if body.get("stream"):
                first = await call.start()
                if first is not None:
                    return error(first, 400)
                return StreamingResponse(call.events(), media_type="text/event-stream")
            return JSONResponse(await call.whole())
        except RequestError as refused:
            return error(str(refused), refused.status)
        except EngineFailed as failed:
            return error(str(failed), 500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    return app


class Call:
    """One HTTP request: its choices run as engine requests, answered whole or streamed."""

    def __init__(self, engine_loop: EngineLoop, renderer: Renderer, model_name: str, chat: bool, runs: list):
        self.engine_loop, self.renderer, self.model_name, self.chat, self.runs = (
            engine_loop, renderer, model_name, chat, runs)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.sinks: list[tuple[str, asyncio.Queue]] = []
        self.first: list[Progress | None] = []

    async def start(self) -> str | None:
        """Submit every choice and wait for each one's first answer; the message of a refusal, or None."""
        from vllm import TokensPrompt

        for ids, params in self.runs:
            self.sinks.append(self.engine_loop.submit(TokensPrompt(prompt_token_ids=ids), params))
        refusal = None
        for _, sink in self.sinks:
            item = await sink.get()
            if isinstance(item, EngineFailed):
                self.abort()
                raise item
            if isinstance(item, Exception) and self.engine_loop.failed is not None:
                self.abort()
                raise EngineFailed(f"the engine failed: {item}") from item
            if isinstance(item, Exception):
                refusal = refusal or str(item)
                item = None
            self.first.append(item)
        if refusal is not None:
            self.abort()
        return refusal

    def abort(self) -> None:
        for request_id, _ in self.sinks:
            self.engine_loop.abort(request_id)

    async def whole(self) -> dict:
        refusal = await self.start()
        if refusal is not None:
            raise RequestError(refusal)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index, ((ids, _), (_, sink), progress) in enumerate(zip(self.runs, self.sinks, self.first, strict=True)):
            while not progress.finished:
                progress = _progress(await sink.get())
            text, numbers = self.renderer.text(progress.token_ids, progress.numbers)
            choices.append(self._choice(index, text, numbers, progress))
            prompt_tokens += len(ids)
            completion_tokens += len(progress.token_ids)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: per engine step and choice, the text it adds and the numbers in it; then `[DONE]`."""
        merged: asyncio.Queue = asyncio.Queue()
        sent = [""] * len(self.sinks)
        told = [0] * len(self.sinks)

        async def follow(index: int, sink: asyncio.Queue, progress: Progress) -> None:
            await merged.put((index, progress))
            while not progress.finished:
                try:
                    progress = _progress(await sink.get())
                except EngineFailed as failed:
                    await merged.put((index, failed))
                    return
                await merged.put((index, progress))

        tasks = [asyncio.create_task(follow(i, sink, first))
                 for i, ((_, sink), first) in enumerate(zip(self.sinks, self.first, strict=True))]
        if self.chat:
            for index in range(len(self.sinks)):
                yield self._event(index, {"role": "assistant", "content": ""}, [], None)
        try:
            done = 0
            while done < len(tasks):
                index, progress = await merged.get()
                if isinstance(progress, EngineFailed):  # the stream ends with the error, as vLLM's server ends it
                    yield f"data: {json.dumps({'error': {'message': str(progress), 'code': 500}})}\n\n"
                    break
                text, numbers = self.renderer.text(progress.token_ids, progress.numbers)
                if not progress.finished and text.endswith("\ufffd"):
                    continue  # a character whose bytes are not all generated yet
                delta, new = text[len(sent[index]):], numbers[told[index]:]
                sent[index], told[index] = text, len(numbers)
                if delta or new or progress.finished:
                    content = {"content": delta} if self.chat else delta
                    yield self._event(index, content, new, progress.finish_reason if progress.finished else None)
                done += progress.finished
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            self.abort()  # a client gone before the end: its requests stop

    def _choice(self, index: int, text: str, numbers: list[dict], progress: Progress) -> dict:
        choice = {"index": index, "finish_reason": progress.finish_reason, "numbers": numbers,
                  "token_ids": progress.token_ids}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def _event(self, index: int, content, numbers: list[dict], finish_reason: str | None) -> str:
        choice = {"index": index, "finish_reason": finish_reason, "numbers": numbers}
        choice["delta" if self.chat else "text"] = content
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model_name, "choices": [choice]}
        return f"data: {json.dumps(chunk)}\n\n"


def _progress(item) -> Progress:
    if isinstance(item, EngineFailed):
        raise item
    if isinstance(item, Exception):
        raise EngineFailed(f"the engine failed: {item}") from item
    return item


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="An OpenAI-compatible server of CausalQwen on vLLM, its responses "
                                                "with the numbers the model writes (docs/serving.md).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    EngineArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from vllm import LLMEngine
    from vllm.engine.arg_utils import EngineArgs

    from ..tokenization import CausalQwenTokenizer

    args = parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    tokenizer = CausalQwenTokenizer.from_pretrained(engine_args.tokenizer or engine_args.model)
    served = engine_args.served_model_name
    model_name = (served[0] if isinstance(served, list) else served) or engine_args.model
    engine_loop = EngineLoop(LLMEngine.from_engine_args(engine_args), tokenizer.num_token_id)
    try:
        uvicorn.run(build_app(engine_loop, tokenizer, model_name), host=args.host, port=args.port,
                    log_level="info", timeout_graceful_shutdown=10)
    finally:
        engine_loop.close()


if __name__ == "__main__":
    main()
