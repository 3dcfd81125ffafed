"""Environments written for verifiers (0.4.0, installed): loaded by id, refused at start when
they need what cannot run here, their episodes run against the actor's generate endpoint on a
real engine, and their traces turned into samples whose tokens, log-probs and per-token
versions are the engine's own. The model is tiny and random (a chat template, no hub)."""

from __future__ import annotations

import json
import random
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_actor import make_actor, stop_after
from test_endpoint import _Driver
from test_prompts import SPECIAL, TEMPLATE, instruct_tokenizer

from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.envs.verifiers.episodes import EpisodeRunner, FinishedGroup
from pipelinerl.models.hf import load_tokenizer
from pipelinerl.roles.actor import Schedule
from pipelinerl.rollouts.endpoint import GenerateEndpoint
from pipelinerl.tasks import make_task
from pipelinerl.types import (
    ENV_VERSION,
    GenerationOutput,
    Group,
    Sample,
    SamplingParams,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MAX_LEN = 512


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # llama: verifiers' renderer loads the tokenizer with AutoTokenizer, which for a qwen2
    # config picks Qwen2Tokenizer, whose byte-level splitting drops this char vocabulary's
    # whitespace; for llama it keeps the tokenizer as saved.
    # Its EOS is <|im_end|>, as in SmolLM2's or Qwen2.5-Instruct's tokenizer: verifiers stops a
    # turn at the EOS and re-renders it closed by <|im_end|>; a turn that stopped at another
    # token would not be a prefix of the next turn's prompt (a new branch).
    # A sampled special token other than the EOS is dropped when the renderer re-renders the
    # turn, so the episode branches (vf_branches, counted): their logits are set to 0 here,
    # which greedy decoding never picks over ~100 random ones.
    out = instruct_tokenizer(tmp_path_factory.mktemp("chat"), arch="llama")
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    weights = load_file(out / "model.safetensors")
    tokenizer = load_tokenizer(out)
    for token in ("<|endoftext|>", "<|im_start|>"):
        weights["lm_head.weight"][tokenizer.convert_tokens_to_ids(token)] = 0.0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


PARAGRAPH = "\n\n"
LINE_DIM = 0  # the paragraph model's residual dimension that marks a "\n" read


@pytest.fixture(scope="module")
def paragraph_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chat model's tokenizer with one more token, "\n\n", that encoding never makes (it
    splits every character): a sampled "\n\n" comes back as "\n", "\n" when verifiers' generic
    renderer rebuilds the turn from its text, as SmolLM2's does with its 1116 -> 198, 198. The
    model samples it about where it would a space, and always right after a "\n": the chat
    template's assistant header ends with one, so every turn opens with "\n\n" and every
    episode with a second turn branches. Not left to the sampler: the engine draws each step's
    noise for the whole batch, so what a call samples depends on which calls share its steps,
    that is on when the episodes' concurrent calls arrive."""
    from tiny_models import tiny_hf_model
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pipelinerl.models.hf import save_model

    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate([*SPECIAL, *chars, PARAGRAPH])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    model = tiny_hf_model("llama", vocab_size=len(vocab), max_position_embeddings=1024,
                          eos_token_id=2, bos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        head = model.lm_head.weight
        for token in ("<|endoftext|>", "<|im_start|>"):  # no other special token: see above
            head[vocab[token]] = 0.0
        head[vocab[PARAGRAPH]] = 1.3 * head[vocab[" "]]
        # One residual dimension only a "\n" writes (no other embedding, no layer output), so
        # large that it dominates the final norm there, and only "\n\n" reads: after a "\n"
        # its logit leads every other by > 150 (another is drawn with odds below e^-150);
        # elsewhere that dimension is 0 and "\n\n" is drawn as above.
        model.model.embed_tokens.weight[:, LINE_DIM] = 0.0
        model.model.embed_tokens.weight[vocab["\n"], LINE_DIM] = 1000.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[LINE_DIM] = 0.0
            layer.mlp.down_proj.weight[LINE_DIM] = 0.0
        head[:, LINE_DIM] = 0.0
        head[vocab[PARAGRAPH], LINE_DIM] = 20.0
    return save_model(model, tokenizer, tmp_path_factory.mktemp("paragraph") / "model")


@pytest.fixture
def in_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user runs them: from the examples folder, which holds the env modules."""
    monkeypatch.chdir(EXAMPLES)
    monkeypatch.syspath_prepend(str(EXAMPLES))


class Served:
    """An engine serving its endpoint from a thread (the actor loop's part for it)."""

    def __init__(self, model_dir: Path, capacity: int = 4) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = TorchEngine.from_pretrained(
            model_dir, EngineOptions(capacity=capacity, max_seq_len=MAX_LEN, seed=3))
        self.endpoint = GenerateEndpoint(model="chat", max_model_len=MAX_LEN,
                                         vocab_size=len(self.tokenizer), default_max_tokens=16)
        self.driver = _Driver(self.engine, self.endpoint)
        self.model_dir = model_dir

    def runner(self, task: Any, **sampling: Any) -> EpisodeRunner:
        return EpisodeRunner(task, endpoint_url=self.endpoint.url, model="chat",
                             tokenizer_path=str(self.model_dir),
                             sampling=SamplingParams(**{"max_new_tokens": 12, **sampling}),
                             take_answers=self.endpoint.take_session)

    def close(self) -> None:
        self.driver.stop()
        self.endpoint.close()


@pytest.fixture
def served(chat_model: Path) -> Iterator[Served]:
    s = Served(chat_model)
    yield s
    s.close()


def _finish(runner: EpisodeRunner, timeout_s: float = 120) -> FinishedGroup:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = runner.poll()
        if done:
            return done[0]
        time.sleep(0.02)
    raise AssertionError("no group finished")


def _engine_output(served: Served, token_ids: list[int]) -> GenerationOutput:
    (out,) = [o for o in served.driver.outputs if o.token_ids == token_ids]
    return out


def test_single_turn_episodes_become_samples_with_the_engines_tokens_logprobs_and_versions(
        served: Served, in_examples: None) -> None:
    task = make_task("verifiers:vf_qa", {})
    assert len(task.tasks) == 100 and task.name == "verifiers:vf_qa"
    # A weight update lands between two decode steps, in the middle of the episodes.
    hf = {k: v.clone() for k, v in served.engine.model.state_dict().items()}
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.items()}
    served.driver.between[4] = lambda: served.engine.load_weights(new, version=1)
    runner = served.runner(task)
    try:
        problem = task.problem(7)
        runner.start("g0", problem, 3)
        finished = _finish(runner)
    finally:
        runner.close()
    assert finished.group_id == "g0" and finished.reason == "" and len(finished.samples) == 3
    from vf_qa import final_answer

    versions = set()
    for s in finished.samples:
        assert s.model_mask is None and s.turns == 1  # every token after the prompt is sampled
        out = _engine_output(served, s.token_ids)
        # What the trainer conditions on is what the engine did, token for token.
        assert s.prompt_ids == out.prompt_ids and s.prompt_ids[0] == 1  # <|im_start|>
        assert s.logprobs == out.logprobs and s.versions == out.versions  # exact, per token
        versions |= set(s.versions)
        text = served.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        assert s.reward == float(final_answer(text) == task.tasks[7].data.answer)
        # the engine's own verdict (a token that is a stop token elsewhere, sampled last
        # under a request that did not name it, ends the turn by length)
        assert s.finish_reason == out.finish_reason
    assert versions == {0, 1}  # the update reached tokens of these episodes
    assert served.endpoint._sessions == {}  # every answer collected


def test_multi_turn_episodes_mark_the_hosts_tokens_as_fed_never_trained(
        served: Served, in_examples: None) -> None:
    task = make_task("verifiers:vf_guess", {"games": 8})
    runner = served.runner(task, max_new_tokens=6, temperature=0.0)  # no special token
    try:
        runner.start("g1", task.problem(2), 2)
        finished = _finish(runner)
    finally:
        runner.close()
    assert finished.reason == "", finished
    for s in finished.samples:
        mask = s.model_mask
        assert mask is not None and s.turns >= 2  # a random model rarely guesses at once
        host = [t for t, m in zip(s.token_ids, mask) if not m]
        assert "Guess again." in served.tokenizer.decode(host)
        assert all(v == ENV_VERSION and lp == 0.0
                   for v, lp, m in zip(s.versions, s.logprobs, mask) if not m)
        # Each model turn is one engine output, with its log-probs (greedy: both episodes
        # sample the same turns, so either one's output).
        turns, run = [], []
        for t, lp, m in zip(s.token_ids, s.logprobs, mask):
            if m:
                run.append((t, lp))
            elif run:
                turns.append(run)
                run = []
        turns += [run] if run else []
        assert len(turns) == s.turns
        for turn in turns:
            ids, lps = [t for t, _ in turn], [lp for _, lp in turn]
            assert any(o.token_ids == ids and o.logprobs == lps for o in served.driver.outputs)


def test_an_actor_publishes_whole_groups_of_episodes_under_admission(
        served: Served, in_examples: None) -> None:
    task = make_task("verifiers:vf_qa", {})
    runner = served.runner(task)
    served.driver.stop()  # the actor's own loop drives the engine and the endpoint now
    schedule = Schedule(batch_size=4, group_size=2, max_lag=0)  # 2 groups may ever start
    actor = make_actor(served.engine, task, schedule, endpoint=served.endpoint, episodes=runner,
                       should_stop=stop_after(120), engine_cfg={"max_seq_len": MAX_LEN})
    actor.run(max_groups=2)
    groups = actor.streams.writer.records
    assert [len(g["samples"]) for g in groups] == [2, 2]
    assert {g["group_id"] for g in groups} == {"a0-g0", "a0-g1"} and actor.claimed() == 2
    for g in groups:
        assert {s["group_id"] for s in g["samples"]} == {g["group_id"]}
        assert g["prompt"] in {t.data.prompt for t in task.tasks}


def _trained_turns(s: Sample) -> list[tuple[list[int], list[float], list[int]]]:
    """The runs of a sample's trained tokens (each a model turn), with log-probs and versions."""
    mask = s.model_mask or [True] * len(s.token_ids)
    turns, run = [], []
    for tok, lp, v, m in [*zip(s.token_ids, s.logprobs, s.versions, mask), (0, 0.0, 0, False)]:
        if m:
            run.append((tok, lp, v))
        elif run:
            turns.append(tuple(list(x) for x in zip(*run)))
            run = []
    return turns


def test_an_episode_that_branches_trains_as_one_sample_per_branch(
        paragraph_model: Path, in_examples: None, tmp_path: Path) -> None:
    """The issue's two-turn case: a sampled "\n\n" re-rendered as "\n", "\n" in the second
    turn's prompt branches the trace. Before, the group was dropped (vf_branches): here the
    branched episode gives a sample per branch, every model turn trained once with the
    engine's log-probs and versions, and the trainer takes the group as 4 attempts."""
    from pipelinerl.config import load_config
    from pipelinerl.models.hf import load_model
    from pipelinerl.rl.advantages import groups_advantages
    from pipelinerl.rl.batches import BatchSource
    from pipelinerl.rl.step import rl_step
    from pipelinerl.streams import open_reader, open_writer

    task = make_task("verifiers:vf_guess", {"games": 8, "env": {"player": {"max_turns": 2}}})
    served = Served(paragraph_model)
    runner = served.runner(task, max_new_tokens=6, temperature=1.0)
    try:
        runner.start("g", task.problem(1), 4)
        finished = _finish(runner)
    finally:
        runner.close()
        served.close()
    assert finished.reason == "", finished
    samples = finished.samples
    by_episode = {e: [s for s in samples if s.episode == e] for e in range(4)}
    assert sum(map(len, by_episode.values())) == len(samples)
    branched = [ss for ss in by_episode.values() if len(ss) > 1]
    assert branched and runner.stats() == {"vf_branched_episodes": len(branched),
                                           "vf_branch_samples": sum(map(len, branched))}
    # Every model turn (one engine output each) is trained once, in one sample, as sampled.
    outputs = [(o.token_ids, o.logprobs, o.versions) for o in served.driver.outputs]
    assert sorted(t for s in samples for t in _trained_turns(s)) == sorted(outputs)
    paragraph = served.tokenizer.convert_tokens_to_ids(PARAGRAPH)
    for first, second in (sorted(ss, key=lambda s: len(s.prompt_ids)) for ss in branched):
        assert (first.reward, first.finish_reason) == (second.reward, second.finish_reason)
        assert paragraph in first.token_ids and first.turns == second.turns == 1
        # The second branch feeds the first turn as the renderer rebuilt it: same text,
        # other tokens, never trained.
        rebuilt = served.tokenizer.decode(second.prompt_ids)
        assert served.tokenizer.decode(first.token_ids) in rebuilt
        assert paragraph not in second.prompt_ids
    # The trainer takes the group as group_size attempts and trains every branch.
    with open_writer("local", stream="rollouts", writer_id="actor_0", root=tmp_path) as w:
        w.write(Group("g", "p", samples).to_dict())
    source = BatchSource(open_reader("local", stream="rollouts", root=tmp_path),
                         group_size=4, max_lag=2, timeout_s=5.0)
    (group,) = source.take(1, step=0)
    assert source.dropped == {} and len(group.samples) == len(samples)
    advantages = groups_advantages([group])
    for ss in by_episode.values():
        idx = [samples.index(s) for s in ss]
        assert len({float(advantages[i]) for i in idx}) == 1
    cfg = load_config(None, [f"model.path={paragraph_model}", "actor.group_size=4",
                             "trainer.batch_size=4", "engine.temperature=1.0"])
    model = load_model(paragraph_model)
    metrics = rl_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [group], cfg,
                      trainer_version=0)
    assert sum(metrics["lag_hist"].values()) == sum(len(o[0]) for o in outputs)
    # The loss divides by every branch: more samples than trainer.batch_size.
    assert metrics["samples"] == len(samples) > 4


