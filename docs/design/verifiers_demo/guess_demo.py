"""Multi-turn game: guess a number; the env (host-side, in process) plays the user."""
import re
import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def solved(self, task: GuessData, trace: vf.Trace) -> float:
        return float(trace.info.get("solved", False))


class GuessConfig(vf.TasksetConfig):
    n: int = 4
    low: int = 1
    high: int = 10


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        c = self.config
        for i in range(c.n):
            secret = c.low + (i * 7) % (c.high - c.low + 1)
            yield GuessTask(GuessData(
                name=f"guess#{i}", secret=secret,
                prompt=f"I picked a number from {c.low} to {c.high}. Guess it: answer with one number.",
            ), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=4)


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as it:
            seg = await it.turn()                      # prompted task: model speaks first
            while not seg.terminated:
                m = re.search(r"-?\d+", seg.last_reply)
                guess = int(m.group()) if m else None
                if guess == task.data.secret:
                    it.trace.info["solved"] = True     # read by GuessTask.solved at close
                    break
                hint = "not a number" if guess is None else (
                    "higher" if guess < task.data.secret else "lower")
                seg = await it.turn(f"Wrong: {hint}. Guess again.")


__all__ = ["GuessTaskset", "GuessEnv", "GuessEnvConfig"]
