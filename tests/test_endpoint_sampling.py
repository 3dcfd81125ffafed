"""The generate endpoint honours vLLM's sampling fields or refuses them by name, stops at the
model's end tokens by default, and leaves no URL file naming a dead port (issue 37, parts 6
and 8). A real aiohttp server in front of the real torch engine on a tiny model, and the
model's own char tokenizer for stop strings."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
import torch
from fake_tasks import FakeTask
from test_actor import make_actor, stop_after
from test_endpoint import MAX_LEN, _Driver, _generate
from tiny_models import VOCAB, tiny_hf_model
from transformers import PreTrainedTokenizerFast
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from pipelinerl.config import ActorConfig, Config
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.models.tiny import build_char_tokenizer
from pipelinerl.roles.actor import Schedule, open_endpoint
from pipelinerl.rollouts.endpoint import GenerateEndpoint
from pipelinerl.types import GenerationRequest, SamplingParams

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?-+=*/"  # 4 special tokens + 46 = VOCAB
PROMPT = [7, 9, 7, 11, 5]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    tok = build_char_tokenizer(ALPHABET, tmp_path_factory.mktemp("tokenizer"))
    assert len(tok) == VOCAB
    return tok


def _engine(hf: torch.nn.Module) -> TorchEngine:
    engine = TorchEngine(hf.config, EngineOptions(capacity=4, max_seq_len=MAX_LEN, seed=1))
    engine.load_weights(hf.state_dict(), version=0)
    return engine


@contextmanager
def _served(hf: torch.nn.Module, **endpoint: Any) -> Iterator[GenerateEndpoint]:
    engine = _engine(hf)
    served = GenerateEndpoint(model="tiny", max_model_len=MAX_LEN, vocab_size=VOCAB,
                              default_max_tokens=8, **endpoint)
    driver = _Driver(engine, served)
    try:
        yield served
    finally:
        driver.stop()
        served.close()


def _greedy_alone(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """What greedy decoding continues `prompt` with, from the engine alone: no stop at all."""
    engine = _engine(hf)
    engine.add_request(GenerationRequest("probe", prompt, SamplingParams(n, temperature=0.0)))
    outs = []
    while engine.num_active():
        outs += engine.step()
    return outs[0].token_ids


def _choice(answer: requests.Response) -> dict[str, Any]:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def _logprobs(choice: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])


# ---- the model's end tokens -----------------------------------------------------------------


def test_the_model_end_token_stops_a_completion_unless_it_asks_ignore_eos() -> None:
    """The issue's defect: a plain client, which lists no stop tokens, ran on past EOS."""
    hf = tiny_hf_model("qwen2")
    ids = _greedy_alone(hf, PROMPT, 12)
    new = [i for i in range(1, 12) if ids[i] not in ids[:i]]  # first met there
    j, k = new[0], new[1]  # a stop token listed, and the end token, met later
    with _served(hf, eos_token_ids=(ids[k],)) as served:
        plain = _choice(_generate(served.url, PROMPT, temperature=0, max_tokens=12))
        assert (plain["token_ids"], plain["finish_reason"]) == (ids[: k + 1], "stop")
        # vLLM's: a request's stop_token_ids are added to the end tokens, even an empty list.
        for listed in ([], [ids[k]]):
            choice = _choice(_generate(served.url, PROMPT, temperature=0, max_tokens=12,
                                       stop_token_ids=listed))
            assert choice["token_ids"] == ids[: k + 1]
        earlier = _choice(_generate(served.url, PROMPT, temperature=0, max_tokens=12,
                                    stop_token_ids=[ids[j]]))
        assert earlier["token_ids"] == ids[: j + 1] and earlier["finish_reason"] == "stop"
        on = _choice(_generate(served.url, PROMPT, temperature=0, max_tokens=12,
                               ignore_eos=True))
        assert (on["token_ids"], on["finish_reason"]) == (ids, "length")


