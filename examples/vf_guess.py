"""A multi-turn verifiers environment (verifiers 0.4.0, `verifiers.v1`): a guessing game whose
host is the environment. The model guesses a number; the host answers "higher" or "lower" until
it is found or the turns run out. The reward is 1 for finding it, less a little per extra turn.

Train it with `task.name: verifiers:vf_guess` from this folder (vf_guess.yaml).
"""

import re

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def solved(self, task: GuessData, trace: vf.Trace) -> float:
        turns = trace.info.get("solved_at")
        return 0.0 if turns is None else 1.0 - 0.1 * (turns - 1)


class GuessConfig(vf.TasksetConfig):
    low: int = 1
    high: int = 10
    games: int = 200


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        low, high = self.config.low, self.config.high
        for i in range(self.config.games):
            yield GuessTask(GuessData(
                id=f"guess-{i}", secret=low + (i * 7919) % (high - low + 1),
                prompt=f"I picked a whole number from {low} to {high}. Guess it: answer with "
                       "one number."), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=4)  # a role: one AgentConfig field


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as game:  # scored when it closes
            turn = await game.turn()  # the model speaks first
            while not turn.terminated:  # max_turns, a stop, a limit
                found = re.search(r"-?\d+", turn.last_reply)
                guess = int(found.group()) if found else None
                if guess == task.data.secret:
                    game.trace.info["solved_at"] = game.trace.num_turns
                    break
                hint = ("That is not a number." if guess is None
                        else "Higher." if guess < task.data.secret else "Lower.")
                turn = await game.turn(f"{hint} Guess again.")


__all__ = ["GuessTaskset", "GuessEnv", "GuessEnvConfig"]