def test_the_baseline_counts_a_branched_episode_once_and_gives_its_branches_its_advantage(
        ) -> None:
    from pipelinerl.rl.advantages import groups_advantages

    def sample(reward: float, episode: int) -> Sample:
        return Sample([1], [2], [-0.5], [0], reward, reward > 0, "stop", episode=episode)

    # Episode 0 (reward 1) branched into two samples; episodes 1 and 2 got 0. The baseline is
    # the mean over 3 episodes (1/3), not over 4 samples (1/2).
    group = Group("g", "p", [sample(1.0, 0), sample(0.0, 1), sample(1.0, 0), sample(0.0, 2)])
    assert groups_advantages([group]).tolist() == pytest.approx([2 / 3, -1 / 3, 2 / 3, -1 / 3])
    loo = groups_advantages([group], baseline="loo")
    assert loo.tolist() == pytest.approx([1.0, -0.5, 1.0, -0.5])
    # vcpo: the episode's importance weight is its branches' product (log weights summed):
    # log w = (0.3 + 0.4, 0.0, 0.0) -> baseline = sum w^2 r / sum w^2.
    log_w = torch.tensor([0.3, 0.0, 0.4, 0.0], dtype=torch.float64)
    w2 = torch.tensor([1.4, 0.0, 0.0]).exp()
    baseline = float(w2[0] / w2.sum())
    vcpo = groups_advantages([group], baseline="vcpo", log_weights=log_w)
    assert vcpo.tolist() == pytest.approx([1 - baseline, -baseline, 1 - baseline, -baseline])