# ---- stop strings ---------------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_a_stop_string_ends_the_completion_once_its_decoded_text_holds_it(
        tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool) -> None:
    hf = tiny_hf_model("qwen2")
    ids = _greedy_alone(hf, PROMPT, 12)
    text = lambda n: tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)  # noqa: E731
    full = text(12)
    stop = next(full[j : j + 2] for j in range(2, len(full) - 1)
                if full[j : j + 2] not in text(j))  # spans two tokens, first met late
    n = next(n for n in range(1, 13) if stop in text(n))
    assert n < 12
    with _served(hf, tokenizer=tokenizer) as served:
        for asked in ([stop, "~~"], stop):  # a list, or one string ("~" is not in the vocabulary)
            choice = _choice(_generate(served.url, PROMPT, temperature=0, max_tokens=12,
                                       ignore_eos=True, stop=asked,
                                       skip_special_tokens=skip_special_tokens))
            # vLLM's: the tokens stay whole (the one completing the string included).
            assert (choice["token_ids"], choice["finish_reason"]) == (ids[:n], "stop")
        empty = _generate(served.url, PROMPT, stop=[stop, ""])
        assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]


def test_stop_strings_without_a_tokenizer_are_refused() -> None:
    with _served(tiny_hf_model("qwen2")) as served:
        answer = _generate(served.url, PROMPT, stop=["ab"])
        assert answer.status_code == 400 and "stop" in answer.json()["error"]["message"]


# ---- seed -----------------------------------------------------------------------------------


def test_a_seed_gives_the_same_completion_whatever_shares_its_batch() -> None:
    hf = tiny_hf_model("qwen2")
    with _served(hf) as served:
        ask = lambda seed, prompt=PROMPT: _choice(_generate(  # noqa: E731
            served.url, prompt, temperature=1.5, max_tokens=16, seed=seed, ignore_eos=True))
        alone = ask(7)
        assert ask(7) == alone
        with ThreadPoolExecutor(4) as pool:  # in a batch with three others
            others = [pool.submit(ask, None, [3 + i, 4, 5]) for i in range(3)]
            batched = ask(7)
            [o.result() for o in others]
        assert batched["token_ids"] == alone["token_ids"]
        torch.testing.assert_close(_logprobs(batched), _logprobs(alone), atol=1e-5, rtol=0)
        assert any(ask(s)["token_ids"] != alone["token_ids"] for s in (8, 9, 10))
        assert len({tuple(ask(None)["token_ids"]) for _ in range(3)}) > 1  # no seed: fresh draws


# ---- min_p and repetition_penalty: the distribution, and the reported log-probs --------------


def _reference_logprobs(hf: torch.nn.Module, prompt: list[int], ids: list[int],
                        temperature: float, min_p: float, penalty: float) -> torch.Tensor:
    """Per token, log p under transformers' own processors in vLLM's order: repetition
    penalty on the logits (prompt and tokens so far), then temperature, then min-p."""
    seq = torch.tensor([prompt + ids])
    logits = hf(seq).logits[0, len(prompt) - 1 : -1]
    rows = []
    for t, row in enumerate(logits):
        row = RepetitionPenaltyLogitsProcessor(penalty)(seq[:, : len(prompt) + t], row[None])
        if temperature > 0:
            row = MinPLogitsWarper(min_p)(None, row / temperature)
        rows.append(row[0].log_softmax(-1)[ids[t]])
    return torch.stack(rows)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_min_p_and_repetition_penalty_shape_the_sampling_and_its_logprobs(
        temperature: float) -> None:
    hf = tiny_hf_model("qwen2")
    with _served(hf) as served, torch.no_grad():
        for seed in range(3):
            choice = _choice(_generate(served.url, PROMPT, temperature=temperature, min_p=0.2,
                                       repetition_penalty=1.8, max_tokens=16, ignore_eos=True,
                                       seed=seed))
            ids, got = choice["token_ids"], _logprobs(choice)
            want = _reference_logprobs(hf, PROMPT, ids, temperature, 0.2, 1.8)
            plain = _reference_logprobs(hf, PROMPT, ids, temperature, 0.0, 1.0)
            assert (want - plain).abs().max() > 1e-2  # the fields change what is reported
            assert torch.isfinite(want).all()  # every token sampled is in the kept set
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


# ---- fields: honoured, without effect, or refused by name ------------------------------------


@pytest.mark.parametrize("fields,named", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.1, "min_tokens": 3}, "frequency_penalty', 'min_tokens"),
    ({"logit_bias": {"3": 5.0}}, "logit_bias"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"),
])
def test_a_field_not_honoured_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with _served(tiny_hf_model("qwen2")) as served:
        answer = _generate(served.url, PROMPT, **fields)
        assert answer.status_code == 400 and named in answer.json()["error"]["message"]


