"""Episodes of a verifiers environment, run against the actor's generate endpoint, turned into
the samples pipelinerl trains on.

Episodes run on one event loop per process, on a thread of its own (verifiers' renderer client
binds module-level asyncio locks to the first loop that uses them: a second loop in the process
would fail its model calls). A runner holds the env's serving resources (its interception
server) there for the actor's life. The actor starts a group (`start`: n episodes
of one task) and collects finished groups (`poll`); meanwhile each episode's model calls reach
the actor's engine through the endpoint (harness -> interception -> TrainClient -> endpoint),
joining its continuous batching like the actor's own requests.

A trace keeps each turn's tokens, mask and log-probs but not which policy version sampled them:
the endpoint keeps every answer under the trace's id (TrainClient's `X-Session-ID`), and each
sampled turn is matched to the next answer with the same tokens. Every trace a group mints (a
retried attempt's too) has its answers taken when the group ends, trained, dropped or timed
out, so the endpoint keeps none of them.

A trace branches when a later turn's prompt does not extend the earlier turns token for token:
a renderer that rebuilds the conversation from its text re-tokenizes a sampled turn (SmolLM2's
generic renderer turns a sampled "\n\n" into "\n", "\n"), or strips a special token the policy
sampled. Each branch is what the model saw for its turns, so, as verifiers' trace model intends,
an episode trains as one sample per branch: its fed tokens (prompt, host, a re-rendered turn)
never trained, each sampled turn trained once, in the first branch holding it, with its own
log-probs and versions. The episode's samples share its reward and its index in the group
(`Sample.episode`), so the group's baseline counts each episode once (`rl.advantages`).

A group is dropped, with its reason counted, when any of its episodes fails (an error, the
deadline, no model token, a turn with no answer, more than one trainable trace): the baseline
needs every attempt.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from pipelinerl.config import Config
from pipelinerl.envs.verifiers.task import VerifiersTask
from pipelinerl.rollouts.endpoint import Answer, GenerateEndpoint
from pipelinerl.rollouts.generation import sampling_from_config
from pipelinerl.tasks.base import Problem
from pipelinerl.types import ENV_VERSION, Sample, SamplingParams

log = logging.getLogger(__name__)

QUIET_LOGGERS = ("httpx", "verifiers", "aiohttp.access")
# After a group ends, when its sessions' answers are taken a second time (see `_group`).
RETAKE_S = 10.0


@dataclass
class FinishedGroup:
    group_id: str
    # None: dropped. An episode that branched gives several (`EpisodeRunner.samples`).
    samples: list[Sample] | None
    reason: str = ""  # why it was dropped (a skip reason, `vf_...`)


class EpisodeFailed(Exception):
    """One episode cannot be trained on; `reason` is the counted skip."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class EpisodeRunner:
    def __init__(self, task: VerifiersTask, *, endpoint_url: str, model: str,
                 tokenizer_path: str, sampling: SamplingParams,
                 take_answers: Callable[[str], list[Answer]], actor_id: int = 0) -> None:
        """`model`: the name the endpoint serves; `tokenizer_path`: the model's directory,
        where verifiers' renderer finds the tokenizer and chat template."""
        import verifiers.v1 as vf

        self.task = task
        self.take_answers = take_answers
        self.actor_id = actor_id
        self.model = model
        self.client = vf.TrainClientConfig(base_url=f"{endpoint_url}/v1",
                                           renderer_model_name=tokenizer_path,
                                           api_key_var="PIPELINERL_ENDPOINT_KEY")
        self.sampling = sampling
        # verifiers' own deadlines (each agent's rollout, the env's run) end an episode first;
        # this ends a group whose scoring or teardown hangs.
        self.group_timeout_s = task.episode_timeout_s + 30
        self._done: queue.Queue[FinishedGroup] = queue.Queue()
        self._running: set[asyncio.Task] = set()
        self._loop = _episode_loop()
        self._ready = threading.Event()
        self._stop = asyncio.Event()
        self._warned: set[str] = set()
        self._serving_env = False
        self.branched_episodes = 0  # counted on the episode loop, read by the actor (`stats`)
        self.branch_samples = 0
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self._ready.wait()
        if not self._serving_env:
            error = self._serving.exception(timeout=30)
            raise RuntimeError(f"task {task.name!r}: starting the environment's serving "
                               f"raised {type(error).__name__}: {error}") from error

    # -- the actor's side -------------------------------------------------------------------
    def start(self, group_id: str, problem: Problem, n: int,
              sampling: SamplingParams | None = None) -> None:
        """Run `n` episodes of `problem`'s task (sampled as `sampling` says, else as the
        runner's default); the group comes back from `poll`."""
        ctx = self._context(sampling or self.sampling)
        self._loop.call_soon_threadsafe(self._launch, group_id, self.task.vf_task(problem), n,
                                        ctx)

    def _context(self, sampling: SamplingParams) -> Any:
        import verifiers.v1 as vf

        extra = {"top_k": sampling.top_k} if sampling.top_k > 0 else {}
        return vf.ModelContext(model=self.model, client=self.client, sampling=vf.SamplingConfig(
            temperature=sampling.temperature, top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens, **extra))

    def poll(self) -> list[FinishedGroup]:
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def close(self) -> None:
        """Cancel the groups still running and release the env's serving resources."""
        if not self._serving.done():
            self._loop.call_soon_threadsafe(self._stop.set)
            try:
                self._serving.result(30)
            except Exception as e:  # noqa: BLE001 - an env's teardown may raise anything
                log.warning("closing the environment raised %s: %s", type(e).__name__, e)

    # -- on the episode loop ----------------------------------------------------------------
    async def _serve(self) -> None:
        try:
            async with self.task.env.serving():
                self._serving_env = True
                self._ready.set()
                await self._stop.wait()
                for running in list(self._running):
                    running.cancel()
                await asyncio.gather(*self._running, return_exceptions=True)
        finally:
            self._ready.set()  # a failed start is reported by the constructor

    def _launch(self, group_id: str, vf_task: Any, n: int, ctx: Any) -> None:
        running = self._loop.create_task(self._group(group_id, vf_task, n, ctx))
        self._running.add(running)
        running.add_done_callback(self._running.discard)

    async def _group(self, group_id: str, vf_task: Any, n: int, ctx: Any) -> None:
        env = self.task.env
        sessions: list[str] = []  # every trace minted (a retried attempt's too): its answers

        def minted(trace: Any) -> None:
            sessions.append(trace.id)

        gathered = asyncio.gather(*(env.run_slot(slot, ctx, on_trace=minted)
                                    for slot in env.slots(vf_task, n)))
        # Cancelled (the runner closing, the group's deadline), a gather ends with the
        # CancelledError as its exception: read it, or asyncio logs it as never retrieved.
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
        dropped = None
        try:
            episodes = await asyncio.wait_for(gathered, self.group_timeout_s)
        except asyncio.TimeoutError:
            dropped = self._dropped(group_id, "vf_timeout", f"its episodes ran past "
                                    f"{self.group_timeout_s:.0f} s")
        except Exception as e:  # noqa: BLE001 - an env's own code may raise anything
            dropped = self._dropped(group_id, "vf_error", f"{type(e).__name__}: {e}")
        # Every session's answers, the group trained or dropped: the endpoint keeps none. A
        # model call cancelled as the engine finished it is answered just after: taken later.
        answers = self._take(sessions)
        self._loop.call_later(RETAKE_S, self._take, sessions)
        self._done.put(dropped or self._trained(group_id, episodes, answers))

    def _trained(self, group_id: str, episodes: list[Any], answers: dict[str, list[Answer]]
                 ) -> FinishedGroup:
        """The group's samples, or the group dropped if an episode cannot be trained on."""
        try:
            samples = [s for i, e in enumerate(episodes)
                       for s in self.samples(e, group_id, answers, i)]
        except EpisodeFailed as e:
            return self._dropped(group_id, e.reason, str(e))
        except Exception as e:  # noqa: BLE001 - an env's trace may hold anything
            return self._dropped(group_id, "vf_error", f"{type(e).__name__}: {e}")
        self._count_branches(samples)
        return FinishedGroup(group_id, samples)

    def _take(self, sessions: list[str]) -> dict[str, list[Answer]]:
        return {session: self.take_answers(session) for session in sessions}

    def _dropped(self, group_id: str, reason: str, why: str) -> FinishedGroup:
        self._warn_once(reason, f"group {group_id} dropped ({reason}): {why}")
        return FinishedGroup(group_id, None, reason)

    def _count_branches(self, samples: list[Sample]) -> None:
        per_episode = Counter(s.episode for s in samples)
        branched = [k for k in per_episode.values() if k > 1]
        self.branched_episodes += len(branched)
        self.branch_samples += sum(branched)

    def stats(self) -> dict[str, int]:
        """Episodes that branched and trained as several samples, and those samples."""
        return {"vf_branched_episodes": self.branched_episodes,
                "vf_branch_samples": self.branch_samples}

    def _warn_once(self, reason: str, message: str) -> None:
        if reason not in self._warned:  # every one is counted (skipped_<reason>)
            self._warned.add(reason)
            log.warning("%s (further groups dropped for this reason are only counted)", message)

    # -- a finished episode -> its samples ---------------------------------------------------
    def samples(self, episode: Any, group_id: str, answers: dict[str, list[Answer]],
                index: int) -> list[Sample]:
        """The samples of `episode`'s one trainable trace, one per branch with a turn to
        train, each marked as episode `index` of its group (`answers`: the endpoint's, by
        trace id); EpisodeFailed if there is none."""
        if episode.is_timeout:
            raise EpisodeFailed("vf_timeout", _errors(episode.errors) or "past its deadline")
        if not episode.ok:
            raise EpisodeFailed("vf_error", _errors(episode.errors) or "episode not ok")
        traces = [t for t in episode.traces if t.agent.trainable]
        if len(traces) != 1:
            raise EpisodeFailed("vf_trainable_traces", f"{len(traces)} trainable traces in an "
                                "episode; pipelinerl trains envs with one trainable role")
        trace = traces[0]
        if trace.is_timeout:
            raise EpisodeFailed("vf_timeout", f"stopped by {trace.stop_condition}")
        if not trace.ok:
            raise EpisodeFailed("vf_error", _errors(trace.errors) or str(trace.stop_condition))
        sampled_by = _answers_by_node(trace, answers[trace.id])
        trained: set[int] = set()  # sampled nodes a branch already trains
        samples = []
        node_ids = {id(node): nid for nid, node in enumerate(trace.nodes)}
        for branch in (b for b in trace.branches if b.trainable):
            path = [(node_ids[id(node)], node) for node in branch.nodes]  # the trace's nodes
            here = {nid for nid, node in path if nid in sampled_by and nid not in trained}
            if here:
                trained |= here
                samples.append(self._branch_sample(trace, path, here, sampled_by, group_id,
                                                   index))
        if not samples:
            raise EpisodeFailed("vf_no_tokens", f"no model token ({trace.stop_condition})")
        return samples

    def _branch_sample(self, trace: Any, path: list[tuple[int, Any]], train: set[int],
                       sampled_by: dict[int, Answer], group_id: str, episode: int) -> Sample:
        """One branch (`path`: its nodes with their ids) as a sample that trains the sampled
        turns of `train` and feeds every other token."""
        token_ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for nid, node in path:
            token_ids += node.token_ids
            if nid not in train:
                mask += [False] * len(node.token_ids)
                logprobs += [0.0] * len(node.token_ids)
                versions += [ENV_VERSION] * len(node.token_ids)
                continue
            answer, at = sampled_by[nid], 0
            for m in node.mask:
                mask.append(m)
                logprobs.append(answer.logprobs[at] if m else 0.0)
                versions.append(answer.versions[at] if m else ENV_VERSION)
                at += m
        first = mask.index(True)
        completion_mask = mask[first:]
        reward = float(trace.reward)
        return Sample(
            prompt_ids=token_ids[:first],
            token_ids=token_ids[first:],
            logprobs=logprobs[first:],
            versions=versions[first:],
            reward=reward,
            success=self.task.success(reward),
            # the episode's, so that its samples count alike as truncated or not
            finish_reason="length" if trace.is_truncated else "stop",
            group_id=group_id,
            actor_id=self.actor_id,
            model_mask=None if all(completion_mask) else completion_mask,
            turns=len(train),
            episode=episode,
        )


