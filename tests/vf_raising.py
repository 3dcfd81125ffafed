"""A verifiers environment whose reward raises (tests/test_verifiers_envs.py): its groups are
dropped and counted, never trained."""

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def broken(self, task: vf.TaskData, trace: vf.Trace) -> float:
        raise RuntimeError("this reward is broken")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield BrokenTask(vf.TaskData(id=f"b-{i}", prompt=f"Say {i}."), self.config.task)


__all__ = ["BrokenTaskset"]
