"""The actor's token-level generate endpoint: verifiers' request and response shapes, exact
log-probs and per-token versions, requests joining the actor's batch, bad requests refused."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest
import requests
import torch
from fake_tasks import FakeTask
from test_actor import ListWriter, make_actor, stop_after
from test_torch_engine import hf_logits
from tiny_models import VOCAB, tiny_hf_model

from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.roles.actor import Schedule
from pipelinerl.rollouts.endpoint import GenerateEndpoint
from pipelinerl.types import GenerationOutput

MAX_LEN = 40


def _endpoint(**kwargs: Any) -> GenerateEndpoint:
    return GenerateEndpoint(model="tiny", max_model_len=MAX_LEN, vocab_size=VOCAB,
                            default_max_tokens=8, **kwargs)


def _generate(url: str, token_ids: list[int], timeout: float = 60, model: str = "tiny",
              **sampling: Any) -> requests.Response:
    return requests.post(f"{url}/inference/v1/generate", timeout=timeout,
                         json={"model": model, "token_ids": token_ids,
                               "sampling_params": {"logprobs": 1, "skip_special_tokens": False,
                                                   **sampling}})


class _Driver:
    """The actor loop's part for the endpoint, alone: take, add, step, finish; `between` runs
    between two steps (a weight update)."""

    def __init__(self, engine: TorchEngine, endpoint: GenerateEndpoint) -> None:
        self.engine, self.endpoint = engine, endpoint
        self.steps = 0
        self.between: dict[int, Any] = {}
        self.outputs: list[GenerationOutput] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for request in self.endpoint.take(self.engine.capacity - self.engine.num_active()):
                self.engine.add_request(request)
            if not self.engine.num_active():
                self._stop.wait(0.002)
                continue
            if self.steps in self.between:
                self.between.pop(self.steps)()
            self.steps += 1
            for out in self.engine.step():
                self.outputs.append(out)
                assert self.endpoint.finish(out)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def served() -> Iterator[tuple[torch.nn.Module, TorchEngine, GenerateEndpoint, _Driver]]:
    torch.manual_seed(0)
    hf = tiny_hf_model("qwen2")
    engine = TorchEngine(hf.config, EngineOptions(capacity=4, max_seq_len=MAX_LEN, seed=1))
    engine.load_weights(hf.state_dict(), version=0)
    endpoint = _endpoint()
    driver = _Driver(engine, endpoint)
    yield hf, engine, endpoint, driver
    driver.stop()
    endpoint.close()


def test_models_and_generate_speak_the_shapes_verifiers_checks(served) -> None:
    hf, _, endpoint, driver = served
    models = requests.get(f"{endpoint.url}/v1/models", timeout=10).json()
    assert models["data"] == [{"id": "tiny", "object": "model", "max_model_len": MAX_LEN}]
    prompts = [[1 + (i * 7 + j) % (VOCAB - 1) for j in range(3 + i)] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:  # more requests than the engine has slots
        answers = list(pool.map(lambda p: _generate(endpoint.url, p, max_tokens=12), prompts))
    for prompt, answer in zip(prompts, answers):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        (choice,) = body["choices"]
        assert body["request_id"] and choice["finish_reason"] in ("stop", "length")
        ids = choice["token_ids"]
        assert 0 < len(ids) <= 12 and choice["versions"] == [0] * len(ids)
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
        got = torch.tensor([c["logprob"] for c in content])
        assert all(math.isfinite(x) and x != -9999.0 for x in got.tolist())
        # Exact: the log-prob of each token under the model, teacher-forced.
        out = GenerationOutput("x", prompt, ids, got.tolist(), [0] * len(ids), "length")
        want = hf_logits(hf, out).log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_weight_update_lands_between_two_tokens_of_a_request(served) -> None:
    hf, engine, endpoint, driver = served
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.state_dict().items()}
    driver.between[4] = lambda: engine.load_weights(new, version=1)
    choice = _generate(endpoint.url, [3, 4, 5], max_tokens=10, temperature=0).json()["choices"][0]
    versions = choice["versions"]
    first_new = versions.index(1)  # tokens before the update are version 0, those after 1
    assert len(versions) == 10 and 0 < first_new < 10
    assert versions == [0] * first_new + [1] * (10 - first_new)


@pytest.mark.parametrize("body,message", [
    ("not json", "not JSON"),
    ({"model": "tiny"}, "token_ids"),
    ({"model": "tiny", "token_ids": []}, "token_ids"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"n": 2}}, "'n'"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"model": "tiny", "token_ids": [1, VOCAB]}, "outside the vocabulary"),
    ({"model": "tiny", "token_ids": [1] * 40}, "leaves no room to generate in max_model_len 40"),
    ({"model": "other", "token_ids": [1]}, "not served here"),
    # Too small to divide a logit by in float32 (issue 41): inf logits, then NaN log-probs.
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"repetition_penalty": 1e-45}},
     "repetition_penalty"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"repetition_penalty": 0.009}},
     "repetition_penalty"),
    # JSON's NaN and Infinity (Python's json reads them) are no sampling parameters.
    ('{"token_ids": [1], "sampling_params": {"repetition_penalty": Infinity}}',
     "repetition_penalty"),
    # A bool is no integer, though pydantic's lax mode takes true for 1 (issue 41).
    ({"model": "tiny", "token_ids": [True, 2]}, "token_ids"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"stop_token_ids": [True]}},
     "stop_token_ids"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"seed": True}}, "seed"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"max_tokens": True}}, "max_tokens"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"top_k": True}}, "top_k"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"n": True}}, "'n'"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"temperature": True}}, "temperature"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"top_p": "0.5"}}, "top_p"),
    ({"model": "tiny", "token_ids": [1], "sampling_params": {"ignore_eos": 1}}, "ignore_eos"),
])
def test_a_bad_request_gets_a_400_naming_what_is_wrong(served, body: Any, message: str) -> None:
    _, _, endpoint, driver = served
    url = f"{endpoint.url}/inference/v1/generate"
    answer = (requests.post(url, data=body, timeout=10) if isinstance(body, str)
              else requests.post(url, json=body, timeout=10))
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]
    assert _generate(endpoint.url, [1, 2], max_tokens=2).status_code == 200  # still serving


def test_a_temperature_below_1e_5_is_greedy_with_finite_log_probs(served) -> None:
    """vLLM's rule: a temperature below 1e-5 is greedy. Logits divided by 1e-39 overflow to
    inf, whose softmax is NaN: a log-prob strict JSON parsers refuse (issue 41)."""
    _, _, endpoint, _ = served
    greedy = _generate(endpoint.url, [3, 4, 5], max_tokens=6, temperature=0).json()["choices"][0]
    for tiny in (1e-39, 9e-6):
        choice = _generate(endpoint.url, [3, 4, 5], max_tokens=6,
                           temperature=tiny).json()["choices"][0]
        logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
        assert all(math.isfinite(x) for x in logprobs), logprobs
        assert choice["token_ids"] == greedy["token_ids"]
        assert logprobs == [c["logprob"] for c in greedy["logprobs"]["content"]]


def test_a_non_finite_log_prob_from_the_engine_answers_500_and_is_kept_nowhere() -> None:
    """JSON cannot carry NaN: the client gets an error it can read, not `"logprob": NaN`."""
    endpoint = _endpoint()  # no driver: the test plays the actor's loop
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(requests.post, f"{endpoint.url}/inference/v1/generate",
                                 json={"token_ids": [1, 2]}, headers={"X-Session-ID": "s"},
                                 timeout=30)
            _wait_for(lambda: endpoint._queue.qsize() == 1)
            (request,) = endpoint.take(4)
            assert endpoint.finish(GenerationOutput(request.request_id, [1, 2], [3, 4],
                                                    [-0.5, float("nan")], [0, 0], "length"))
            got = answer.result()
        assert got.status_code == 500 and "non-finite log-prob" in got.json()["error"]["message"]
        assert endpoint.take_session("s") == []
    finally:
        endpoint.close()


def test_a_request_longer_than_the_context_leaves_gets_what_fits(served) -> None:
    _, _, endpoint, _ = served
    choice = _generate(endpoint.url, [1] * 35, max_tokens=20).json()["choices"][0]
    assert len(choice["token_ids"]) <= 5
    assert len(choice["token_ids"]) == 5 or choice["finish_reason"] == "stop"


def test_a_full_queue_answers_503_and_a_closing_actor_answers_the_waiting() -> None:
    endpoint = _endpoint(max_pending=1)  # no driver: nothing is taken
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_generate, endpoint.url, [1, 2])
        while endpoint._queue.qsize() < 1:
            pass
        assert _generate(endpoint.url, [1, 2]).status_code == 503
        endpoint.close()
        assert first.result().status_code == 503


def test_endpoint_requests_join_the_actors_batch_while_it_trains_groups() -> None:
    hf = tiny_hf_model("qwen2")
    engine = TorchEngine(hf.config, EngineOptions(capacity=8, max_seq_len=MAX_LEN, seed=1))
    engine.load_weights(hf.state_dict(), version=0)
    endpoint = _endpoint()
    writer = ListWriter()
    done = threading.Event()
    actor = make_actor(engine, FakeTask(), Schedule(batch_size=8, group_size=4, max_lag=100),
                       writer=writer, endpoint=endpoint, should_stop=stop_after(60, done.is_set))
    thread = threading.Thread(target=actor.run)
    thread.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: _generate(endpoint.url, [1 + i, 2], max_tokens=6),
                                    range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        assert all(len(a.json()["choices"][0]["token_ids"]) <= 6 for a in answers)
        while not [r for r in writer.records if "samples" in r]:  # groups published meanwhile
            assert thread.is_alive()
            threading.Event().wait(0.05)
    finally:
        done.set()
        thread.join(30)
    assert actor.in_flight >= 0 and not endpoint._waiting


@pytest.mark.slow
def test_a_training_run_serves_its_actors_engine(tmp_path, warm_cache) -> None:
    import subprocess
    import sys
    import time
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"
    err_path = tmp_path / "stderr.txt"  # a file, not a pipe no one reads while this waits
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipelinerl.cli", "train", str(example), "name=served",
             f"output_dir={tmp_path / 'runs'}", f"warmstart.cache_dir={warm_cache}",
             "warmstart.steps=20", "eval.enabled=false", "engine.capacity=16",
             "actor.group_size=4", "trainer.batch_size=16", "trainer.max_steps=40",
             "actor.endpoint_port=0", "metrics.progress=false", "metrics.plot=false"],
            stderr=err, text=True)
    run_dir = tmp_path / "runs" / "served"

    def what_it_printed() -> str:
        logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in [err_path, *logs])

    where = run_dir / "endpoints" / "actor_0"
    # A guard against a hang only: the run fails by itself first when a role stalls
    # (trainer.sample_timeout_s). It came up in 20-40 s here, in 240+ s once in CI (a warm
    # start's threads slowed by a busy CPU, since fixed: pipelinerl/proc/cpu_threads.py).
    deadline = time.monotonic() + 600
    try:
        while not where.exists():
            assert proc.poll() is None, f"the run ended with no endpoint:\n{what_it_printed()}"
            assert time.monotonic() < deadline, f"no endpoint came up:\n{what_it_printed()}"
            time.sleep(0.2)
        url = where.read_text().strip()
        (model,) = [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]]
        answer = _generate(url, [5, 6, 7], model=model, max_tokens=5)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert len(choice["versions"]) == len(choice["token_ids"])
        proc.wait(timeout=300)
        assert proc.returncode == 0, what_it_printed()
        assert not where.exists()  # no URL naming a dead port once the actor stopped
    finally:
        if proc.poll() is None:
            proc.kill()


def test_answers_are_kept_by_session_until_collected_and_only_the_newest_sessions(served) -> None:
    """What a verifiers trace cannot keep (versions) is kept here under its X-Session-ID."""
    _, _, endpoint, driver = served
    endpoint._max_sessions = 2

    def ask(session: str | None, prompt: list[int]) -> dict:
        headers = {"X-Session-ID": session} if session else {}
        return requests.post(f"{endpoint.url}/inference/v1/generate", timeout=60, headers=headers,
                             json={"model": "tiny", "token_ids": prompt,
                                   "sampling_params": {"max_tokens": 5}}).json()["choices"][0]

    first = [ask("s1", [3, 4]), ask("s1", [5, 6])]
    ask(None, [7])  # no session: nothing kept
    kept = endpoint.take_session("s1")
    assert [(a.token_ids, a.logprobs, a.versions) for a in kept] == [
        (c["token_ids"], [x["logprob"] for x in c["logprobs"]["content"]], c["versions"])
        for c in first]
    assert endpoint.take_session("s1") == []  # collected once
    for session in ("a", "b", "c"):
        ask(session, [3])
    assert endpoint.take_session("a") == [] and len(endpoint.take_session("c")) == 1


def _wait_for(condition: Any, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_client_gone_before_its_request_is_taken_is_dropped_from_the_queue() -> None:
    endpoint = _endpoint()  # no driver: nothing is taken until the client has gone
    try:
        with pytest.raises(requests.exceptions.Timeout):
            _generate(endpoint.url, [1, 2], timeout=0.3)
        _wait_for(lambda: endpoint._queue.queue[0][1].abandoned)
        assert endpoint.take(4) == [] and endpoint.aborted == 1
    finally:
        endpoint.close()


def test_a_client_gone_while_its_request_decodes_is_aborted_in_the_engine() -> None:
    """An episode past its deadline drops its HTTP request: the engine stops decoding it
    (its slot frees) instead of running it to max_tokens for no one."""
    hf = tiny_hf_model("qwen2")
    engine = TorchEngine(hf.config, EngineOptions(capacity=4, max_seq_len=MAX_LEN, seed=1))
    engine.load_weights(hf.state_dict(), version=0)
    endpoint = _endpoint()
    try:
        with ThreadPoolExecutor(1) as pool:
            gone = pool.submit(_generate, endpoint.url, [1, 2], timeout=0.5, max_tokens=30)
            _wait_for(lambda: endpoint._queue.qsize() == 1)
            (request,) = endpoint.take(4)
            engine.add_request(request)
            assert engine.step() == [] and engine.num_running() == 1  # decoding
            with pytest.raises(requests.exceptions.Timeout):
                gone.result()
        _wait_for(lambda: endpoint.abort_abandoned(engine) == 1)
        assert engine.num_active() == 0 and endpoint.aborted == 1 and not endpoint._waiting
        assert engine.step() == []  # nothing comes back for it
    finally:
        endpoint.close()


class _SlowEngine(TorchEngine):
    def step(self) -> list[GenerationOutput]:
        time.sleep(0.05)  # a real model's step: 30 tokens take 1.5 s, the client gives up at 0.3
        return super().step()


def test_an_actor_aborts_a_request_whose_client_went_away_and_keeps_its_count() -> None:
    hf = tiny_hf_model("qwen2")
    engine = _SlowEngine(hf.config, EngineOptions(capacity=8, max_seq_len=MAX_LEN, seed=1))
    engine.load_weights(hf.state_dict(), version=0)
    endpoint = _endpoint()
    done = threading.Event()
    # max_lag 0 and no trainer: one group of 4 runs, 4 slots stay for the endpoint.
    actor = make_actor(engine, FakeTask(), Schedule(batch_size=4, group_size=4, max_lag=0),
                       endpoint=endpoint, should_stop=stop_after(120, done.is_set))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            actor.run()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        with pytest.raises(requests.exceptions.Timeout):
            _generate(endpoint.url, [1, 2], timeout=0.3, max_tokens=30)
        _wait_for(lambda: actor.snapshot().get("endpoint_aborted") == 1)
        patient = _generate(endpoint.url, [3, 4], max_tokens=3)
        assert patient.status_code == 200 and len(patient.json()["choices"][0]["token_ids"]) == 3
    finally:
        done.set()
        thread.join(30)
    assert not errors and not endpoint._waiting
    assert actor.in_flight == engine.num_active()  # every request in the engine counted once