def test_fields_without_effect_or_at_their_default_are_accepted() -> None:
    with _served(tiny_hf_model("qwen2")) as served:
        answer = _generate(served.url, PROMPT, max_tokens=3, logprobs=1, presence_penalty=0,
                           frequency_penalty=0.0, min_tokens=0, logit_bias=None, seed=None,
                           include_stop_str_in_output=True, routed_experts_prompt_start=4,
                           spaces_between_special_tokens=False, detokenize=True)
        assert len(_choice(answer)["token_ids"]) == 3


def test_a_field_the_engine_cannot_honour_is_refused_when_set() -> None:
    with _served(tiny_hf_model("qwen2"), refused={"seed"}) as served:
        answer = _generate(served.url, PROMPT, seed=3)
        assert answer.status_code == 400 and "seed" in answer.json()["error"]["message"]
        assert _generate(served.url, PROMPT, max_tokens=2).status_code == 200


# ---- the URL file ---------------------------------------------------------------------------


def test_the_url_file_names_the_endpoint_while_it_serves_and_goes_when_it_closes(
        tmp_path: Path) -> None:
    where = tmp_path / "endpoints" / "actor_0"
    first = GenerateEndpoint(model="tiny", max_model_len=MAX_LEN, vocab_size=VOCAB,
                             default_max_tokens=8, url_file=where)
    assert where.read_text() == first.url + "\n"
    assert requests.get(f"{where.read_text().strip()}/v1/models", timeout=10).ok
    # A restarted actor's endpoint replaces it; the old one, closing late, leaves it alone.
    second = GenerateEndpoint(model="tiny", max_model_len=MAX_LEN, vocab_size=VOCAB,
                              default_max_tokens=8, url_file=where)
    first.close()
    assert where.read_text() == second.url + "\n"
    second.close()
    assert not where.exists()


def test_an_actor_that_stops_removes_its_url_file(tmp_path: Path) -> None:
    where = tmp_path / "endpoints" / "actor_0"
    endpoint = GenerateEndpoint(model="tiny", max_model_len=MAX_LEN, vocab_size=VOCAB,
                                default_max_tokens=8, url_file=where)
    done = threading.Event()
    actor = make_actor(_engine(tiny_hf_model("qwen2")), FakeTask(),
                       Schedule(batch_size=4, group_size=4, max_lag=100), endpoint=endpoint,
                       should_stop=stop_after(60, done.is_set))
    thread = threading.Thread(target=actor.run)
    thread.start()
    try:
        assert len(_choice(_generate(where.read_text().strip(), [1, 2], max_tokens=3))
                   ["token_ids"]) <= 3
    finally:
        done.set()
        thread.join(30)
    assert not where.exists()


def test_a_process_that_ends_without_closing_its_endpoint_removes_its_url_file(
        tmp_path: Path) -> None:
    where = tmp_path / "actor_0"
    script = ("import sys; from pathlib import Path; from pipelinerl.rollouts.endpoint import "
              "GenerateEndpoint; e = GenerateEndpoint(model='m', max_model_len=8, "
              "vocab_size=8, default_max_tokens=2, url_file=Path(sys.argv[1])); "
              "assert Path(sys.argv[1]).read_text() == e.url + '\\n'; "
              "raise SystemExit('a setup step failed')")
    proc = subprocess.run([sys.executable, "-c", script, str(where)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "a setup step failed" in proc.stderr, proc.stderr
    assert not where.exists()


def test_open_endpoint_serves_the_models_end_tokens_and_publishes_its_url(
        tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    cfg = Config(output_dir=str(tmp_path), name="run", actor=ActorConfig(endpoint_port=0))
    endpoint = open_endpoint(cfg, 0, tokenizer, (tokenizer.eos_token_id,))
    assert endpoint is not None
    where = cfg.run_dir / "endpoints" / "actor_0"
    try:
        assert where.read_text() == endpoint.url + "\n"
        assert endpoint.eos_token_ids == (tokenizer.eos_token_id,)
        assert endpoint.vocab_size == len(tokenizer)
    finally:
        endpoint.close()
    assert not where.exists()
