"""A token-level generate endpoint on the actor's running engine.

The route environment libraries call to sample from a trainer's policy (verifiers'
`TrainClient`, docs/environments.md): prompts arrive as token ids, completions leave as token
ids with each token's log-prob, and here also each token's policy version.

    GET  /v1/models              {"object": "list", "data": [{"id": MODEL, "max_model_len": N}]}
    POST /inference/v1/generate  {"model", "token_ids": [int], "sampling_params": {...}}
         -> {"request_id", "model", "choices": [{"index": 0, "token_ids", "finish_reason",
             "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]},
             "versions": [int]}]}

`sampling_params` are vLLM's, with vLLM's meaning (pipelinerl.engine.sampling says how they
sample): `temperature` (below 1e-5 greedy, vLLM's rule: temperature 0 here), `top_p`, `top_k`,
`min_p`, `repetition_penalty` (at least 0.01, where vLLM takes any above 0: a logit divided by
less may overflow float32, and its log-probs turn NaN), `seed` (draws of the request's own,
the same whatever shares its batch), `max_tokens`, `n` (1), `stop_token_ids`
(added to the model's end tokens, which stop a completion unless `ignore_eos`), `stop`
(strings: the completion ends once its text, decoded with `skip_special_tokens`, holds one;
its tokens stay whole, finish_reason "stop"). Each token's log-prob is that of the
distribution it was sampled from, after all of these. Accepted without effect, since they
shape text this route does not return or a prompt already rendered: `logprobs` (the sampled
token's log-prob comes back, whatever it asks), `detokenize`, `spaces_between_special_tokens`,
`include_stop_str_in_output`, `output_kind`, and verifiers' `routed_experts_prompt_start` and
`reasoning_effort`. vLLM's others (`presence_penalty`, `frequency_penalty`, `min_tokens`,
`logit_bias`, ...) are refused unless they are at vLLM's default, and unknown fields are
refused: a 400 names them, rather than a completion sampled otherwise than asked. Values
are taken as JSON types them, strictly: `true` is no integer, `"0.5"` no number, and NaN or
Infinity (which Python's JSON reader takes) no parameter. No answer carries a non-finite
log-prob, which JSON cannot: should the engine give one, the request gets a 500 saying so.

A request with an `X-Session-ID` header (verifiers' TrainClient sends its trace id) has its
answer kept under that id until `take_session` collects it: the traces an environment library
returns keep tokens and log-probs but no versions, so whoever trains on them reads the versions
here (the `max_sessions` newest sessions are kept).

The server (aiohttp) runs on its own thread and event loop; the actor's loop, which owns the
engine, takes requests from a bounded queue between two decode steps (`take`) and hands back
finished ones (`finish`). A request thus joins the engine's continuous batching like the
actor's own, and a weight update lands between two of its tokens, stamped in `versions`. A
malformed request gets a 400, a full queue a 503, a stopping actor a 503: never a crash. A
client that goes away (an episode past its deadline) has its request dropped from the queue,
or aborted in the engine (`abort_abandoned`), rather than decoded to its end for no one.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import math
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelinerl.types import (
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    StopStrings,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipelinerl.engine.base import Engine

log = logging.getLogger(__name__)

REQUEST_PREFIX = "ep-"  # request ids of the endpoint's requests in the engine
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: logits / 1e-39 overflow to inf, softmax to NaN
# A repeated token's positive logit is divided by the penalty: by at most 100 it stays far
# inside float32 for any logit a model makes; by 1e-45, any above 5e-7 overflows to inf.
MIN_REPETITION_PENALTY = 0.01


class _Sampling(BaseModel):
    # extra: then checked (`_NO_EFFECT`, `_UNSUPPORTED`). strict: lax mode takes true for 1.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    temperature: float = Field(default=1.0, ge=0, description=f"below {GREEDY_BELOW}: greedy")
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, description="vLLM's -1 (or 0): off")
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # torch's seed range
    max_tokens: int | None = Field(default=None, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # in the text that `stop` strings are looked for in
    n: int = Field(default=1, ge=1, le=1, description="one completion per request")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


# sampling_params accepted without effect: they shape the text, which this route does not
# return (`logprobs`: the sampled token's always comes back), or the prompt, rendered already.
_NO_EFFECT = frozenset({"logprobs", "detokenize", "spaces_between_special_tokens",
                        "include_stop_str_in_output", "output_kind",
                        "routed_experts_prompt_start", "reasoning_effort"})
# vLLM's sampling_params not honoured here: refused unless at vLLM's default (or null).
_UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "best_of": 1,
    "prompt_logprobs": None, "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
    "structured_outputs": None, "guided_decoding": None, "logits_processors": None,
    "truncate_prompt_tokens": None, "extra_args": None}


class _Generate(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = ""
    token_ids: list[int] = Field(min_length=1)
    sampling_params: _Sampling = Field(default_factory=_Sampling)


@dataclass
class _Waiting:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    session: str | None = None
    abandoned: bool = False  # its client went away


@dataclass(frozen=True)
class Answer:
    """One generate call's completion as the engine made it: what a trace cannot keep."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


