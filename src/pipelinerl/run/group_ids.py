"""Group ids and actor restarts: `a<actor>-g<n>` from an actor's first process, `a<actor>-r<r>-g<n>`
from its r-th restart, so a restarted actor never repeats an id and the audit can tell who
made a group."""

from __future__ import annotations

from typing import Any


def format_group_id(actor_id: int, restart: int, n: int) -> str:
    return f"a{actor_id}-r{restart}-g{n}" if restart else f"a{actor_id}-g{n}"


def actor_of(group_id: str) -> int:
    """The actor that made a group (-1 for an id not of this form)."""
    head = group_id.split("-", 1)[0]
    return int(head[1:]) if head[1:].isdigit() else -1


def restart_of(group_id: str) -> int:
    """The restart number of the actor process that made a group (0: its first process)."""
    parts = group_id.split("-")
    restart = parts[1] if len(parts) == 3 else ""
    return int(restart[1:]) if restart[:1] == "r" and restart[1:].isdigit() else 0


def next_restart(predecessor: dict[str, Any] | None) -> int:
    """The restart number of an actor process whose predecessor wrote `predecessor` last
    (0: none, the actor's first process). A heartbeat holds it under "generation", its key in
    existing runs."""
    if predecessor is None:
        return 0
    last = (predecessor["generation"] if predecessor.get("heartbeat")
            else restart_of(predecessor["group_id"]))
    return last + 1


def process_seed(seed: int, actor_id: int, restart: int) -> int:
    """A seed per run seed, actor and restart of that actor (restart < 1_000_003)."""
    return (seed * 1000 + actor_id) * 1_000_003 + restart
