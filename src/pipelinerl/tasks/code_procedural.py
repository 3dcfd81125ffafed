"""A code task the CPU can learn: small Python functions, each with ten generated asserts.

A problem is a family and a constant ("add:7": write `add_7(x)`, returning x plus 7); its
asserts come from a generator seeded by its id, so a problem has the same tests in every
process. Held out by problem (`task.heldout_frac`): a held-out function is never trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from pipelinerl.tasks.base import Problem

TESTS_PER_PROBLEM = 10
PROMPT = ("Write a Python function `{signature}` that {description}. Reply with the code only, "
          "in a ```python block.")


@dataclass(frozen=True)
class Family:
    name: str
    signature: str  # with {k}
    description: str  # with {k}
    constants: range
    argument: Callable[[random.Random, int], Any]  # one call's argument
    reference: Callable[[Any, int], Any]


def _int(rng: random.Random, k: int) -> int:
    return rng.randint(-50, 50)


def _small_int(rng: random.Random, k: int) -> int:
    return rng.randint(-6, 6)


def _natural(rng: random.Random, k: int) -> int:
    return rng.randint(0, 100)


def _ints(rng: random.Random, k: int) -> list[int]:
    return [rng.randint(-9, 20) for _ in range(rng.randint(0, 7))]


def _word(rng: random.Random, k: int) -> str:
    return "".join(rng.choice("abcdefghij") for _ in range(rng.randint(k + 1, k + 6)))


FAMILIES = (
    Family("add", "add_{k}(x)", "returns x plus {k}", range(1, 10), _int, lambda x, k: x + k),
    Family("sub", "sub_{k}(x)", "returns x minus {k}", range(1, 10), _int, lambda x, k: x - k),
    Family("times", "times_{k}(x)", "returns x multiplied by {k}", range(2, 10), _int,
           lambda x, k: x * k),
    Family("mod", "mod_{k}(x)", "returns the remainder of x divided by {k}", range(2, 10),
           _natural, lambda x, k: x % k),
    Family("multiple", "is_multiple_of_{k}(x)", "returns True if x is divisible by {k}, else "
           "False", range(2, 10), _natural, lambda x, k: x % k == 0),
    Family("power", "power_{k}(x)", "returns x to the power {k}", range(2, 5), _small_int,
           lambda x, k: x ** k),
    Family("above", "above_{k}(x)", "returns True if x is greater than {k}, else False",
           range(1, 10), _int, lambda x, k: x > k),
    Family("cap", "cap_{k}(x)", "returns the smaller of x and {k}", range(1, 10), _int,
           lambda x, k: min(x, k)),
    Family("sum_plus", "sum_plus_{k}(xs)", "returns the sum of the list xs plus {k}",
           range(1, 10), _ints, lambda xs, k: sum(xs) + k),
    Family("count_above", "count_above_{k}(xs)", "returns how many numbers in the list xs are "
           "greater than {k}", range(1, 10), _ints, lambda xs, k: sum(x > k for x in xs)),
    Family("first", "first_{k}(xs)", "returns the list of the first {k} items of the list xs",
           range(1, 6), _ints, lambda xs, k: xs[:k]),
    Family("repeat", "repeat_{k}(s)", "returns the string s repeated {k} times", range(2, 6),
           _word, lambda s, k: s * k),
    Family("drop", "drop_{k}(s)", "returns the string s without its first {k} characters",
           range(1, 6), _word, lambda s, k: s[k:]),
    Family("char_at", "char_at_{k}(s)", "returns the character at index {k} of the string s",
           range(0, 5), _word, lambda s, k: s[k]),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def family_names() -> list[str]:
    return [f.name for f in FAMILIES]


def check_families(names: list[str] | None) -> tuple[Family, ...]:
    """The families `names` names (all when None); a ValueError naming an unknown one."""
    if names is None:
        return FAMILIES
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown or not names:
        raise ValueError(f"families: unknown {unknown or 'empty list'}; known: {family_names()}")
    return tuple(_BY_NAME[n] for n in names)


def problem_count(families: tuple[Family, ...]) -> int:
    return sum(len(f.constants) for f in families)


def make_problem(family: Family, k: int) -> Problem:
    """The problem `family` with constant `k`: its prompt and ten asserts (module docstring)."""
    problem_id = f"{family.name}:{k}"
    rng = random.Random(f"code-{problem_id}")
    function = family.signature.format(k=k).partition("(")[0]
    tests = []
    for _ in range(TESTS_PER_PROBLEM):
        argument = family.argument(rng, k)
        tests.append(f"assert {function}({argument!r}) == {family.reference(argument, k)!r}")
    prompt = PROMPT.format(signature=family.signature.format(k=k),
                           description=family.description.format(k=k))
    return Problem(problem_id, prompt, {"kind": "asserts", "setup": "", "tests": tests})


def draw(families: tuple[Family, ...], rng: random.Random) -> Problem:
    """A problem drawn uniformly over all (family, constant) pairs."""
    index = rng.randrange(problem_count(families))
    for family in families:
        if index < len(family.constants):
            return make_problem(family, family.constants[index])
        index -= len(family.constants)
    raise AssertionError("index within problem_count")