@pytest.mark.parametrize("env,params,reason", [
    ("vf_raising", {}, "vf_error"),
    ("vf_hanging", {"episode_timeout_s": 1}, "vf_timeout"),
])
def test_a_failing_environment_drops_its_group_counted(
        served: Served, env: str, params: dict, reason: str) -> None:
    task = make_task(f"verifiers:{env}", params)
    runner = served.runner(task)
    served.driver.stop()
    schedule = Schedule(batch_size=2, group_size=2, max_lag=0)
    actor = make_actor(served.engine, task, schedule, endpoint=served.endpoint, episodes=runner,
                       should_stop=stop_after(8), engine_cfg={"max_seq_len": MAX_LEN})
    actor.run()
    records = actor.streams.writer.records
    assert records == [] or all(r.get("heartbeat") for r in records)
    # One place may ever be used (max_lag 0, one group a step): a second group could start
    # only because the first, dropped, gave its place back.
    assert actor.stats.skipped[reason] >= 2


@pytest.mark.parametrize("env,params,reason", [
    # past the group's deadline (set below), the endpoint holding the first turn's answer
    ("vf_stalling", {"episode_timeout_s": 60}, "vf_timeout"),
    # retried once (the first attempt's trace is no episode's any more), then dropped
    ("vf_host_raising", {"env": {"retries": {"max_retries": 1}}}, "vf_error"),
])
def test_a_dropped_group_leaves_no_answer_kept_in_the_endpoint(
        served: Served, env: str, params: dict, reason: str) -> None:
    task = make_task(f"verifiers:{env}", params)
    runner = served.runner(task)
    # The stalling env's group ends at this deadline, after both first turns were answered:
    # 3 s raced those answers on a loaded machine (a failure seen at load 6).
    runner.group_timeout_s = 8.0
    try:
        runner.start("g", task.problem(0), 2)
        finished = _finish(runner)
    finally:
        runner.close()
    assert finished.samples is None and finished.reason == reason
    answered = {"vf_stalling": 2, "vf_host_raising": 4}[env]  # a turn per episode's attempt
    assert len(served.driver.outputs) == answered
    # Before, only the trained-on traces' answers were taken: a group past its deadline kept
    # all of its answers, a retried one its first attempts', until 4096 sessions evicted them.
    assert served.endpoint._sessions == {}


