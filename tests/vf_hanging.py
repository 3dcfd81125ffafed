"""A verifiers environment whose own `run` hangs (tests/test_verifiers_envs.py): the episode
deadline ends it, and its group is dropped and counted."""

import asyncio

import verifiers.v1 as vf


class HangTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def zero(self, task: vf.TaskData, trace: vf.Trace) -> float:
        return 0.0


class HangTaskset(vf.Taskset[HangTask, vf.TasksetConfig]):
    def load(self):
        yield HangTask(vf.TaskData(id="h-0", prompt="Wait."), self.config.task)


class HangEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class HangEnv(vf.Env[HangEnvConfig]):
    async def run(self, task, agents):
        await asyncio.sleep(3600)


__all__ = ["HangTaskset", "HangEnv", "HangEnvConfig"]
