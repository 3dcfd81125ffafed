"""A verifiers environment whose `run` raises after the model's first turn
(tests/test_verifiers_envs.py): the episode fails, is retried as `env.retries` says, and the
group is dropped; every attempt's answers must still be taken from the endpoint."""

import verifiers.v1 as vf


class HostTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def zero(self, task: vf.TaskData, trace: vf.Trace) -> float:
        return 0.0


class HostTaskset(vf.Taskset[HostTask, vf.TasksetConfig]):
    def load(self):
        yield HostTask(vf.TaskData(id="r-0", prompt="Say something."), self.config.task)


class HostEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class HostEnv(vf.Env[HostEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as talk:
            await talk.turn()
        raise RuntimeError("the host broke after the first turn")


__all__ = ["HostTaskset", "HostEnv", "HostEnvConfig"]