class GenerateEndpoint:
    """Serves `model` on http://host:port (port 0: a free one, then in `.port`).

    `eos_token_ids`: the model's end tokens, which stop every completion unless it asks
    `ignore_eos`. `tokenizer`: the model's (a fast one), to look for `stop` strings in the
    text; without it they are refused. `refused`: sampling_params the engine behind cannot
    honour, refused when set. `url_file`: written with the URL once serving, and removed by
    `close` unless another endpoint wrote its own there since."""

    def __init__(self, *, model: str, max_model_len: int, vocab_size: int,
                 default_max_tokens: int, eos_token_ids: Collection[int] = (),
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 refused: Collection[str] = (), url_file: Path | None = None,
                 host: str = "127.0.0.1", port: int = 0,
                 max_pending: int = 256, max_sessions: int = 4096) -> None:
        self.model, self.max_model_len, self.vocab_size = model, max_model_len, vocab_size
        self.default_max_tokens = default_max_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self._detokenizer = getattr(tokenizer, "backend_tokenizer", None)  # a fast one's
        self.refused = frozenset(refused)
        self.url_file = url_file
        self.host = host
        self._queue: queue.Queue[tuple[GenerationRequest, _Waiting]] = queue.Queue(max_pending)
        self._waiting: dict[str, _Waiting] = {}  # in the engine, by request id
        self._abandoned: set[str] = set()  # of those, the ones whose client went away
        self.aborted = 0  # requests dropped for a client gone, before or during decoding
        self._sessions: OrderedDict[str, list[Answer]] = OrderedDict()
        self._max_sessions = max_sessions
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, args=(port,), daemon=True,
                                        name="generate-endpoint")
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise RuntimeError(f"generate endpoint: cannot serve on {host}:{port}: "
                               f"{self._error}") from self._error
        if url_file is not None:  # replaced whole: a client never reads half of it
            url_file.parent.mkdir(parents=True, exist_ok=True)
            part = url_file.with_name(f".{url_file.name}.{os.getpid()}")
            part.write_text(self.url + "\n")
            os.replace(part, url_file)
            atexit.register(self._remove_url_file)  # a process that ends without `close`

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- the actor's side (its loop's thread) -------------------------------------------------
    def take(self, limit: int) -> list[GenerationRequest]:
        """Up to `limit` queued requests, to add to the engine now."""
        taken = []
        while len(taken) < limit:
            try:
                request, waiting = self._queue.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                if waiting.abandoned:
                    self.aborted += 1
                    continue
                self._waiting[request.request_id] = waiting
            taken.append(request)
        return taken

    def abort_abandoned(self, engine: Engine) -> int:
        """Abort in `engine` the requests taken from here whose client went away; return
        how many (the caller's in-flight count drops by as many). Called every loop of the
        actor: nothing to do costs no lock (one added meanwhile waits for the next call)."""
        if not self._abandoned:
            return 0
        with self._lock:
            gone = [rid for rid in self._abandoned if self._waiting.pop(rid, None) is not None]
            self._abandoned.clear()
        for rid in gone:
            if not engine.abort(rid):
                raise RuntimeError(f"endpoint request {rid!r} is neither finished nor in the engine")
        self.aborted += len(gone)
        return len(gone)

    def finish(self, out: GenerationOutput) -> bool:
        """Answer the request `out` finishes; False if it is not the endpoint's."""
        with self._lock:
            waiting = self._waiting.pop(out.request_id, None)
        if waiting is None:
            return False
        if not all(map(math.isfinite, out.logprobs)):  # JSON has no NaN: strict parsers refuse it
            log.error("endpoint request %s: the engine gave a non-finite log-prob: %s",
                      out.request_id, out.logprobs)
            answer = _error_body(500, "the engine gave a non-finite log-prob (NaN or infinity), "
                                      "which JSON cannot carry")
        else:
            if waiting.session is not None and not waiting.abandoned:
                self._keep(waiting.session, Answer(out.token_ids, out.logprobs, out.versions))
            answer = self._response(out)
        waiting.loop.call_soon_threadsafe(_resolve, waiting.future, answer)
        return True

    def take_session(self, session: str) -> list[Answer]:
        """The answers given under `session`, in order, forgotten here (any thread)."""
        with self._lock:
            return self._sessions.pop(session, [])

    def _keep(self, session: str, answer: Answer) -> None:
        with self._lock:
            self._sessions.setdefault(session, []).append(answer)
            self._sessions.move_to_end(session)
            while len(self._sessions) > self._max_sessions:  # a session never collected
                self._sessions.popitem(last=False)

    def close(self) -> None:
        """Stop serving; requests not finished get a 503."""
        with self._lock:
            self._closed = True
            pending = list(self._waiting.values())
            self._waiting.clear()
        while True:
            try:
                pending.append(self._queue.get_nowait()[1])
            except queue.Empty:
                break
        for waiting in pending:
            waiting.loop.call_soon_threadsafe(_resolve, waiting.future, None)
        self._remove_url_file()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def _remove_url_file(self) -> None:
        """No file naming a dead port; one a later endpoint wrote (a restart) stays."""
        if self.url_file is not None:
            atexit.unregister(self._remove_url_file)
            if _read(self.url_file) == self.url + "\n":
                self.url_file.unlink(missing_ok=True)

    # -- the server's side (its own thread) ---------------------------------------------------
    def _serve(self, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/inference/v1/generate", self._generate)
        # A client's disconnect cancels its handler, so its request can be aborted.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, port)
            self._loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]  # the one bound (port 0: a free one)
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "max_model_len": self.max_model_len}]})

    async def _generate(self, http: web.Request) -> web.Response:
        try:
            body = _Generate.model_validate(json.loads(await http.read()))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"the body is not JSON: {e}")
        except ValidationError as e:
            return _error(400, f"bad request: {e.errors(include_url=False)}")
        problem = self._check(body)
        if problem:
            return _error(400, problem)
        request = GenerationRequest(f"{REQUEST_PREFIX}{next(self._ids)}", list(body.token_ids),
                                    self._sampling(body))
        waiting = _Waiting(asyncio.get_running_loop(), asyncio.get_running_loop().create_future(),
                           http.headers.get("X-Session-ID"))
        with self._lock:
            if self._closed:
                return _error(503, "the actor is stopping")
            try:
                self._queue.put_nowait((request, waiting))
            except queue.Full:
                return _error(503, f"{self._queue.maxsize} requests are waiting already")
        try:
            response = await waiting.future
        except asyncio.CancelledError:  # the client went away (handler_cancellation)
            with self._lock:
                waiting.abandoned = True
                if request.request_id in self._waiting:
                    self._abandoned.add(request.request_id)
            raise
        if response is None:
            return _error(503, "the actor stopped before the request finished")
        if "error" in response:  # `finish` refused to answer it
            return web.json_response(response, status=response["error"]["code"])
        return web.json_response(response)

    def _check(self, body: _Generate) -> str:
        if body.model and body.model != self.model:
            return f"model {body.model!r} is not served here (this is {self.model!r})"
        bad = [t for t in body.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
        p = body.sampling_params
        stops = [t for t in p.stop_token_ids or () if not 0 <= t < self.vocab_size]
        if stops:
            return f"stop_token_ids outside the vocabulary: {stops[:5]}"
        if len(body.token_ids) >= self.max_model_len:
            return (f"prompt of {len(body.token_ids)} tokens leaves no room to generate in "
                    f"max_model_len {self.max_model_len}")
        return self._check_fields(p)

    def _check_fields(self, p: _Sampling) -> str:
        """What in `p` is not honoured here: a field unknown, not supported, or refused by the
        engine, set; stop strings that cannot be looked for."""
        extra = {k: v for k, v in (p.model_extra or {}).items()
                 if v is not None and k not in _NO_EFFECT}
        unknown = sorted(k for k in extra if k not in _UNSUPPORTED)
        if unknown:
            return f"unknown sampling_params {unknown}"
        unsupported = sorted(k for k, v in extra.items() if v != _UNSUPPORTED[k])
        if unsupported:
            return (f"sampling_params {unsupported} are not supported by this endpoint "
                    f"(only at vLLM's defaults: {[_UNSUPPORTED[k] for k in unsupported]})")
        refused = sorted(k for k in self.refused
                         if getattr(p, k) != _Sampling.model_fields[k].default)
        if refused:
            return f"sampling_params {refused} cannot be honoured by this actor's engine"
        if p.stop_strings and self._detokenizer is None:
            return "stop strings need the model's fast tokenizer, which this endpoint lacks"
        if "" in p.stop_strings:
            return "stop holds an empty string"
        return ""

    def _sampling(self, body: _Generate) -> SamplingParams:
        p = body.sampling_params
        # A later turn of an episode may ask more than the context has left: it gets what
        # fits, and finish_reason "length", rather than an error that ends the episode.
        room = self.max_model_len - len(body.token_ids)
        # vLLM's: a request's stop tokens are added to the model's end tokens.
        stop_ids = (() if p.ignore_eos else self.eos_token_ids) + tuple(p.stop_token_ids or ())
        strings = p.stop_strings
        return SamplingParams(
            max_new_tokens=min(p.max_tokens or self.default_max_tokens, room),
            temperature=0.0 if p.temperature < GREEDY_BELOW else p.temperature,
            top_p=p.top_p, top_k=max(0, p.top_k), min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, seed=p.seed,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            stop=StopStrings(strings, self._detokenizer, p.skip_special_tokens) if strings else None)

    def _response(self, out: GenerationOutput) -> dict[str, Any]:
        return {"request_id": out.request_id, "model": self.model, "choices": [{
            "index": 0, "token_ids": out.token_ids,
            "finish_reason": "stop" if out.finish_reason == "stop" else "length",
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                     for t, lp in zip(out.token_ids, out.logprobs)]},
            "versions": out.versions}]}


def _resolve(future: asyncio.Future, value: dict[str, Any] | None) -> None:
    if not future.done():  # the client may have gone (its handler cancelled)
        future.set_result(value)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "code": status}}


def _error(status: int, message: str) -> web.Response:
    return web.json_response(_error_body(status, message), status=status)
