"""Weight channel over `torch.distributed` broadcast: trainer rank 0 to actors on any machines.

Group: the trainer's rank 0 (broadcast source, rank 0) and every actor (actor i is rank i + 1),
world = 1 + n_actors. It is its own process group built on its own TCPStore (hosted by the
sender at `tcp://host:port`), apart from any default group the trainer uses for DDP/FSDP.
Backend: gloo for `device="cpu"`, NCCL for a CUDA device. Both sides must agree; the sender
writes its backend into the store and a receiver with a different one fails at start.

Store keys (all small strings):
    version     newest announced version ("-1" before the first publish, "closed" at the end)
    manifest    the WeightLayout JSON (names, shapes, dtypes, ties), set at the first publish
    epoch       the group's membership epoch: "0", +1 each time the group is formed again
    join/<r>    how many processes joined as rank r (a second one must be a restart)
    rejoins     how many restarted receivers asked for a new group
    e<k>/peer/<r>  rank r's state in epoch k: "-1" joined; "<v>" waiting at the collective for
                version v; "closed"; "error: <message>"
    e<k>/go/<v> the sender's verdict for version v in epoch k: "ok" (broadcast follows),
                "abort: <why>", or "regroup" (join epoch k + 1, then ask again)
    e<k>/done/<v>  the sender's word after the transfer of version v in epoch k: "ok" (every
                member has it), "retry" (a member was lost mid-transfer; join epoch k + 1 and
                receive v again) or "abort: <why>"

Network: each member advertises an address for the others to connect to. gloo's default is
the address the host name resolves to, loopback on many Linux machines; with the store on
another machine that address cannot be reached, so the interface that routes to the store's
host is used instead (`netaddr.choose_interface`: `interface` / sync.interface overrides it,
and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in the environment are left to torch and NCCL).

Rendezvous: every rank sets `peer/<r>` and waits (up to `rendezvous_timeout_s`, by default
`timeout_s`; actors loading a large model may need longer) for all the others', naming the
ranks still missing if they do not come; only then is the process group built, so its own
rendezvous cannot hang. An actor whose device needs another backend than the trainer's joins
with an error state, which fails every rank at once; a duplicate actor id is refused.

One update (sender `publish(weights, v)`):
  1. the sender sets `version = v` and polls the `peer/*` keys until every actor reads "v";
  2. an actor's `poll()` is one store read, cheap enough between two decode steps; when the
     actor is ready it calls `receive_into`, which checks its targets against the manifest
     (reporting a mismatch through `peer/<r>` so the sender fails too), sets `peer/<r> = v`
     and waits for `go/<v>`;
  3. once all actors are there the sender sets `go/<v> = ok` and broadcasts a small header
     (version, bucket size; 0 = per tensor) and then the weights, bucket by bucket (or one
     tensor at a time with `per_parameter=True`, to compare).
  4. the sender sets `done/<v>`; a receiver returns only once it reads "ok", so an engine
     whose transfer was cut short is never left running on half-written weights.
A busy actor delays the sender by at most one decode step. A dead, stuck or closed actor, or
one that reported an error, makes the sender set `go/<v> = abort: ...` and raise, naming the
actor, so the actors already waiting raise the same reason instead of sitting in a collective
until it times out. No collective starts before every member is known to be at it; every
collective still carries `timeout_s` for a peer dying mid-transfer.

A member lost during a transfer (killed between `go` and the last bucket): which survivors got
the whole version is arbitrary (a tree broadcast may relay through the dead rank), so the
sender waits up to `rendezvous_timeout_s` for the launcher's restart of that actor to rejoin,
sets `done/<v> = retry`, forms the group again and sends the same version to every member.
Streamed weights are sent again only if `replayable` (a sharded trainer's are while rank 0
leads the other ranks' gathers: `GatheredWeights.lead`); others, and a loss with no rejoin,
set `done/<v> = abort: ...` and break the channel, which then stays broken (the run fails,
resumable from its last checkpoint).

Membership changes (an actor restarted by the launcher): a torch.distributed group cannot take
a new member, so the group is formed again. The restarted receiver (`may_rejoin`: it continues
an earlier process of its actor) finds its rank joined before, adds one to `rejoins` and waits
for a new epoch. The sender checks `rejoins` while it waits for actors at a publish: it bumps
`epoch`, answers "regroup" to the actors already waiting for the version, and every member
meets again under the new epoch's keys and builds a new group (its own `pg<k>` store prefix);
the live actors notice at their next `poll()` or through that verdict. The publish then goes on
in the new group. A member that dies during a transfer is taken back the same way (above).
The trainer also asks `rejoined()` while it waits for samples, and then publishes the version
it last published again (or a newer one): a restarted actor generates nothing before it holds
the current weights, so with one actor the next publish would never come. A receiver that
meets a new epoch through `poll()` takes the current version again, since a broadcast needs
every member: an update costs the live actors one reload per restart.

Retired groups: a group left after a lost member is aborted, not torn down (tearing down a
gloo group waits for a collective still posted in it, a transfer cut short, to time out), and
released once every collective posted in it has completed (at most `timeout_s` later): a run
holds the sockets and threads of at most the groups of the last `timeout_s`, not one per
restart for the whole run.

Shutdown: the sender's `close()` sets `version = closed` and keeps the store (which lives in
the trainer's process) up until every live actor has seen it (its `poll()` then answers None
and sets `closed`) or closed its receiver, so actors stopping at the end of a run never mistake
it for a crashed trainer. An unreachable store otherwise makes `poll()` raise.

Buckets: the distinct tensors (tied names are sent once) are laid end to end as bytes, each at
a 16-byte aligned offset, and the stream is cut into `bucket_mb` pieces; a large tensor spans
several buckets, so memory stays bounded by two buckets on each side: one is packed (or
unpacked) while the other is on the wire.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeAlias, TypeVar
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from pipelinerl.sync.base import Weights, open_weights
from pipelinerl.sync.layout import WeightLayout
from pipelinerl.sync.netaddr import ENV_VARS, InterfaceChoice, choose_interface

logger = logging.getLogger(__name__)

_ALIGN = 16  # every dtype's item size divides it, so bucket slices can be viewed as any dtype
_POLL_MIN_S, _POLL_MAX_S = 0.0001, 0.002  # the sender's wait for actors to get ready
_SETTLED_CHECK = timedelta(seconds=0.05)  # how often a receiver waiting for data asks whether
                                          # the sender gave up on the transfer
_CLOSE_WAIT_S = 10.0  # at most this long for actors to see the sender's close
_SIGNAL_SLICE_S = 0.1  # how often a wait on a native call lets Python's signal handlers run
_NATIVE_GRACE_S = 2.0  # past its own timeout, a native call's own error (naming keys) may come
_T = TypeVar("_T")
# A string: NCCL's class exists in CUDA builds of torch only.
_Group: TypeAlias = "dist.ProcessGroupGloo | dist.ProcessGroupNCCL"


class TransferLost(RuntimeError):
    """A collective of the weight group failed: a member died or stalled."""


def _parse_init_method(init_method: str) -> tuple[str, int]:
    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"init_method must look like tcp://host:port, got {init_method!r}")
    return url.hostname, url.port


def _describe(rank: int) -> str:
    return "trainer (rank 0)" if rank == 0 else f"actor {rank - 1} (rank {rank})"


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _bounded(call: Callable[[], _T], timeout_s: float, on_timeout: str) -> _T:
    """`call()`, a blocking native call with its own `timeout_s` (a store's connect or wait, a
    process group's constructor), run in a daemon thread: the caller waits for it in slices,
    so Python's signal handlers run meanwhile (a main thread inside the call hears no SIGTERM
    or Ctrl-C: seen, a trainer in `ProcessGroupGloo(...)` for minutes with its actor gone), and
    gives up `_NATIVE_GRACE_S` after `timeout_s` with TimeoutError(`on_timeout`) whatever the
    call does. On a stop or that timeout the thread is left in the call: it holds no lock of
    ours, and the process exits around it (a stopped role through cli.run's `_exit_now`)."""
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as e:  # raised again in the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="pipelinerl-weight-group", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s + _NATIVE_GRACE_S
    while thread.is_alive():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(on_timeout)
        thread.join(min(_SIGNAL_SLICE_S, left))
    if failure:
        raise failure[0]
    return outcome[0]


def _nccl_may_have_started() -> bool:
    """Whether an NCCL communicator of this process may exist already: the default group (a
    trainer's DDP/FSDP group, which forms before its weight group) is NCCL's."""
    return dist.is_initialized() and dist.get_backend() == "nccl"


def _settle_nccl(choice: InterfaceChoice, me: str) -> InterfaceChoice:
    """`choice` as NCCL will take it. NCCL reads NCCL_SOCKET_IFNAME once per process, at its
    first communicator: it is set to the chosen interface while none can exist yet; after,
    setting it would change nothing, so it is left alone, with a warning, and NCCL's own
    choice is what is returned (and logged)."""
    if choice.interface is None:
        return choice
    if not _nccl_may_have_started():
        # Unset until now: choose_interface returns an interface only then.
        os.environ[ENV_VARS["nccl"]] = choice.interface
        return choice
    logger.warning(
        "%s: the weight group should use interface %s (%s), but an NCCL group of this process "
        "formed first and NCCL keeps the interface it chose then; set %s=%s in the role's "
        "environment", me, choice.interface, choice.reason, ENV_VARS["nccl"], choice.interface)
    return InterfaceChoice(None, f"NCCL keeps the one it chose for this process's first NCCL "
                                 f"group; wanted {choice.interface}: {choice.reason}")


def claim_nccl_interface(init_method: str, configured: str, me: str) -> None:
    """Choose the NCCL weight group's interface (store at `init_method`, `configured`:
    sync.interface) and set NCCL_SOCKET_IFNAME now, before this process forms an NCCL group
    of its own (a trainer's, in init_distributed): NCCL would fix the interface there."""
    host, _ = _parse_init_method(init_method)
    choice = _settle_nccl(choose_interface(host, "nccl", configured), me)
    logger.info("%s: NCCL interface %s (%s)", me, choice.interface or "left to NCCL",
                choice.reason)


def _await_peers(store: dist.Store, ranks: list[int], me: int, timeout_s: float,
                 epoch: int) -> None:
    """Wait until every rank in `ranks` has joined epoch `epoch`; raise naming the missing or
    failed ones."""
    keys = [f"e{epoch}/peer/{r}" for r in ranks]
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [_describe(r) for r, k in zip(ranks, keys, strict=True)
                           if not store.check([k])]
                raise TimeoutError(
                    f"{_describe(me)}: weight-sync group incomplete after {timeout_s} s; "
                    f"missing: {', '.join(missing)}"
                )
            time.sleep(0.01)
        states = [b.decode() for b in store.multi_get(keys)]
    except dist.DistError as e:
        raise RuntimeError(f"{_describe(me)}: weight store lost while forming the group "
                           f"(trainer gone?): {e}") from e
    failed = [f"{_describe(r)}: {s}" for r, s in zip(ranks, states, strict=True)
              if s.startswith("error")]
    if failed:
        raise RuntimeError(f"{_describe(me)}: cannot form the weight-sync group; "
                           + "; ".join(failed))


def _await_key(store: dist.Store, key: str, timeout_s: float, me: str, on_timeout: str) -> None:
    """Until `key` is set, polling: a native `store.wait` would keep the main thread from
    Python's signal handlers for up to `timeout_s` (a stop signal then waits for it)."""
    deadline = time.monotonic() + timeout_s
    pause = _POLL_MIN_S
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(on_timeout)
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
    except dist.DistError as e:
        raise RuntimeError(f"{me}: weight store lost while waiting for {key!r} (trainer "
                           f"gone?): {e}") from e


def _make_group(store: dist.Store, rank: int, world: int, backend: str, timeout_s: float,
                epoch: int, interface: str | None, rendezvous_timeout_s: float) -> _Group:
    """Build epoch `epoch`'s group once every member joined its rendezvous; raise
    TimeoutError if that takes longer than `rendezvous_timeout_s` (the store's own timeout)."""
    # Built directly rather than through init_process_group so that the trainer's own default
    # group (DDP/FSDP over trainer ranks) is left alone. Each epoch's group meets under its own
    # prefix: the keys of an earlier one would mislead its rendezvous.
    prefix = dist.PrefixStore(f"pg{epoch}", store)

    def build() -> _Group:
        if backend == "nccl":  # NCCL takes its interface from NCCL_SOCKET_IFNAME (_Channel)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)
            return dist.ProcessGroupNCCL(prefix, rank, world, opts)
        if interface is None:  # gloo's default: GLOO_SOCKET_IFNAME, else the host name's address
            return dist.ProcessGroupGloo(prefix, rank, world, timedelta(seconds=timeout_s))
        gloo_opts = dist.ProcessGroupGloo._Options()
        gloo_opts._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
        gloo_opts._timeout = timedelta(seconds=timeout_s)
        gloo_opts._threads = 2  # as gloo's default constructor gives one device
        return dist.ProcessGroupGloo(prefix, rank, world, gloo_opts)

    failed = (f"{_describe(rank)}: the weight-sync group (epoch {epoch}: the trainer and "
              f"{world - 1} actor(s)) did not form within {rendezvous_timeout_s} s "
              f"(sync.timeout_s): every member had joined its rendezvous (e{epoch}/peer/*), but "
              f"the {backend} process group's connections between them did not complete (a "
              "member died or stalled since, or cannot reach this one's address: "
              "sync.interface)")
    try:
        return _bounded(build, rendezvous_timeout_s, failed)
    except dist.DistError as e:  # the store's own timeout, naming the keys it waited for
        raise TimeoutError(f"{failed}: {e}") from e


@dataclass(frozen=True)
class _Piece:
    slot: int
    start: int  # first element within the flattened tensor
    numel: int
    offset: int  # byte offset within the bucket


_Plan = list[tuple[int, list[_Piece]]]  # (size in bytes, pieces) of each bucket


def _plan_buckets(layout: WeightLayout, bucket_bytes: int) -> _Plan:
    buckets: _Plan = []
    pos = 0  # byte position in the stream of all tensors
    for i, s in enumerate(layout.slots):
        pos = -(-pos // _ALIGN) * _ALIGN
        item, start = s.dtype.itemsize, 0
        while start < s.numel:
            b = pos // bucket_bytes
            room = (b + 1) * bucket_bytes - pos  # a multiple of _ALIGN, hence of item
            n = min(s.numel - start, room // item)
            while len(buckets) <= b:
                buckets.append((0, []))
            buckets[b][1].append(_Piece(i, start, n, pos - b * bucket_bytes))
            pos += n * item
            start += n
            buckets[b] = (pos - b * bucket_bytes, buckets[b][1])
    return buckets


class _Channel:
    """What sender and receiver share: the store, the group, timing."""

    def __init__(self, init_method: str, rank: int, world: int, device: torch.device | str,
                 timeout_s: float, rendezvous_timeout_s: float | None, interface: str):
        self.host, self.port = _parse_init_method(init_method)
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.backend = _backend_for(self.device)
        # Decided before anything waits on the network: an undecidable one stops the role now.
        choice = choose_interface(self.host, self.backend, interface)
        if self.backend == "nccl":
            choice = _settle_nccl(choice, _describe(rank))
        self.interface = choice.interface
        logger.info("%s: weight group interface %s (%s)", _describe(rank),
                    self.interface or "left to torch", choice.reason)
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.rendezvous_timeout_s = (
            timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s)
        self.last_wait_s = 0.0  # last update: time spent waiting for the other members
        self.last_transfer_s = 0.0  # last update: time spent moving the weights
        self.store: dist.TCPStore | None = None
        self.group: _Group | None = None
        self._posted: list[dist.Work] = []  # the group's collectives not yet seen completed
        # Groups left after a lost member, with what is still posted in them (see _drop_group).
        self._retired: list[tuple[_Group, list[dist.Work]]] = []
        self.epoch = 0
        self._layout: WeightLayout | None = None
        self._buckets: tuple[int, _Plan] = (0, [])  # (the bucket size it was planned for, plan)
        self._buffers: list[torch.Tensor] = []

    def _key(self, name: str) -> str:
        """A key of the current epoch."""
        return f"e{self.epoch}/{name}"

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:  # gloo reports a peer gone as a plain RuntimeError
            raise TransferLost(
                f"{_describe(self.rank)}: weight broadcast failed at {what} (a member of the "
                f"group died or stalled; timeout {self.timeout_s} s): {e}"
            ) from e

    def _drop_group(self) -> None:
        """Leave the current group, aborted but not torn down: tearing down a gloo group
        waits until a collective still posted in it (a transfer cut short) times out. It is
        kept until then (`_release_retired`)."""
        if self.group is not None:
            self.group.abort()
            self._retired.append((self.group, self._posted))
            self.group, self._posted = None, []
        self._release_retired()

    def _release_retired(self) -> None:
        """Let go of the retired groups with nothing posted any more (their collectives done,
        failed or timed out): their sockets and threads go with them."""
        self._retired = [(g, pending) for g, works in self._retired
                         if (pending := [w for w in works if not w.is_completed()])]

    def _start(self, t: torch.Tensor, what: str) -> tuple[dist.Work, str]:
        assert self.group is not None
        with self._collective(what):
            work = self.group.broadcast(t, 0, self.timeout)
        self._posted = [w for w in self._posted if not w.is_completed()] + [work]
        return work, what

    def _wait(self, pending: tuple[dist.Work, str]) -> None:
        work, what = pending
        if self.backend != "gloo":  # a timed-out NCCL wait may abort its communicator
            with self._collective(what):
                work.wait(self.timeout)
            return
        # In slices: a main thread inside one long native wait hears no stop signal.
        deadline = time.monotonic() + self.timeout_s
        with self._collective(what):
            while True:
                try:
                    work.wait(_SETTLED_CHECK)
                    return
                except RuntimeError:
                    if work.is_completed():  # done just now, or failed: wait says which
                        work.wait(self.timeout)
                        return
                    if time.monotonic() > deadline:
                        raise

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        self._wait(self._start(t, what))

    def _plan(self, bucket_bytes: int) -> _Plan:
        assert self._layout is not None
        if self._buckets[0] != bucket_bytes:
            self._buckets = (bucket_bytes, _plan_buckets(self._layout, bucket_bytes))
        return self._buckets[1]

    def _bucket_buffers(self, buckets: _Plan) -> list[torch.Tensor]:
        # Two buffers: one is packed or unpacked while the other is on the wire.
        size = max((nbytes for nbytes, _ in buckets), default=0)
        if not self._buffers or self._buffers[0].numel() != size:
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device)
                             for _ in range(2)]
        return self._buffers

    def _finish_timing(self, t0: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_transfer_s = time.perf_counter() - t0


class BroadcastWeightSender(_Channel):
    """Trainer rank 0: hosts the store, waits for `n_actors` receivers, broadcasts weights.

    `bucket_bytes` and `per_parameter` may be changed between publishes (receivers follow the
    header). `last_wait_s` is how long the last publish waited for actors to get ready,
    `last_transfer_s` how long the broadcast itself took.
    """

    def __init__(self, init_method: str, n_actors: int, device: torch.device | str = "cpu",
                 bucket_mb: float = 64.0, per_parameter: bool = False, timeout_s: float = 120.0,
                 rendezvous_timeout_s: float | None = None, interface: str = ""):
        if n_actors < 1:
            raise ValueError(f"n_actors must be >= 1, got {n_actors}")
        super().__init__(init_method, 0, 1 + n_actors, device, timeout_s, rendezvous_timeout_s,
                         interface)
        wait = timedelta(seconds=self.rendezvous_timeout_s)
        self.bucket_bytes = max(_ALIGN, int(bucket_mb * 2**20) // _ALIGN * _ALIGN)
        self.per_parameter = per_parameter
        self._version: int | None = None
        self._broken: str | None = None
        self._spent: list[str] = []  # the last transfer's verdict keys (deleted after the next)
        try:
            self.store = dist.TCPStore(self.host, self.port, None, True, wait,
                                       wait_for_workers=False)
        except dist.DistError as e:
            raise RuntimeError(
                f"trainer: cannot host the weight store on port {self.port}: {e}") from e
        try:
            self.store.set("backend", self.backend)
            self.store.set("version", "-1")
            self.store.set("epoch", "0")
            self._rejoins_seen = 0
            self._form_group()
        except BaseException:
            self.store = None  # free the port now, not when the traceback is collected
            raise

    def _form_group(self) -> None:
        assert self.store is not None
        self.store.set(self._key("peer/0"), "-1")  # last: receivers that see it see the rest
        _await_peers(self.store, list(range(1, self.world)), 0, self.rendezvous_timeout_s,
                     self.epoch)
        self.group = _make_group(self.store, 0, self.world, self.backend, self.timeout_s,
                                 self.epoch, self.interface, self.rendezvous_timeout_s)

    def _regroup(self, version: int) -> None:
        """A restarted receiver asked to join: form the group again under a new epoch; the
        actors already waiting for `version` are told to follow."""
        assert self.store is not None
        old = self._key(f"go/{version}")
        self.epoch += 1
        self.store.set("epoch", str(self.epoch))
        self.store.set(old, "regroup")
        self._drop_group()  # the old group, with the dead member
        self._form_group()
        logger.warning("weight-sync group formed again (epoch %d): a restarted actor joined",
                       self.epoch)

    def _abort(self, version: int, reason: str) -> None:
        assert self.store is not None
        self._broken = reason
        self.store.set(self._key(f"go/{version}"), f"abort: {reason}")
        raise RuntimeError(reason)

    def _await_actors(self, version: int) -> None:
        assert self.store is not None
        deadline = time.monotonic() + self.timeout_s
        pause = _POLL_MIN_S
        while True:
            rejoins = self.store.add("rejoins", 0)
            if rejoins > self._rejoins_seen:
                self._rejoins_seen = rejoins
                self._regroup(version)
                deadline = time.monotonic() + self.timeout_s
            keys = [self._key(f"peer/{r}") for r in range(1, self.world)]
            states = [b.decode() for b in self.store.multi_get(keys)]
            for r, s in enumerate(states, start=1):
                if s == "closed" or s.startswith("error"):
                    self._abort(version, f"{_describe(r)} cannot take version {version}: {s}")
            late = [(r, s) for r, s in enumerate(states, start=1) if s != str(version)]
            if not late:
                return
            if time.monotonic() > deadline:
                who = ", ".join(f"{_describe(r)} (last ready for version {s})" for r, s in late)
                self._abort(version, f"trainer: no answer within {self.timeout_s} s for "
                                     f"version {version} from {who}: dead, stuck, or not polling")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)  # quick when actors are quick, light when busy

    def rejoined(self) -> bool:
        """Whether a restarted receiver asked to join and waits for the group to form again
        (one store read): the trainer then publishes, the last version again if it has no
        newer one (`publish`)."""
        assert self.store is not None
        self._release_retired()
        return self.store.add("rejoins", 0) > self._rejoins_seen

    def publish(self, weights: Weights, version: int) -> None:
        """Send `weights` as `version` to every receiver: a version newer than the last, or,
        once a receiver `rejoined()`, the last one again (the group is formed again first)."""
        if self._broken is not None:
            raise RuntimeError(f"weight channel broken by an earlier failure: {self._broken}")
        if self._version is not None and version <= self._version and not (
                version == self._version and self.rejoined()):
            raise ValueError(f"version {version} is not newer than {self._version}")
        assert self.store is not None
        self._release_retired()
        layout, sources, _ = open_weights(weights, self._layout)
        if self._layout is None:
            self._layout = layout
            self.store.set("manifest", layout.to_json())
        t0 = time.perf_counter()
        self.store.set("version", str(version))
        while True:
            self._await_actors(version)
            self.store.set(self._key(f"go/{version}"), "ok")
            t1 = time.perf_counter()
            try:
                self._send(sources, version)
                break
            except TransferLost as e:
                self._await_rejoin(version, weights, sources, e)
                _, sources, _ = open_weights(weights, self._layout)
        self.store.set(self._key(f"done/{version}"), "ok")
        self.last_wait_s = t1 - t0
        self._finish_timing(t1)
        logger.info("broadcast weights version %d: waited %.1f ms for actors, sent in %.1f ms",
                    version, 1e3 * self.last_wait_s, 1e3 * self.last_transfer_s)
        # Every member has read the previous transfer's verdicts: it is at this one.
        for key in self._spent:
            self.store.delete_key(key)
        self._spent = [self._key(f"{name}/{version}") for name in ("go", "done")]
        self._version = version

    def _await_rejoin(self, version: int, weights: Weights, sources: Iterator[torch.Tensor],
                      error: TransferLost) -> None:
        """The transfer of `version` failed: return once a restarted actor asks to rejoin (the
        caller then sends `version` again in a new group), telling the members to retry; or
        tell them to abort and raise."""
        assert self.store is not None
        done = self._key(f"done/{version}")
        if not (isinstance(weights, Mapping) or weights.replayable):
            for _ in sources:  # the other trainer ranks finish their gathers rather than hang
                pass
            reason = f"{error}; streamed (sharded) weights cannot be sent again"
        elif self._rejoined_within(self.rendezvous_timeout_s):
            logger.warning("weight transfer of version %d failed (%s); a restarted actor "
                           "rejoined, sending it again", version, error)
            self.store.set(done, "retry")
            return
        else:
            reason = (f"{error}; no restarted actor rejoined within "
                      f"{self.rendezvous_timeout_s} s")
        self._broken = reason
        self.store.set(done, f"abort: {reason}")
        raise RuntimeError(reason) from error

    def _rejoined_within(self, timeout_s: float) -> bool:
        """Whether a restarted receiver asks to rejoin (one not yet taken in) within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.rejoined():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _send(self, sources: Iterator[torch.Tensor], version: int) -> None:
        """Sources are taken one at a time, in slot order, each dropped once packed: a
        streamed (gathered on demand) source is never held whole."""
        # The header tells receivers the version and how the weights follow (0: per tensor).
        bucket_bytes = 0 if self.per_parameter else self.bucket_bytes
        self._broadcast(torch.tensor([version, bucket_bytes], device=self.device), "the header")
        assert self._layout is not None
        slots = self._layout.slots
        with torch.no_grad():
            if self.per_parameter:
                for i, (src, slot) in enumerate(zip(sources, slots, strict=True)):
                    self._broadcast(src.to(self.device, slot.dtype).contiguous(),
                                    f"tensor {i + 1}/{len(slots)}")
                return
            buckets = self._plan(bucket_bytes)
            buffers = self._bucket_buffers(buckets)
            current: tuple[int, torch.Tensor] = (-1, torch.empty(0))  # (slot, its flat source)
            in_flight: list[tuple[dist.Work, str] | None] = [None, None]
            for b, (nbytes, pieces) in enumerate(buckets):
                if (pending := in_flight[b % 2]) is not None:
                    self._wait(pending)  # this buffer's previous bucket has been sent
                buf = buffers[b % 2][:nbytes]
                for p in pieces:
                    while current[0] != p.slot:  # in slot order; an empty slot has no piece
                        current = (current[0] + 1, next(sources).reshape(-1))
                    dtype = slots[p.slot].dtype  # copy_ casts a source to it
                    dst = buf[p.offset:p.offset + p.numel * dtype.itemsize].view(dtype)
                    dst.copy_(current[1][p.start:p.start + p.numel])
                in_flight[b % 2] = self._start(buf, f"bucket {b + 1}/{len(buckets)}")
            for _ in sources:  # trailing empty slots: a gathering source still runs them
                pass
            for pending in in_flight:
                if pending is not None:
                    self._wait(pending)

    def close(self) -> None:
        if self.store is None:
            return
        self.store.set("version", "closed")
        if self._broken is None:
            keys = [self._key(f"peer/{r}") for r in range(1, self.world)]
            deadline = time.monotonic() + min(self.timeout_s, _CLOSE_WAIT_S)
            while time.monotonic() < deadline:
                # Actors that failed or are gone will not answer; only live ones are waited for.
                states = [b.decode() for b in self.store.multi_get(keys)]
                if all(st == "closed" or st.startswith("error") for st in states):
                    break
                time.sleep(0.01)
        self.group = None
        self.store = None


class BroadcastWeightReceiver(_Channel):
    """One actor's end: joins the group as rank `actor_id + 1` and receives into its tensors.

    Targets must be contiguous (buckets are unpacked into flat views of them). The sender's
    `bucket_mb` / `per_parameter` choice reaches receivers through the header, so receivers
    need no matching setting. `closed` turns True once the trainer has closed the channel.
    """

    def __init__(self, init_method: str, actor_id: int, n_actors: int,
                 device: torch.device | str = "cpu", timeout_s: float = 120.0,
                 rendezvous_timeout_s: float | None = None, may_rejoin: bool = False,
                 interface: str = ""):
        """`may_rejoin`: this process continues an earlier one of its actor (a restart), so
        its rank may have joined before; it then asks the trainer to form the group again."""
        if not 0 <= actor_id < n_actors:
            raise ValueError(f"actor_id must be in [0, {n_actors}), got {actor_id}")
        super().__init__(init_method, actor_id + 1, 1 + n_actors, device, timeout_s,
                         rendezvous_timeout_s, interface)
        wait = timedelta(seconds=self.rendezvous_timeout_s)
        self.last_version: int | None = None
        self.closed = False
        self._receiving: int | None = None  # the version whose transfer is under way
        me = _describe(self.rank)
        # Native waits, each bounded by `_bounded` so that a stop signal is heard meanwhile.
        no_store = (f"{me}: no weight store at {self.host}:{self.port} within "
                    f"{self.rendezvous_timeout_s} s (is the trainer up?)")
        try:
            self.store = _bounded(
                lambda: dist.TCPStore(self.host, self.port, None, False, wait),
                self.rendezvous_timeout_s, no_store)
        except dist.DistError as e:
            raise TimeoutError(f"{no_store}: {e}") from e
        restart = self.store.add(f"join/{self.rank}", 1) > 1
        if restart and not may_rejoin:
            raise RuntimeError(f"{me}: another process already joined with this actor id (two "
                               "actors given one id, or a restart of an actor that had written "
                               "no group or heartbeat, so it does not know it continues one)")
        store = self.store
        _bounded(lambda: store.wait(["epoch"], wait), self.rendezvous_timeout_s,
                 f"{me}: the weight store at {self.host}:{self.port} had no group (key "
                 f"'epoch') within {self.rendezvous_timeout_s} s")
        self.epoch = int(self.store.get("epoch"))
        if restart:
            self.store.add("rejoins", 1)
            self.epoch = self._await_new_epoch(self.epoch)
        _await_peers(self.store, [0], self.rank, self.rendezvous_timeout_s, self.epoch)
        sender_backend = self.store.get("backend").decode()
        if sender_backend != self.backend:
            reason = (f"device {self.device} needs {self.backend} but the trainer broadcasts "
                      f"with {sender_backend}")
            self._report(f"error: {reason}")
            raise ValueError(f"{me}: {reason}")
        self._join(self.epoch)

    def _await_new_epoch(self, seen: int) -> int:
        """The trainer forms the group again while it waits for samples or at its next
        publish: wait for that epoch."""
        assert self.store is not None
        deadline = time.monotonic() + self.rendezvous_timeout_s
        while (epoch := int(self.store.get("epoch"))) <= seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{_describe(self.rank)}: the trainer did not form the "
                                   f"weight-sync group again within {self.rendezvous_timeout_s}"
                                   " s of this restarted actor's request")
            time.sleep(0.05)
        return epoch

    def _join(self, epoch: int) -> None:
        """Meet every member under `epoch`'s keys and build that epoch's group."""
        assert self.store is not None
        self.epoch = epoch
        self._drop_group()
        self._report("-1")
        others = [r for r in range(self.world) if r != self.rank]
        _await_peers(self.store, others, self.rank, self.rendezvous_timeout_s, epoch)
        self.group = _make_group(self.store, self.rank, self.world, self.backend,
                                 self.timeout_s, epoch, self.interface, self.rendezvous_timeout_s)

    def _report(self, state: str) -> None:
        assert self.store is not None
        self.store.set(self._key(f"peer/{self.rank}"), state)

    def _announced(self) -> int | None:
        if self.closed:
            return None  # the store may be gone by now: do not ask it
        assert self.store is not None
        if self._retired:
            self._release_retired()
        try:
            value, epoch = (b.decode() for b in self.store.multi_get(["version", "epoch"]))
            if int(epoch) > self.epoch:  # a restarted actor joined: meet it in the new group
                self._join(int(epoch))
                # The trainer sends the new member the current version: every member takes it.
                self.last_version = None
            if value == "closed":
                self.closed = True
                self._report("closed")  # lets the trainer's close() return
                return None
        except dist.DistError as e:
            raise RuntimeError(f"{_describe(self.rank)}: weight store unreachable "
                               f"(trainer gone?): {e}") from e
        version = int(value)
        return version if version >= 0 else None

    def poll(self) -> int | None:
        version = self._announced()
        if version is None or (self.last_version is not None and version <= self.last_version):
            return None
        return version

    def receive_into(self, targets: Mapping[str, torch.Tensor]) -> int:
        me = _describe(self.rank)
        version = self.poll()
        if version is None:
            raise RuntimeError(f"{me}: no new weights announced (last {self.last_version})")
        assert self.store is not None
        try:
            if self._layout is None:
                self._layout = WeightLayout.from_json(self.store.get("manifest").decode())
            dests = self._layout.bind(targets)
            for ts, s in zip(dests, self._layout.slots, strict=True):
                for t in ts:
                    if not t.is_contiguous():
                        raise ValueError(f"target parameter {s.names[0]!r} is not contiguous")
        except ValueError as e:
            self._report(f"error: {e}")
            raise
        t0 = time.perf_counter()
        while True:
            while (verdict := self._await_go(version)) == "regroup":
                self._join(int(self.store.get("epoch")))
            if verdict != "ok":
                raise RuntimeError(f"{me}: trainer aborted version {version}: {verdict}")
            failure: TransferLost | None = None
            self._receiving = version
            try:
                self._receive(dests, version)
            except TransferLost as e:  # a member died: the trainer says whether to retry
                failure = e
            finally:
                self._receiving = None
            outcome = self._await_done(version)
            if outcome == "retry":
                self._join(self._await_new_epoch(self.epoch))
                continue
            if outcome != "ok":
                raise RuntimeError(f"{me}: trainer aborted version {version}: {outcome}")
            if failure is not None:
                self._report(f"error: {failure}")
                raise RuntimeError(f"{me}: weights of version {version} left incomplete, though "
                                   f"the trainer finished sending them: {failure}") from failure
            break
        self._finish_timing(t0)
        self.last_version = version
        return version

    def _wait(self, pending: tuple[dist.Work, str]) -> None:
        """Wait for data, in slices of _SETTLED_CHECK (a wait that times out leaves the
        collective posted); if the sender settles the transfer without this member meanwhile
        (a member died and the sender already lost its data), leave at once rather than at
        the collective's timeout."""
        work, what = pending
        assert self._receiving is not None
        if self.backend != "gloo":  # a timed-out NCCL wait may abort its communicator
            super()._wait(pending)
            return
        with self._collective(what):
            while True:
                try:
                    work.wait(_SETTLED_CHECK)
                    return
                except RuntimeError:
                    if work.is_completed():  # done just now, or failed: wait says which
                        work.wait(self.timeout)
                        return
                if (outcome := self._settled(self._receiving)) not in (None, "ok"):
                    self._drop_group()
                    raise RuntimeError(f"the trainer ended the transfer: {outcome}")

    def _settled(self, version: int) -> str | None:
        """The sender's word on the transfer of `version`, once it has given it."""
        assert self.store is not None
        done = self._key(f"done/{version}")
        return self.store.get(done).decode() if self.store.check([done]) else None

    def _receive(self, dests: list[list[torch.Tensor]], version: int) -> None:
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        self._broadcast(header, "the header")
        sent_version, bucket_bytes = (int(x) for x in header.tolist())
        if sent_version != version:
            raise RuntimeError(f"{_describe(self.rank)}: expected version {version}, trainer "
                               f"sent {sent_version}")
        with torch.no_grad():
            if bucket_bytes == 0:
                self._receive_per_parameter(dests)
            else:
                self._receive_buckets(dests, bucket_bytes)

    def _await_done(self, version: int) -> str:
        """The sender's word on the transfer of `version`. Its worst case: its own transfer
        times out, then it waits for a restarted actor to rejoin."""
        assert self.store is not None
        wait_s = self.timeout_s + self.rendezvous_timeout_s
        me = _describe(self.rank)
        _await_key(self.store, self._key(f"done/{version}"), wait_s, me,
                   f"{me}: the trainer (rank 0) did not settle the transfer "
                   f"of version {version} within {wait_s} s (sync.timeout_s)")
        outcome = self._settled(version)
        assert outcome is not None
        return outcome

    def _await_go(self, version: int) -> str:
        """Say this rank is ready for `version`; the sender's verdict."""
        assert self.store is not None
        self._report(str(version))
        go = self._key(f"go/{version}")
        me = _describe(self.rank)
        _await_key(self.store, go, self.timeout_s, me,
                   f"{me}: the trainer (rank 0) did not start the broadcast "
                   f"of version {version} within {self.timeout_s} s (sync.timeout_s)")
        return self.store.get(go).decode()

    def _receive_per_parameter(self, dests: list[list[torch.Tensor]]) -> None:
        assert self._layout is not None
        n = len(self._layout.slots)
        for i, (s, ts) in enumerate(zip(self._layout.slots, dests, strict=True)):
            # Receive straight into the engine's tensor when no cast or move is needed.
            direct = len(ts) == 1 and ts[0].dtype == s.dtype and ts[0].device == self.device
            buf = ts[0] if direct else torch.empty(s.shape, dtype=s.dtype, device=self.device)
            self._broadcast(buf, f"tensor {i + 1}/{n}")
            if not direct:
                for t in ts:
                    t.copy_(buf)

    def _receive_buckets(self, dests: list[list[torch.Tensor]], bucket_bytes: int) -> None:
        assert self._layout is not None
        buckets = self._plan(bucket_bytes)
        buffers = self._bucket_buffers(buckets)
        flat = [[t.view(-1) for t in ts] for ts in dests]

        def post(b: int) -> tuple[dist.Work, str]:
            return self._start(buffers[b % 2][:buckets[b][0]], f"bucket {b + 1}/{len(buckets)}")

        pending = post(0) if buckets else None
        for b, (nbytes, pieces) in enumerate(buckets):
            assert pending is not None
            self._wait(pending)
            if b + 1 < len(buckets):
                pending = post(b + 1)  # lands in the other buffer while this one is unpacked
            buf = buffers[b % 2][:nbytes]
            for p in pieces:
                dtype = self._layout.slots[p.slot].dtype
                src = buf[p.offset:p.offset + p.numel * dtype.itemsize].view(dtype)
                for t in flat[p.slot]:
                    t[p.start:p.start + p.numel].copy_(src)

    def close(self) -> None:
        if self.store is None:
            return
        if not self.closed:
            try:
                self._report("closed")
            except dist.DistError:
                pass  # the trainer, which hosts the store, is already gone: nobody to tell
        self.group = None
        self.store = None