def open_episodes(cfg: Config, task: VerifiersTask, endpoint: GenerateEndpoint | None,
                  tokenizer: PreTrainedTokenizerBase, actor_id: int) -> EpisodeRunner:
    """The runner of `task`'s episodes on `endpoint` (an actor's, or the evaluator's), as the
    run's config says."""
    assert endpoint is not None
    # Each model call logs three INFO lines (a rollout start, the HTTP request, the
    # interception server's access line): 7 MB an hour of an actor's log on 2 cores.
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"task {task.name!r}: verifiers environments render chat messages, and "
                         f"the model {endpoint.model!r} has no chat template")
    return EpisodeRunner(task, endpoint_url=endpoint.url, model=endpoint.model,
                         tokenizer_path=endpoint.model,  # the served model's directory
                         sampling=sampling_from_config(cfg.engine, ()),
                         take_answers=endpoint.take_session, actor_id=actor_id)


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _episode_loop() -> asyncio.AbstractEventLoop:
    """The process's episode loop, started on first use, running until the process ends."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, daemon=True, name="vf-episodes").start()
        return _loop


def _answers_by_node(trace: Any, answers: list[Answer]) -> dict[int, Answer]:
    """The endpoint's answer of each sampled node of `trace` (the engine's log-probs and
    versions): in the order the turns were committed, each takes the next answer with its
    tokens (answers no node holds, a call refused after sampling, are passed over). A sampled
    node with none raises EpisodeFailed."""
    out: dict[int, Answer] = {}
    pending = iter(answers)
    for nid, node in enumerate(trace.nodes):
        sampled = [t for t, m in zip(node.token_ids, node.mask) if m]
        if not sampled:
            continue
        answer = next((a for a in pending if a.token_ids == sampled), None)
        if answer is None:
            raise EpisodeFailed("vf_unmatched", f"a sampled turn of {len(sampled)} tokens "
                                "matches no answer of the endpoint: its versions are unknown")
        out[nid] = answer
    return out


def _errors(errors: list[Any]) -> str:
    return "; ".join(f"{e.type}: {e.message}"[:300] for e in errors)
