"""An OpenEnv environment as a pipelinerl environment (`task.name: openenv:<label>`,
docs/environments.md): each rollout plays one episode of the environment's server through
openenv-core's own client, the model's turns its actions, the server's observations its
replies, and its rewards and `done` the rollout's.

The server is the environment's FastAPI app (`task.params.app: module:app`), started by each
role's process under uvicorn on 127.0.0.1 (a free port, no Docker) and restarted when it dies,
or one a user runs (`task.params.url`). Episodes: `sample_problem` draws a seed and asks the
server for that seed's first observation (a reset in a short-lived session), which becomes the
prompt; each rollout then opens a WebSocket session of its own (`GenericEnvClient`: one
environment instance on the server per session), resets it with the same seed, checks that it
starts where the prompt says, and steps it once per model turn. At most `max_sessions` sessions
are open at once; a session closes when its rollout ends.

A model turn ends on `turn_stop` (default `</action>`: the action is the text after the last
`<action>`; the observation is appended as `reply_format` says, inside the model's message), or,
with `turn_stop: ""`, on the model's stop token (the whole message is the action; `reply_format`
is then the chat template's text between the end of an assistant message and the start of the
next, around a user message). How the text becomes the action: `action: text` (into the action
schema's one string field, or `action_field`), `json` (a JSON object), or `module:function`.
An action the model wrote badly (the parser refuses it, the server's schema rejects it) is
answered with the error, counted as `openenv_bad_actions`, never an exception; a step that
fails ends the rollout and drops its group, counted: `env_timeout` (no answer within
`actor.env_timeout_s`), `env_crash` (the server went away; a local one is started again,
`openenv_server_restarts`), `env_error` (the environment raised), `env_reset_mismatch` (the
session's reset did not give the prompt's observation: the environment's reset is not
determined by its seed).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from pipelinerl.envs.pool import FutureReplies
from pipelinerl.proc.plugins import OPENENV, import_object
from pipelinerl.tasks.base import Problem, Score
from pipelinerl.tasks.environment import Reply, Turn
from pipelinerl.tasks.split import is_heldout

log = logging.getLogger(__name__)

PREFIX = OPENENV
T = TypeVar("T")

PARAMS = {
    "app": "the environment's ASGI app, module:attribute, served locally (or url)",
    "url": "a running OpenEnv server, http://host:port (or app)",
    "prompt": "the prompt around the first observation, with {observation} (default as is)",
    "turn_stop": "the text that ends a model turn (default </action>; \"\": the stop token)",
    "reply_format": "how an observation follows a turn, with {observation}",
    "action": "text (default), json, or module:function (text -> the action's dict)",
    "action_field": "the action's field the text goes into (default: its one string field)",
    "observation": "auto (default: its one string field, else JSON), a field, or module:fn",
    "max_turns": "model turns at most (default 8)",
    "seeds": "episodes are the resets of seeds 0..seeds-1 (default 100000)",
    "reset": "more keyword arguments of every reset (default none)",
    "max_sessions": "sessions open at once, per process (default 64)",
    "timeout_s": "the prompt's reset and the server's health check (default 30)",
    "start_timeout_s": "a local server's start (default 120)",
}
TAG_REPLY = "\n<observation>{observation}</observation>\n"


def _openenv() -> Any:
    """openenv-core's client (imported when an OpenEnv task is built: it takes seconds)."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as e:
        raise ValueError(f"OpenEnv environments need openenv-core (pip install "
                         f"'pipelinerl[openenv]'): importing it failed: {e}") from e
    return GenericEnvClient