@pytest.mark.parametrize("name,params,message", [
    ("verifiers:", {}, "name the environment"),
    ("verifiers:no_such_env", {}, "no_such_env"),
    ("verifiers:vf_qa", {"nope": 1}, "nope"),
    ("verifiers:vf_qa", {"env": {"agent": {"harness": {"id": "bash"}}}},
     "harness 'bash', a program that needs uv"),
    ("verifiers:vf_qa", {"env": {"agent": {"runtime": {"type": "docker"}}}}, "runtime 'docker'"),
    ("verifiers:vf_qa", {"task": {"judges": [{"id": "reference"}]}}, "LLM judges"),
    ("verifiers:vf_qa", {"env": {"id": "agentic-judge"}}, "verifiers:vf_qa"),
    ("verifiers:vf_qa", {"episode_timeout_s": 0}, "episode_timeout_s"),
])
def test_bad_names_params_and_environments_are_refused_at_start_naming_why(
        in_examples: None, name: str, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as err:
        make_task(name, params)
    assert str(err.value).startswith(f"task {name!r}")


def test_held_out_evaluation_runs_episodes_on_one_version_and_counts_every_attempt(
        chat_model: Path, in_examples: None) -> None:
    from pipelinerl.config import load_config
    from pipelinerl.roles.heldout import build_eval_setup

    cfg = load_config(None, [
        f"model.path={chat_model}", "task.name=verifiers:vf_qa", "task.heldout_frac=0.2",
        "eval.num_problems=4", "eval.samples=2", "eval.temperature=1.0",
        "engine.max_seq_len=512", "engine.max_new_tokens=12", "engine.capacity=4",
        "actor.group_size=2", "trainer.batch_size=4"])
    setup, engine = build_eval_setup(cfg, str(chat_model))
    try:
        assert setup.scorer is None and len(setup.problems) == 4
        metrics = setup.run(engine)
    finally:
        setup.close()
    assert metrics["eval/num_problems"] == 4
    assert metrics["eval/greedy/verifier_failures"] == metrics["eval/sampled/verifier_failures"] == 0
    assert 0 <= metrics["eval/greedy"] <= 1 and 0 <= metrics["eval/sampled/pass@1"] <= 1
    assert metrics["eval/greedy/completion_len"] > 0


def test_the_envs_own_evaluation_split_is_the_held_out_set(
        chat_model: Path, in_examples: None, tmp_path: Path) -> None:
    """Before, the held-out set could only be a hash of the training tasks' keys: an env's
    test split (here the taskset read from another file) could not be evaluated on."""
    from pipelinerl.config import load_config
    from pipelinerl.roles.heldout import build_eval_setup
    from pipelinerl.tasks import TrainSplit, heldout_problems, make_train_task

    split = tmp_path / "test.jsonl"
    rows = [{"question": f"What is {a} times 2?", "answer": str(2 * a)} for a in range(3)]
    split.write_text("".join(json.dumps(row) + "\n" for row in rows))
    params = {"eval_taskset": {"path": str(split)}}
    heldout = {f"What is {a} times 2? Answer with just the answer." for a in range(3)}
    train = make_train_task("verifiers:vf_qa", params, heldout_frac=0.2)
    assert not isinstance(train, TrainSplit) and train.train_size == 100
    rng = random.Random(0)
    drawn = {train.sample_problem(rng).prompt for _ in range(300)}
    assert len(drawn) > 90 and drawn.isdisjoint(heldout)  # every training task, no held-out one
    assert {p.prompt for p in heldout_problems(train, 10, 0, 0.2)} == heldout
    cfg = load_config(None, [
        f"model.path={chat_model}", "task.name=verifiers:vf_qa", "task.heldout_frac=0.2",
        f"task.params.eval_taskset.path={split}", "eval.num_problems=8", "eval.samples=1",
        "engine.max_seq_len=512", "engine.max_new_tokens=8", "engine.capacity=4",
        "actor.group_size=2", "trainer.batch_size=4"])
    setup, engine = build_eval_setup(cfg, str(chat_model))
    try:
        assert {p.prompt for p in setup.problems} == heldout
        metrics = setup.run(engine)  # the split's tasks run as episodes of the env
    finally:
        setup.close()
    assert metrics["eval/num_problems"] == 3 and metrics["eval/greedy/verifier_failures"] == 0
    with pytest.raises(ValueError, match="bad config: taskset.nope"):
        make_task("verifiers:vf_qa", {"eval_taskset": {"nope": 1}})


def _cli(tmp_path: Path, config: str, *overrides: str, timeout: float = 900
         ) -> subprocess.CompletedProcess:
    """`pipelinerl train` from the examples folder, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", config, f"output_dir={tmp_path}",
         "metrics.progress=false", "metrics.plot=false", *overrides],
        capture_output=True, text=True, timeout=timeout, cwd=EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("config,extra", [
    ("vf_qa.yaml", ()),
    # Two turns, short ones: the multi-turn path in a CI's budget.
    ("vf_guess.yaml", ("task.params.games=40", "task.params.env.player.max_turns=2",
                       "engine.max_new_tokens=8")),
])
def test_examples_train_and_evaluate_through_the_cli_on_a_tiny_model_with_smollm2s_template(
        tmp_path: Path, tiny_smollm2_dir: Path, config: str, extra: tuple[str, ...]) -> None:
    """The example as a user runs it, its model swapped for a tiny one with SmolLM2's
    tokenizer and template: the environment, the roles and the records end to end (what
    SmolLM2 itself does in them: tests/test_real_model.py)."""
    proc = _cli(tmp_path, config, "name=vf", f"model.path={tiny_smollm2_dir}",
                "trainer.max_steps=3", "trainer.max_time_s=0",
                "trainer.batch_size=8", "actor.group_size=4", "engine.capacity=8",
                "actor.drop_zero_variance=false", "eval.num_problems=4", "eval.samples=2",
                *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "vf"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    evals = {r["eval/version"]: r for r in rows if "eval/version" in r}
    assert {0, 3} <= set(evals)
    assert all(r["eval/greedy/verifier_failures"] == 0 for r in evals.values())
    for log in ("actor_0.log", "evaluator.log"):  # no INFO line per model call
        text = (run_dir / "logs" / log).read_text()
        assert "rollout start" not in text and "HTTP Request" not in text, log
    audit = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "audit", str(run_dir)],
                           capture_output=True, text=True, timeout=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr


@pytest.mark.slow
def test_an_environment_that_cannot_run_here_is_refused_by_the_cli_in_one_line(
        tmp_path: Path) -> None:
    proc = _cli(tmp_path, "vf_qa.yaml", "task.params.env.agent.harness.id=bash", timeout=300)
    assert proc.returncode != 0 and not (tmp_path / "smollm2-vf-qa").exists()
    assert "harness 'bash', a program that needs uv" in proc.stderr
    assert "Traceback" not in proc.stderr
