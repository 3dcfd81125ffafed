"""What the page asks of a run's records: groups by step or version through filters (one page
at a time), and the held-out completions of two versions side by side."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

PAGE = 20  # groups per page unless asked


class QueryError(ValueError):
    """A query the viewer cannot answer; the message names the parameter."""


def _parse(model: type[BaseModel], query: Mapping[str, str]) -> Any:
    """`model` from a query string's parameters (empty ones unset)."""
    try:
        return model.model_validate({k: v for k, v in query.items() if v != ""})
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise QueryError(f"{where}: {e['msg']}") from err


class Filters(BaseModel):
    """Which samples show: a group shows when one of its samples matches, with all of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step_min: int | None = None
    step_max: int | None = None
    version_min: int | None = None
    version_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    length_min: int | None = None
    length_max: int | None = None
    finish: tuple[str, ...] = ()  # finish reasons, any of them
    problem: str = ""  # a part of the problem text or group id, any case
    kind: Literal["all", "trained", "dropped"] = "all"
    # Samples by their tool calls: "any" (a call made), "failed" (a call whose outcome is not
    # ok) or one outcome (ok, tool_error, tool_timeout, ...); "": no matter.
    tool: str = ""
    offset: int = Field(default=0, ge=0)
    limit: int = Field(default=PAGE, gt=0, le=1000)

    @field_validator("finish", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return tuple(x for x in v.split(",") if x) if isinstance(v, str) else v

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> Filters:
        return _parse(cls, query)

    def query(self) -> dict[str, str]:
        """The query string's parameters that give these filters back (defaults left out)."""
        out = {}
        for key, value in self.model_dump(exclude_defaults=True).items():
            out[key] = ",".join(value) if isinstance(value, tuple) else str(value)
        return out

    def group_matches(self, g: dict[str, Any]) -> bool:
        dropped = bool(g.get("dropped"))
        if self.kind != "all" and dropped != (self.kind == "dropped"):
            return False
        needle = self.problem.lower()
        return (_within(g["step"], self.step_min, self.step_max)
                and _within(g["version"], self.version_min, self.version_max)
                and (not needle or needle in g["problem"].lower()
                     or needle in g["group_id"].lower()))

    def sample_matches(self, s: dict[str, Any]) -> bool:
        reward_bounded = self.reward_min is not None or self.reward_max is not None
        if reward_bounded and s["reward"] is None:
            return False
        return ((not reward_bounded or _within(s["reward"], self.reward_min, self.reward_max))
                and _within(s["length"], self.length_min, self.length_max)
                and (not self.finish or s["finish_reason"] in self.finish)
                and (not self.tool or self._tool_matches(s.get("tool_calls") or [])))

    def _tool_matches(self, calls: list[dict[str, Any]]) -> bool:
        if self.tool == "any":
            return bool(calls)
        if self.tool == "failed":
            return any(c["outcome"] != "ok" for c in calls)
        return any(c["outcome"] == self.tool for c in calls)


def _within(x: float, low: float | None, high: float | None) -> bool:
    return (low is None or x >= low) and (high is None or x <= high)


def select_groups(groups: list[dict[str, Any]], f: Filters) -> dict[str, Any]:
    """One page of the groups that match, newest step first; each with `match`, which of its
    samples matched (the page shows those, and the whole group on request)."""
    chosen = []
    for g in groups:
        if not f.group_matches(g):
            continue
        match = [f.sample_matches(s) for s in g["samples"]]
        if any(match):
            chosen.append({**g, "match": match})
    chosen.sort(key=lambda g: -g["step"])  # stable: a step's groups keep their order
    return {"total": len(chosen),
            "matching_samples": sum(sum(g["match"]) for g in chosen),
            "offset": f.offset, "limit": f.limit,
            "groups": chosen[f.offset:f.offset + f.limit]}


class EvalQuery(BaseModel):
    """Two evaluated versions to compare (default: the first and the newest) in one mode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a: int | None = None
    b: int | None = None
    mode: str = ""  # default: greedy when there is one

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> EvalQuery:
        return _parse(cls, query)


def _accuracy(rows: list[dict[str, Any]]) -> float | None:
    """The share of scored attempts that succeeded."""
    scored = [a["success"] for r in rows for a in r["attempts"] if a.get("success") is not None]
    return sum(map(bool, scored)) / len(scored) if scored else None


def compare_eval(rows: list[dict[str, Any]], q: EvalQuery) -> dict[str, Any]:
    """The held-out problems of versions `a` and `b` in one mode, paired by problem."""
    versions = sorted({r["version"] for r in rows})
    modes = sorted({r["mode"] for r in rows})
    if not versions:
        return {"versions": [], "modes": [], "a": None, "b": None, "mode": None,
                "accuracy": {}, "problems": []}
    mode = q.mode or ("greedy" if "greedy" in modes else modes[0])
    a = versions[0] if q.a is None else q.a
    b = versions[-1] if q.b is None else q.b
    for key, v in (("a", a), ("b", b)):
        if v not in versions:
            raise QueryError(f"{key}: version {v} was not evaluated (evaluated: "
                             f"{', '.join(map(str, versions))})")
    if mode not in modes:
        raise QueryError(f"mode: {mode!r} is not one of {', '.join(modes)}")
    of = {v: {r["problem_id"]: r for r in rows if r["version"] == v and r["mode"] == mode}
          for v in (a, b)}
    ids = list(dict.fromkeys([*of[a], *of[b]]))
    problems = [{"problem_id": pid,
                 "problem": (of[a].get(pid) or of[b][pid])["problem"],
                 "a": of[a].get(pid), "b": of[b].get(pid)} for pid in ids]
    return {"versions": versions, "modes": modes, "a": a, "b": b, "mode": mode,
            "accuracy": {"a": _accuracy(list(of[a].values())),
                         "b": _accuracy(list(of[b].values()))},
            "problems": problems}