class LocalServer:
    """The environment's app under uvicorn on 127.0.0.1, in a process of its own, killed when
    this object goes (a finalizer: the launcher's check builds the task once and drops it) or
    this process exits."""

    def __init__(self, app: str, start_timeout_s: float, health_timeout_s: float) -> None:
        module, _, attr = app.partition(":")
        if not module or not attr:
            raise ValueError(f"task.params.app {app!r}: an app is 'module:attribute' "
                             "(e.g. openenv_guess:app)")
        self.app = app
        self.start_timeout_s = start_timeout_s
        self.health_timeout_s = health_timeout_s
        self.restarts = 0
        self.url = ""
        # The running process, in a box the finalizer holds (it must not hold self).
        self._box: list[subprocess.Popen | None] = [None]
        self._tail: collections.deque[str] = collections.deque(maxlen=20)
        self._lock = threading.Lock()
        weakref.finalize(self, _kill, self._box)
        self.start()

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._box[0]

    def start(self) -> None:
        # The socket is bound here and handed over (--fd): no other process can take the port.
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        env = dict(os.environ)
        # The app's module is found where the user's other modules are: the working directory.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "uvicorn", self.app, "--fd", str(sock.fileno()),
                   "--log-level", "warning", "--no-access-log"]
        self._tail.clear()
        try:
            proc = subprocess.Popen(command, pass_fds=[sock.fileno()], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        finally:
            sock.close()
        self._box[0] = proc
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        while not _healthy(self.url, min(self.health_timeout_s, 2.0)):
            if proc.poll() is not None:
                proc.wait()
                time.sleep(0.1)  # the reader takes the last lines
                raise ValueError(f"the OpenEnv server (uvicorn {self.app}) exited with code "
                                 f"{proc.returncode} before it answered: {self.last_lines()}")
            if time.monotonic() > deadline:
                _kill([proc])
                raise ValueError(f"the OpenEnv server (uvicorn {self.app}) did not answer "
                                 f"{self.url}/health within {self.start_timeout_s:g} s "
                                 "(task.params.start_timeout_s)")
            time.sleep(0.1)

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # kept for the error message; the rest is the server's noise
            if line.strip():
                self._tail.append(line.rstrip())

    def last_lines(self) -> str:
        lines = [line for line in self._tail if not line.startswith(" ")]
        return " | ".join(lines[-3:]) or "(no output)"

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self, why: str) -> None:
        """Start the server again (it died, or hangs); serialised: one restart per death."""
        with self._lock:
            dead = self._proc
            if dead is not None and dead.poll() is None and why == "died":
                return  # another thread restarted it already
            log.warning("the OpenEnv server (uvicorn %s) %s (%s): starting it again", self.app,
                        why, self.last_lines())
            _kill([dead])
            self.restarts += 1
            self.start()

    def stop(self) -> None:
        _kill(self._box)


