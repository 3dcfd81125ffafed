"""An OpenEnv environment for examples/openenv_guess.yaml: guess a secret number, told after
each guess whether it is higher or lower (docs/environments.md, "OpenEnv environments").

No environment package from OpenEnv installs from PyPI here (the repository's environments ship
as Docker images and Hugging Face Spaces; the one package on PyPI, openenv-dipg-safety, pins
server libraries that clash and loads its data from the Hub), so this one is written with
openenv-core's own server classes, as an environment package's `server/app.py` is: an
`Environment`, its `Action` and `Observation`, and `create_app` serving reset/step over HTTP and
per-session WebSockets. Run it alone with `uvicorn openenv_guess:app --app-dir examples`.

An episode: `reset(seed)` draws the secret in 1..`MAX_SECRET` from the seed; each step's
`guess` is read as an integer ("7", " 7.", "it is 7" all say 7) and answered "higher", "lower"
or "correct"; a correct guess ends the episode with reward 1, a guess that is no number earns
-0.1, and after `MAX_GUESSES` guesses the episode ends with reward 0.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

MAX_SECRET = 8
MAX_GUESSES = 4
NUMBER = re.compile(r"-?\d+")


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    text: str


class GuessEnvironment(Environment):
    # Each WebSocket session gets an instance of its own: nothing is shared between them.
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._secret = 1
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).randint(1, MAX_SECRET)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text=f"I think of a number from 1 to {MAX_SECRET}. You have "
                                     f"{MAX_GUESSES} guesses. Your guess?")

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        found = NUMBER.search(action.guess)
        if found is None:
            return GuessObservation(text=f"That is no number. {left} guesses left.",
                                    reward=-0.1, done=left <= 0)
        guess = int(found.group())
        if guess == self._secret:
            return GuessObservation(text="correct", reward=1.0, done=True)
        hint = "higher" if guess < self._secret else "lower"
        return GuessObservation(text=f"{hint}. {left} guesses left.", reward=0.0, done=left <= 0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=256)
