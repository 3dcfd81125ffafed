"""A verifiers environment whose `run` hangs after the model's first turn
(tests/test_verifiers_envs.py): the group's deadline drops it, and the answer the endpoint
kept for that turn must still be taken."""

import asyncio

import verifiers.v1 as vf


class StallTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def zero(self, task: vf.TaskData, trace: vf.Trace) -> float:
        return 0.0


class StallTaskset(vf.Taskset[StallTask, vf.TasksetConfig]):
    def load(self):
        yield StallTask(vf.TaskData(id="s-0", prompt="Say something."), self.config.task)


class StallEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class StallEnv(vf.Env[StallEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as talk:
            await talk.turn()
            await asyncio.sleep(3600)


__all__ = ["StallTaskset", "StallEnv", "StallEnvConfig"]