def _kill(box: list[subprocess.Popen | None]) -> None:
    proc = box[0]
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def _healthy(url: str, timeout_s: float) -> bool:
    import httpx  # openenv-core's dependency

    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _schema(url: str, timeout_s: float) -> dict[str, Any]:
    import httpx

    try:
        response = httpx.get(f"{url}/schema", timeout=timeout_s)
        response.raise_for_status()
        return response.json()["action"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise ValueError(f"the OpenEnv server at {url} gave no action schema (/schema): "
                         f"{e}") from e


def _string_fields(schema: dict[str, Any]) -> list[str]:
    props = schema.get("properties", {})
    return [name for name, p in props.items() if p.get("type") == "string"]


class BadAction(ValueError):
    """The model's text is no action; its message goes back to the model."""


def action_parser(kind: str, action_field: str, schema: dict[str, Any]
                  ) -> Callable[[str], dict[str, Any]]:
    """The model's text -> the action's dict, as task.params.action says."""
    if kind == "json":
        def parse_json(text: str) -> dict[str, Any]:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise BadAction(f"the action is not JSON: {e}") from None
            if not isinstance(value, dict):
                raise BadAction("the action must be a JSON object")
            return value
        return parse_json
    if kind == "text":
        strings = _string_fields(schema)
        if action_field:
            if action_field not in schema.get("properties", {}):
                raise ValueError(f"task.params.action_field {action_field!r}: the action has no "
                                 f"such field (its fields: {sorted(schema.get('properties', {}))})")
            name = action_field
        elif len(strings) == 1:
            name = strings[0]
        else:
            raise ValueError(f"task.params.action: text needs the action's one string field, "
                             f"but its string fields are {strings}: name one (action_field) or "
                             "set action to json or module:function")
        return lambda text: {name: text}
    fn = import_object(kind, f"task.params.action {kind!r}")
    if not callable(fn):
        raise ValueError(f"task.params.action {kind!r} is a {type(fn).__name__}, not callable")

    def parse_user(text: str) -> dict[str, Any]:
        try:
            value = fn(text)
        except ValueError as e:  # the user's parser refuses the text
            raise BadAction(str(e)) from None
        if not isinstance(value, dict):
            raise TypeError(f"task.params.action {kind!r} returned a {type(value).__name__}, "
                            "not a dict")
        return value
    return parse_user


def observation_renderer(kind: str) -> Callable[[dict[str, Any]], str]:
    """An observation's dict -> the text the model reads, as task.params.observation says."""
    if kind == "auto":
        def auto(obs: dict[str, Any]) -> str:
            strings = [v for v in obs.values() if isinstance(v, str)]
            if len(strings) == 1 and len(obs) == 1:
                return strings[0]
            return json.dumps(obs, ensure_ascii=False, sort_keys=True)
        return auto
    if ":" in kind:
        fn = import_object(kind, f"task.params.observation {kind!r}")
        if not callable(fn):
            raise ValueError(f"task.params.observation {kind!r} is not callable")
        return lambda obs: str(fn(obs))
    return lambda obs: str(obs.get(kind, ""))


class OpenEnvTask:
    """`openenv:<label>`: an OpenEnv environment's episodes (see the module docstring). Its
    rewards are the environment's (summed over steps); `score` adds nothing."""

    bounds_score_time = True  # score is arithmetic-free: called from threads, never pickled

    def __init__(self, label: str, params: dict[str, Any] | None = None) -> None:
        params = dict(params or {})
        if unknown := sorted(set(params) - set(PARAMS)):
            raise ValueError(f"unknown param(s) {unknown}; accepted: {sorted(PARAMS)}")
        app, url = params.get("app"), params.get("url")
        if bool(app) == bool(url):
            raise ValueError("give exactly one of task.params.app (module:app, started here) and "
                             "task.params.url (a running server)")
        self.name = f"{PREFIX}{label}"
        self.prompt_format = str(params.get("prompt", "{observation}"))
        stop = str(params.get("turn_stop", "</action>"))
        self.turn_stops: tuple[str, ...] = (stop,) if stop else ()
        self.respond_on_stop = not stop
        self.action_open = f"<{stop[2:]}" if stop.startswith("</") else ""
        if "reply_format" not in params and not stop:
            raise ValueError("turn_stop \"\" (turns end on the model's stop token) needs "
                             "task.params.reply_format: the chat template's text from the end of "
                             "an assistant message to the start of the next, around a user "
                             "message with {observation} (docs/environments.md)")
        self.reply_format = str(params.get("reply_format", TAG_REPLY))
        for key, text in (("prompt", self.prompt_format), ("reply_format", self.reply_format)):
            if "{observation}" not in text:
                raise ValueError(f"task.params.{key} {text!r} has no {{observation}}")
        self.max_turns = int(params.get("max_turns", 8))
        self.seeds = int(params.get("seeds", 100_000))
        self.max_sessions = int(params.get("max_sessions", 64))
        self.timeout_s = float(params.get("timeout_s", 30.0))
        start_timeout_s = float(params.get("start_timeout_s", 120.0))
        if min(self.max_turns, self.seeds, self.max_sessions) < 1 or min(
                self.timeout_s, start_timeout_s) <= 0:
            raise ValueError("task.params.max_turns, seeds and max_sessions must be >= 1, "
                             "timeout_s and start_timeout_s > 0")
        self.reset_kwargs = dict(params.get("reset") or {})
        self.client_cls = _openenv()
        self.server = LocalServer(app, start_timeout_s, self.timeout_s) if app else None
        self._url = None if app else str(url).rstrip("/")
        if self._url is not None and not _healthy(self._url, self.timeout_s):
            raise ValueError(f"the OpenEnv server at {self._url} does not answer /health "
                             f"within {self.timeout_s:g} s")
        schema = _schema(self.url, self.timeout_s)
        self.parse_action = action_parser(str(params.get("action", "text")),
                                          str(params.get("action_field", "")), schema)
        self.render = observation_renderer(str(params.get("observation", "auto")))
        self.loop = _Loop()
        self._first: dict[int, str] = {}  # seed -> its first observation, rendered
        weakref.finalize(self, self.loop.stop)

    @property
    def url(self) -> str:
        return self.server.url if self.server is not None else str(self._url)

    # -- the task ---------------------------------------------------------------------------
    def problem(self, seed: int) -> Problem:
        first = self._first.get(seed)
        if first is None:
            first = self._first_observation(seed)
            if len(self._first) < 100_000:
                self._first[seed] = first
        return Problem(f"{self.name}:{seed}", self.prompt_format.format(observation=first),
                       {"seed": seed, "first": first})

    def sample_problem(self, rng: random.Random) -> Problem:
        return self.problem(rng.randrange(self.seeds))

    def heldout_problems(self, n: int, seed: int, heldout_frac: float) -> list[Problem]:
        """At most `n` held-out episodes (their ids hash below `heldout_frac`), the same in
        every process; only these are reset."""
        order = list(range(self.seeds))
        random.Random(f"heldout-{seed}").shuffle(order)
        held = [s for s in order if is_heldout(f"{self.name}:{s}", heldout_frac)][:n]
        if not held:
            raise ValueError(f"task {self.name!r}: no held-out episodes (raise "
                             "task.heldout_frac or task.params.seeds)")
        return [self.problem(s) for s in held]

    def score(self, problem: Problem, completion: str) -> Score:
        return Score(0.0, False)

    def respond(self, problem: Problem, turns: list[Turn]) -> Reply:
        raise RuntimeError("an OpenEnv task's turns are answered by its reply pool")

    def reply_pool(self, timeout_s: float, workers: int) -> OpenEnvSessions:
        """`timeout_s` (actor.env_timeout_s) bounds each session's reset and step."""
        return OpenEnvSessions(self, timeout_s)

    # -- talking to the server ----------------------------------------------------------------
    def client(self, timeout_s: float) -> Any:
        return self.client_cls(base_url=self.url, connect_timeout_s=timeout_s,
                               message_timeout_s=timeout_s)

    def _first_observation(self, seed: int) -> str:
        """The episode's first observation (a reset in a session of its own). A local server
        that died or hangs is started again, once; a server that cannot answer stops the role
        with one line."""
        for attempt in range(2):
            try:
                return self.loop.run(self._reset_once(seed), self.timeout_s + 5)
            except (ConnectionError, OSError, TimeoutError, asyncio.TimeoutError,
                    _closed_errors()) as e:
                if self.server is None or attempt == 1:
                    raise RuntimeError(f"the OpenEnv server at {self.url} gave no first "
                                       f"observation for seed {seed}: {type(e).__name__}: {e}"
                                       ) from e
                self.server.restart("died" if not self.server.alive() else
                                    f"gave no reset within {self.timeout_s:g} s")
        raise AssertionError("unreachable")

    async def _reset_once(self, seed: int) -> str:
        client = self.client(self.timeout_s)
        try:
            result = await asyncio.wait_for(client.reset(seed=seed, **self.reset_kwargs),
                                            self.timeout_s)
        finally:
            await _close_quietly(client)
        return self.render(result.observation)

    def action_text(self, turn: str) -> str:
        """The part of a model turn that is the action: after the last opening tag (if any),
        without the turn stop."""
        text = turn.removesuffix(self.turn_stops[0]) if self.turn_stops else turn
        if self.action_open and self.action_open in text:
            text = text.rsplit(self.action_open, 1)[1]
        return text.strip()


def _closed_errors() -> type[BaseException]:
    from websockets.exceptions import ConnectionClosed

    return ConnectionClosed


async def _close_quietly(client: Any) -> None:
    try:
        await asyncio.wait_for(client.close(), 2.0)
    except Exception:  # noqa: BLE001 - closing a dead session is best effort
        pass


class _Loop:
    """An event loop on a thread of its own: the sessions' I/O, off the actor's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="openenv",
                                       daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro: Awaitable[T]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            if threading.current_thread() is not self.thread:  # the task may go on its loop
                self.thread.join(timeout=5)


@dataclass
class _Session:
    client: Any
    step: int = 0  # steps asked of it, bad actions included


class OpenEnvSessions(FutureReplies):
    """The rollouts' episodes: one WebSocket session each, on the task's loop (the reply pool
    of `pipelinerl.envs.rollout`; `EnvPool`'s interface)."""

    def __init__(self, task: OpenEnvTask, timeout_s: float) -> None:
        super().__init__()
        self.task = task
        self.timeout_s = timeout_s
        self.counts: Counter[str] = Counter()  # sessions, steps, bad actions
        self._warned_mismatch = False
        self._open: dict[str, _Session] = {}
        self._slots = asyncio.Semaphore(task.max_sessions)

    def submit(self, key: str, problem: Problem, turns: list[Turn],
               ended_on: str | None = None) -> None:
        self._track(key, self.task.loop.submit(self._answer(key, problem, turns[-1].text)))

    def end(self, key: str) -> None:
        self.task.loop.submit(self._close(key))

    def snapshot(self) -> dict[str, float]:
        """The actor's metrics (the failures are counted by the rollouts, env_*)."""
        server = self.task.server
        return {**{f"openenv_{k}": n for k, n in self.counts.items()},
                "openenv_server_restarts": server.restarts if server is not None else 0}

    def close(self) -> None:
        try:
            self.task.loop.run(self._close_all(), timeout_s=10)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass

    # -- on the task's loop --------------------------------------------------------------------
    async def _answer(self, key: str, problem: Problem, turn: str) -> tuple[Reply | None, str]:
        """One model turn answered: the session opened (the first time), the action parsed
        and stepped; the reply, or the failure that ends the rollout."""
        started = time.monotonic()
        try:
            if key not in self._open:
                if failure := await self._start(key, problem):
                    return None, failure
            session = self._open[key]
            text = self.task.action_text(turn)
            try:
                action = self.task.parse_action(text)
                result = await asyncio.wait_for(session.client.step(action), self.timeout_s)
            except BadAction as e:
                return self._bad(key, session, text, f"error: {e}", started), ""
            except RuntimeError as e:  # the server's answer was an error message
                if "VALIDATION_ERROR" in str(e):  # the action does not fit the schema
                    return self._bad(key, session, text, "error: the action does not fit the "
                                     "environment's action schema", started), ""
                raise
        except (asyncio.TimeoutError, TimeoutError):
            return None, "env_timeout"
        except (ConnectionError, OSError, _closed_errors()):
            await self._after_crash()
            return None, "env_crash"
        except RuntimeError as e:
            log.warning("OpenEnv environment %s raised: %s", self.task.name, e)
            return None, "env_error"
        session.step += 1
        observation = self.task.render(result.observation)
        reward = float(result.reward or 0.0)
        record = {
            "key": f"{key}/{session.step - 1}", "turn": session.step - 1, "name": "step",
            "arguments": action, "reply": observation, "reward": reward,
            "done": bool(result.done), "outcome": "ok",
            "latency_s": round(time.monotonic() - started, 6)}
        self.counts["steps"] += 1
        return Reply(self.task.reply_format.format(observation=observation),
                     done=bool(result.done), reward=reward, calls=(record,)), ""

    def _bad(self, key: str, session: _Session, text: str, message: str, started: float
             ) -> Reply:
        session.step += 1
        self.counts["bad_actions"] += 1
        record = {"key": f"{key}/{session.step - 1}", "turn": session.step - 1, "name": "step",
                  "arguments": {"text": text}, "reply": message, "outcome": "bad_action",
                  "latency_s": round(time.monotonic() - started, 6)}
        return Reply(self.task.reply_format.format(observation=message), calls=(record,))

    async def _start(self, key: str, problem: Problem) -> str:
        """Open rollout `key`'s session and reset it to the problem's episode; a failure."""
        await self._slots.acquire()
        client = self.task.client(self.timeout_s)
        self._open[key] = _Session(client)  # from here on, end() closes it
        self.counts["sessions"] += 1
        result = await asyncio.wait_for(
            client.reset(seed=problem.answer["seed"], **self.task.reset_kwargs), self.timeout_s)
        if self.task.render(result.observation) != problem.answer["first"]:
            if not self._warned_mismatch:
                self._warned_mismatch = True
                log.warning("OpenEnv environment %s: a session's reset with seed %s gave another "
                            "first observation than the prompt's: its reset is not determined "
                            "by its seed, so its episodes cannot be trained on (dropped, "
                            "counted)", self.task.name, problem.answer["seed"])
            return "env_reset_mismatch"
        return ""

    async def _after_crash(self) -> None:
        server = self.task.server
        if server is not None and not server.alive():
            # The loop's thread would block on the restart: it runs in a thread of its own.
            await asyncio.get_running_loop().run_in_executor(None, server.restart, "died")

    async def _close(self, key: str) -> None:
        session = self._open.pop(key, None)
        if session is None:
            return
        await _close_quietly(session.client)
        self._slots.release()

    async def _close_all(self) -> None:
        await asyncio.gather(*(self._close(key) for key in list(self._open)))
