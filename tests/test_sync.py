"""Weight channels between real OS processes: shared memory and gloo broadcast."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipelinerl.proc.ports import free_port
from pipelinerl.sync import (
    BroadcastWeightReceiver,
    BroadcastWeightSender,
    ShmWeightReceiver,
    ShmWeightSender,
    make_receiver,
    make_sender,
)
from pipelinerl.sync import shm as shm_mod
from pipelinerl.sync.base import CastWeights
from pipelinerl.sync.layout import WeightLayout
from pipelinerl.sync.shm import shm_path

torch.set_num_threads(1)
SPAWN = mp.get_context("spawn")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _weights(version: int) -> dict[str, torch.Tensor]:
    """A tiny model whose values depend on position and version; lm_head is tied to embed."""
    def ramp(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n = int(torch.tensor(shape).prod())
        return (torch.arange(n, dtype=torch.float32) / 8 + version).reshape(shape).to(dtype)

    embed = ramp(40, 8)
    return {
        EMBED: embed,
        "model.layers.0.mlp.weight": ramp(8, 24),
        "model.layers.0.scale": ramp(3, dtype=torch.bfloat16),  # odd size and other dtype
        "model.layers.0.input_layernorm.weight": -ramp(8),
        "model.norm.weight": ramp(8),
        HEAD: embed,
    }


def _targets(dtype: torch.dtype, with_head: bool = True) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v, dtype=dtype) for k, v in _weights(0).items()}
    if not with_head:
        del out[HEAD]
    return out


def _pack(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, Any]]:
    # By value: tensors sent through a queue share memory via fds that die with the child.
    return {k: (t.dtype, t.float().numpy()) for k, t in tensors.items()}


def _unpack(packed: dict[str, tuple[torch.dtype, Any]]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(a).to(dtype) for k, (dtype, a) in packed.items()}


def _assert_same(received: dict[str, torch.Tensor], version: int) -> None:
    for name, t in received.items():
        want = _weights(version)[name].to(t.dtype)
        assert torch.equal(t, want), name


def _run_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _get(q: Any, timeout: float = 60.0) -> Any:
    item = q.get(timeout=timeout)
    if isinstance(item, tuple) and item and item[0] == "error":
        raise AssertionError(f"child failed: {item[1]}")
    return item


def _reap(*procs: Any) -> None:
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
            p.join()


# ---- shared memory ----------------------------------------------------------------------


def _shm_reader(run_id: str, q: Any) -> None:
    torch.set_num_threads(1)
    try:
        r = ShmWeightReceiver(run_id)
        q.put(("first poll", r.poll()))  # before the sender has published
        deadline = time.monotonic() + 30
        while (version := r.poll()) is None:
            assert time.monotonic() < deadline, "nothing published"
            time.sleep(0.005)
        fp32, bf16 = _targets(torch.float32), _targets(torch.bfloat16, with_head=False)
        assert r.receive_into(fp32) == version
        assert r.receive_into(bf16) == version  # the same version may be loaded again
        q.put((version, _pack(fp32), _pack(bf16), r.poll()))
        r.close()
    except BaseException as e:
        q.put(("error", repr(e)))


def test_shm_across_processes_tied_and_bf16() -> None:
    run_id = _run_id()
    q = SPAWN.Queue()
    reader = SPAWN.Process(target=_shm_reader, args=(run_id, q))
    reader.start()
    sender = ShmWeightSender(run_id)
    try:
        assert _get(q) == ("first poll", None)
        sender.publish(_weights(7), version=7)
        version, fp32, bf16, poll_after = _get(q)
        fp32, bf16 = _unpack(fp32), _unpack(bf16)
        assert version == 7 and poll_after is None
        _assert_same(fp32, 7)
        _assert_same(bf16, 7)
        assert bf16[EMBED].dtype == torch.bfloat16
        # Tied weights are stored once: the layout has one slot for embed and lm_head.
        assert len(sender._layout.slots) == len(_weights(0)) - 1
    finally:
        _reap(reader)
        sender.close()
    assert not shm_path(run_id).exists()


def _shm_writer(run_id: str, n_versions: int, to_parent: Any, to_child: Any) -> None:
    torch.set_num_threads(1)
    try:
        sender = ShmWeightSender(run_id)
        weights = {f"w{i}": torch.empty(256, 1024) for i in range(4)}  # 4 MB
        for v in range(1, n_versions + 1):
            for t in weights.values():
                t.fill_(v)
            sender.publish(weights, v)
            time.sleep(0.002 * (v % 3))  # vary the phase against the reader
        to_parent.put("done")
        to_child.get(timeout=60)  # keep the file until the reader has finished
        sender.close()
    except BaseException as e:
        to_parent.put(("error", repr(e)))


def test_shm_reader_racing_writer_never_sees_a_torn_copy() -> None:
    run_id, n_versions = _run_id(), 150
    to_parent, to_child = SPAWN.Queue(), SPAWN.Queue()
    writer = SPAWN.Process(target=_shm_writer, args=(run_id, n_versions, to_parent, to_child))
    writer.start()
    try:
        r = ShmWeightReceiver(run_id, timeout_s=30)
        targets = {f"w{i}": torch.empty(256, 1024) for i in range(4)}
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while n_versions not in seen:
            assert time.monotonic() < deadline
            if r.poll() is None:
                continue
            v = r.receive_into(targets)
            for name, t in targets.items():
                assert bool((t == v).all()), f"torn copy: {name} mixes versions around {v}"
            seen.add(v)
        assert _get(to_parent) == "done"
        assert len(seen) > 5
        r.close()
    finally:
        to_child.put("stop")
        _reap(writer)
    print(f"versions received {len(seen)}/{n_versions}, torn copies retried {r.torn_retries}")


def test_shm_errors_name_the_parameter() -> None:
    run_id = _run_id()
    r = ShmWeightReceiver(run_id)
    assert r.poll() is None
    with pytest.raises(RuntimeError, match="no weights published"):
        r.receive_into(_targets(torch.float32))
    sender = ShmWeightSender(run_id)
    try:
        sender.publish(_weights(1), 1)
        assert r.poll() == 1
        bad = _targets(torch.float32) | {"model.extra": torch.zeros(2)}
        with pytest.raises(ValueError, match="model.extra"):
            r.receive_into(bad)
        missing = _targets(torch.float32)
        del missing["model.norm.weight"]
        with pytest.raises(ValueError, match="model.norm.weight"):
            r.receive_into(missing)
        wrong = _targets(torch.float32) | {"model.norm.weight": torch.zeros(9)}
        with pytest.raises(ValueError, match=r"model.norm.weight.*\(8,\).*\(9,\)"):
            r.receive_into(wrong)
        tied_target = _targets(torch.float32)
        tied_target[HEAD] = tied_target[EMBED]  # an engine that ties them too: copied once
        assert r.receive_into(tied_target) == 1
        _assert_same(tied_target, 1)
        tied_wrongly = _targets(torch.float32)
        tied_wrongly["model.norm.weight"] = tied_wrongly["model.layers.0.input_layernorm.weight"]
        with pytest.raises(ValueError, match="are one tensor"):
            r.receive_into(tied_wrongly)
        untied = _weights(2) | {HEAD: _weights(2)[EMBED].clone()}
        with pytest.raises(ValueError, match="lm_head.weight"):
            sender.publish(untied, 2)
        sender._header[1] += 1  # what a trainer that dies mid-publish leaves: an odd seqlock
        assert r.poll() is None
        r.timeout_s = 0.2
        with pytest.raises(TimeoutError, match="crashed mid-write"):
            r.receive_into(_targets(torch.float32))
    finally:
        sender.close()
        r.close()


def test_shm_next_run_replaces_a_crashed_runs_file() -> None:
    run_id = _run_id()
    crashed = ShmWeightSender(run_id)
    crashed.publish(_weights(1), 1)  # never closed, like a trainer that died
    r = ShmWeightReceiver(run_id)
    targets = _targets(torch.float32)
    assert r.receive_into(targets) == 1
    restarted = ShmWeightSender(run_id)
    try:
        # New layout, new file, and an older version (resumed from an earlier checkpoint):
        # the receiver follows the new trainer.
        restarted.publish({"only": torch.full((5,), 2.0)}, 0)
        assert r.poll() == 0
        only = {"only": torch.zeros(5)}
        assert r.receive_into(only) == 0 and bool((only["only"] == 2).all())
        assert r.poll() is None
        with pytest.raises(ValueError, match="not newer"):
            restarted.publish({"only": torch.zeros(5)}, 0)
        crashed.close()  # must not unlink the file the restarted sender owns
        assert shm_path(run_id).exists()
    finally:
        restarted.close()
        r.close()
    assert not shm_path(run_id).exists()


def _shm_sender_killed(run_id: str, shm_dir: str) -> None:
    ShmWeightSender(run_id, shm_dir).publish(_weights(1), 1)
    os._exit(0)  # killed outright: no close, no unlink


def test_shm_files_no_live_sender_holds_are_reclaimed_by_the_next_sender(tmp_path: Path) -> None:
    live = ShmWeightSender(_run_id(), tmp_path)
    live.publish(_weights(1), 1)
    dead_id = _run_id()
    child = SPAWN.Process(target=_shm_sender_killed, args=(dead_id, str(tmp_path)))
    child.start()
    _reap(child)
    assert child.exitcode == 0
    dead = shm_path(dead_id, tmp_path)
    half_built = tmp_path / f"{dead.name}.tmp-999999"  # a sender killed before its rename
    half_built.write_bytes(b"x")
    senders = [live, ShmWeightSender(_run_id(), tmp_path)]
    try:
        # Within a minute a file may be one a sender has created and not locked yet: kept.
        assert dead.exists() and half_built.exists()
        old = time.time() - 2 * shm_mod._STALE_AFTER_S
        for path in (live.path, dead, half_built):
            os.utime(path, (old, old))
        senders.append(ShmWeightSender(_run_id(), tmp_path))
        assert not dead.exists() and not half_built.exists()
        assert live.path.exists()  # its sender holds it
    finally:
        for sender in senders:
            sender.close()
    assert not live.path.exists()


class _RecordingHeader:
    """Stands in for a receiver's header array: logs which words are read."""

    def __init__(self, header: Any, log: list[str]) -> None:
        self.header, self.log = header, log

    def __getitem__(self, i: int) -> Any:
        self.log.append({shm_mod._SEQ_I: "load seq", shm_mod._VERSION_I: "load version"}[i])
        return self.header[i]


def test_shm_seqlock_puts_barriers_between_header_and_data_fake_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the memory barriers sit (they matter on aarch64, where plain loads and stores may
    be reordered; x86-64 keeps their order, so no race test here can show it). A fake fence
    records what the file and the targets hold each time it runs."""
    run_id = _run_id()
    sender, receiver = ShmWeightSender(run_id), ShmWeightReceiver(run_id)
    log: list[str] = []
    targets = _targets(torch.float32)
    try:
        sender.publish(_weights(1), 1)
        receiver.poll()
        file_view = ShmWeightReceiver(run_id)
        file_view.poll()

        def writer_fence() -> None:
            seq = int(file_view._header[shm_mod._SEQ_I])
            embed = file_view._views[0]  # slot 0: the embedding, published first
            log.append(f"fence seq={seq} embed_v2={bool(torch.equal(embed, _weights(2)[EMBED]))}")

        monkeypatch.setattr(shm_mod, "_fence", writer_fence)
        sender.publish(_weights(2), 2)
        assert log == ["fence seq=3 embed_v2=False", "fence seq=3 embed_v2=True"]
        assert int(file_view._header[shm_mod._SEQ_I]) == 4

        log.clear()
        monkeypatch.setattr(shm_mod, "_fence", lambda: log.append(f"fence filled={bool(targets[EMBED].any())}"))
        receiver._header = _RecordingHeader(receiver._header, log)
        assert receiver.receive_into(targets) == 2
        assert log == ["load seq", "fence filled=False", "load version", "fence filled=True", "load seq"]
        _assert_same(targets, 2)
        file_view.close()
    finally:
        receiver.close()
        sender.close()


class _DeviceWeights:
    """Host tensors handed over as if they lived on `device` (StreamedWeights' contract)."""

    replayable = True

    def __init__(self, weights: dict[str, torch.Tensor], device: torch.device) -> None:
        self.layout, self.device = WeightLayout.from_weights(weights), device
        self._sources = self.layout.sources(weights)

    def tensors(self):
        return iter(self._sources)


def test_shm_publish_from_cuda_1_names_cuda_1_in_every_cuda_call_recording_stand_in(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer on cuda:1 (the engine on cuda:0): the copy-done event is recorded on cuda:1's
    stream, where the copies were queued, and the buffer is page-locked from cuda:1's context
    for every context (portable), whatever device is current. No CUDA here: a recording
    stand-in for torch.cuda's calls; host tensors stand in for cuda:1's."""
    gpu, calls, current = torch.device("cuda", 1), [], ["cuda:0"]

    class Event:
        def record(self, stream=None) -> None:
            calls.append(("record", stream))

        def synchronize(self) -> None:
            calls.append(("synchronize",))

    class DeviceGuard:
        def __init__(self, device) -> None:
            self.device = torch.device(device)

        def __enter__(self) -> None:
            current.append(str(self.device))

        def __exit__(self, *exc) -> None:
            current.pop()

    class Cudart:
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            calls.append(("register", current[-1], flags))
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            calls.append(("unregister", current[-1]))
            return 0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "device", DeviceGuard)
    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    sender = ShmWeightSender(_run_id())
    try:
        sender.publish(_DeviceWeights(_weights(1), gpu), 1)
        sender.settle()
    finally:
        sender.close()
    register, record, synchronize, unregister = calls
    assert register[:2] == ("register", "cuda:1") and register[2] & 1  # cudaHostRegisterPortable
    assert record == ("record", f"stream of {gpu}")
    assert synchronize == ("synchronize",) and unregister == ("unregister", "cuda:1")


def test_shm_publish_from_a_gpu_returns_before_the_copies_land_fake_device_event(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From a GPU the sender enqueues its copies and returns; readers see the version only once
    they have landed, and the next publish (or close) waits for that. No CUDA here: host
    tensors stand in for the device's and a gate stands in for its copy-done event."""
    run_id = _run_id()
    sender, receiver = ShmWeightSender(run_id), ShmWeightReceiver(run_id, timeout_s=5)
    gate = threading.Event()
    monkeypatch.setattr(shm_mod, "_landing", lambda gpu: gate.wait)
    targets = _targets(torch.float32)
    try:
        sender.publish(_weights(1), 1)  # returns with the copies "in flight"
        time.sleep(0.05)
        assert receiver.poll() is None  # seq still odd: nothing to load yet
        gate.set()
        sender.settle()
        assert receiver.poll() == 1 and receiver.receive_into(targets) == 1
        _assert_same(targets, 1)

        gate.clear()
        sender.publish(_weights(2), 2)
        published_3 = threading.Thread(target=sender.publish, args=(_weights(3), 3))
        published_3.start()  # waits for version 2 to land before it writes anything
        time.sleep(0.05)
        assert published_3.is_alive() and receiver.poll() is None
        gate.set()
        published_3.join(5)
        sender.settle()
        assert receiver.receive_into(targets) == 3
        _assert_same(targets, 3)

        def device_error() -> None:
            raise RuntimeError("an illegal memory access")

        monkeypatch.setattr(shm_mod, "_landing", lambda gpu: device_error)
        sender.publish(_weights(4), 4)
        with pytest.raises(RuntimeError, match="publishing weights to .* failed") as failed:
            sender.settle()
        assert "illegal memory access" in str(failed.value.__cause__)
        assert receiver.poll() is None  # the torn version 4 is never offered
    finally:
        receiver.close()
        sender.close()
    assert not shm_path(run_id).exists()


def test_factory() -> None:
    with pytest.raises(ValueError, match=r"known: \['broadcast', 'shm'\]"):
        make_sender("carrier-pigeon")
    with pytest.raises(ValueError, match="known"):
        make_receiver("nccl")
    run_id = _run_id()
    sender = make_sender("shm", run_id=run_id)
    receiver = make_receiver("shm", run_id=run_id)
    assert isinstance(sender, ShmWeightSender) and isinstance(receiver, ShmWeightReceiver)
    sender.publish(_weights(3), 3)
    assert receiver.poll() == 3
    sender.close()
    receiver.close()
    with pytest.raises(TypeError, match="n_actors"):
        make_sender("shm", run_id=run_id, n_actors=2)


# ---- torch.distributed broadcast (gloo) ---------------------------------------------------


def _serve(r: BroadcastWeightReceiver, actor_id: int, versions: list[int],
           targets: dict[str, torch.Tensor], q: Any, report: Any) -> None:
    """Like an actor: receive each version once announced and put (actor_id, version,
    report(version)); then keep polling until the trainer closes the channel."""
    for expected in versions:
        deadline = time.monotonic() + 60
        while r.poll() is None:
            assert time.monotonic() < deadline, f"version {expected} never announced"
            time.sleep(0.001)
        v = r.receive_into(targets)
        q.put((actor_id, v, report(v)))
    while not r.closed:
        assert r.poll() is None
        time.sleep(0.005)
    r.close()
    q.put((actor_id, "closed"))


def _bcast_receiver(init: str, actor_id: int, n_actors: int, versions: list[int],
                    dtype: torch.dtype, timeout_s: float, q: Any, may_rejoin: bool = False) -> None:
    torch.set_num_threads(1)
    try:
        r = BroadcastWeightReceiver(init, actor_id, n_actors, timeout_s=timeout_s,
                                    rendezvous_timeout_s=60, may_rejoin=may_rejoin)
        targets = _targets(dtype, with_head=actor_id == 0)
        _serve(r, actor_id, versions, targets, q, lambda v: _pack(targets))
    except BaseException as e:
        q.put(("error", f"actor {actor_id}: {e}"))


def test_broadcast_bucketed_and_per_parameter_to_two_actors() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    versions = [1, 2, 3]
    queues = [SPAWN.Queue(), SPAWN.Queue()]
    dtypes = [torch.float32, torch.bfloat16]
    actors = [
        SPAWN.Process(target=_bcast_receiver, args=(init, i, 2, versions, dtypes[i], 30.0, q))
        for i, q in enumerate(queues)
    ]
    for p in actors:
        p.start()
    # 256-byte buckets split every large tensor across buckets.
    sender = BroadcastWeightSender(init, n_actors=2, bucket_mb=256 / 2**20, timeout_s=30)
    try:
        for v in versions:
            # Receivers learn the mode and bucket size from the header.
            sender.per_parameter = v == 2
            if v == 3:
                sender.bucket_bytes = 2**20  # everything in one bucket
            sender.publish(_weights(v), v)
            for i, q in enumerate(queues):
                actor_id, got_v, received = _get(q)
                assert (actor_id, got_v) == (i, v)
                received = _unpack(received)
                _assert_same(received, v)
                assert received[EMBED].dtype == dtypes[i]
            assert sender.last_transfer_s > 0
        t0 = time.monotonic()
        sender.close()  # returns once both actors have seen it
        assert time.monotonic() - t0 < 5
        assert [_get(q) for q in queues] == [(0, "closed"), (1, "closed")]
    finally:
        sender.close()
        _reap(*actors)


def test_broadcast_dead_actor_fails_loudly_naming_it() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    # One queue each: a child killed while its queue feeder holds the lock would block a shared one.
    q_survivor, q_doomed = SPAWN.Queue(), SPAWN.Queue()
    survivor = SPAWN.Process(target=_bcast_receiver,
                             args=(init, 0, 2, [1, 2], torch.float32, 30.0, q_survivor))
    doomed = SPAWN.Process(target=_bcast_receiver,
                           args=(init, 1, 2, [1], torch.float32, 30.0, q_doomed))
    survivor.start()
    doomed.start()
    # Spawned children take seconds to import torch: only the join waits that long.
    sender = BroadcastWeightSender(init, n_actors=2, timeout_s=3, rendezvous_timeout_s=60)
    try:
        sender.publish(_weights(1), 1)
        assert _get(q_survivor)[:2] == (0, 1) and _get(q_doomed)[:2] == (1, 1)
        doomed.kill()
        doomed.join()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"actor 1 \(rank 2\)"):
            sender.publish(_weights(2), 2)
        assert time.monotonic() - t0 < 3 + 2
        # The survivor was waiting for version 2: it hears the abort, with the reason.
        tag, message = q_survivor.get(timeout=30)
        assert tag == "error" and "aborted version 2" in message and "actor 1 (rank 2)" in message
        with pytest.raises(RuntimeError, match="broken"):
            sender.publish(_weights(3), 3)
    finally:
        sender.close()
        survivor.kill()
        _reap(survivor, doomed)


def test_broadcast_group_is_formed_again_when_a_dead_actor_is_restarted() -> None:
    """As the launcher restarts a dead actor: the new process rejoins, the trainer forms a new
    group at its next publish, and every member receives every later version (on main the
    new process was refused, 'another process already joined with this actor id')."""
    init = f"tcp://127.0.0.1:{free_port()}"
    q_survivor, q_doomed, q_new = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    survivor = SPAWN.Process(target=_bcast_receiver,
                             args=(init, 0, 2, [1, 2, 3], torch.float32, 30.0, q_survivor))
    doomed = SPAWN.Process(target=_bcast_receiver,
                           args=(init, 1, 2, [1], torch.float32, 30.0, q_doomed))
    survivor.start()
    doomed.start()
    sender = BroadcastWeightSender(init, n_actors=2, timeout_s=30, rendezvous_timeout_s=60)
    restarted = SPAWN.Process(target=_bcast_receiver,
                              args=(init, 1, 2, [2, 3], torch.float32, 30.0, q_new, True))
    try:
        sender.publish(_weights(1), 1)
        assert _get(q_survivor)[:2] == (0, 1) and _get(q_doomed)[:2] == (1, 1)
        doomed.kill()
        doomed.join()
        restarted.start()
        for v in (2, 3):
            sender.publish(_weights(v), v)
            for q, actor_id in ((q_survivor, 0), (q_new, 1)):
                got = _get(q)
                assert got[:2] == (actor_id, v), got
                _assert_same(_unpack(got[2]), v)
        assert sender.epoch == 1
        sender.close()
        assert (_get(q_survivor), _get(q_new)) == ((0, "closed"), (1, "closed"))
    finally:
        sender.close()
        survivor.kill()
        restarted.kill()
        _reap(survivor, doomed, restarted)


_BIG = 8 * 2**20  # float32 elements: 32 MB, more than loopback's socket buffers hold


def _big_weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((_BIG,), float(version))}


class _DiesMidTransfer(BroadcastWeightReceiver):
    """Exits at once, as if SIGKILLed, when its second transfer's first bucket is posted:
    the header is through, the weights are not."""

    def _start(self, t: torch.Tensor, what: str) -> tuple[Any, str]:
        if what.startswith("bucket 1/") and self.last_version is not None:
            os._exit(7)
        return super()._start(t, what)


def _big_receiver(init: str, actor_id: int, versions: list[int], q: Any,
                  may_rejoin: bool = False, dies: bool = False, n_actors: int = 2,
                  go: Any = None) -> None:
    """`go`: an event to wait for first (a restart, its imports done ahead of time)."""
    torch.set_num_threads(1)
    try:
        if go is not None:
            go.wait()
        cls = _DiesMidTransfer if dies else BroadcastWeightReceiver
        r = cls(init, actor_id, n_actors, timeout_s=30.0, rendezvous_timeout_s=60,
                may_rejoin=may_rejoin)
        target = torch.zeros(_BIG)
        _serve(r, actor_id, versions, {"w": target}, q,
               lambda v: bool((target == float(v)).all()))
    except BaseException as e:
        q.put(("error", f"actor {actor_id}: {e}"))


@pytest.mark.parametrize(("bucket_mb", "cast"), [
    (64.0, False),  # one bucket
    (4.0, False),  # eight, two in flight
    (4.0, True),  # a trainer's weights cast to a bfloat16 engine's dtype: sent again as well
])
def test_broadcast_member_killed_mid_transfer_is_restarted_and_the_version_sent_again(
        bucket_mb: float, cast: bool) -> None:
    """The race behind a flaky reliability test: an actor killed inside the weight broadcast.
    The trainer waits for its restart, forms the group again and sends the same version to
    every member; the survivor returns only once, with the whole version."""
    init = f"tcp://127.0.0.1:{free_port()}"
    q_survivor, q_doomed, q_new = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    survivor = SPAWN.Process(target=_big_receiver, args=(init, 0, [1, 2, 3], q_survivor))
    doomed = SPAWN.Process(target=_big_receiver, args=(init, 1, [1, 2], q_doomed, False, True))
    restarted = SPAWN.Process(target=_big_receiver, args=(init, 1, [2, 3], q_new, True))
    survivor.start()
    doomed.start()
    sender = BroadcastWeightSender(init, n_actors=2, bucket_mb=bucket_mb, timeout_s=30,
                                   rendezvous_timeout_s=60)

    def launcher() -> None:  # as the launcher does: restart the actor once it has died
        doomed.join()
        restarted.start()

    watcher = threading.Thread(target=launcher)

    def weights(v: int) -> Any:  # whole numbers: exact in bfloat16 too
        return CastWeights(_big_weights(v), torch.bfloat16) if cast else _big_weights(v)

    try:
        sender.publish(weights(1), 1)
        assert _get(q_survivor) == (0, 1, True) and _get(q_doomed) == (1, 1, True)
        watcher.start()
        sender.publish(weights(2), 2)  # the doomed actor dies inside this transfer
        assert doomed.exitcode == 7 and sender.epoch == 1
        assert _get(q_survivor) == (0, 2, True)
        assert _get(q_new) == (1, 2, True)
        sender.publish(weights(3), 3)
        assert (_get(q_survivor), _get(q_new)) == ((0, 3, True), (1, 3, True))
        sender.close()
        assert (_get(q_survivor), _get(q_new)) == ((0, "closed"), (1, "closed"))
        assert q_doomed.empty()
    finally:
        sender.close()
        if watcher.is_alive():
            watcher.join(timeout=60)
        survivor.kill()
        restarted.kill()
        _reap(survivor, doomed, restarted)


def test_broadcast_member_killed_mid_transfer_and_not_restarted_aborts_everyone() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    q_survivor, q_doomed = SPAWN.Queue(), SPAWN.Queue()
    survivor = SPAWN.Process(target=_big_receiver, args=(init, 0, [1, 2], q_survivor))
    doomed = SPAWN.Process(target=_big_receiver, args=(init, 1, [1, 2], q_doomed, False, True))
    survivor.start()
    doomed.start()
    sender = BroadcastWeightSender(init, n_actors=2, timeout_s=30, rendezvous_timeout_s=60)
    try:
        sender.publish(_big_weights(1), 1)
        assert _get(q_survivor)[:2] == (0, 1) and _get(q_doomed)[:2] == (1, 1)
        sender.rendezvous_timeout_s = 2  # how long a restart may take to rejoin
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="no restarted actor rejoined within 2 s"):
            sender.publish(_big_weights(2), 2)
        assert time.monotonic() - t0 < 2 + 5
        tag, message = q_survivor.get(timeout=30)
        assert tag == "error" and "aborted version 2" in message, message
        with pytest.raises(RuntimeError, match="broken"):
            sender.publish(_big_weights(3), 3)
    finally:
        sender.close()
        survivor.kill()
        _reap(survivor, doomed)


def _await_rejoined(sender: BroadcastWeightSender) -> None:
    """As the trainer does while it waits for samples: ask until a restarted actor waits."""
    deadline = time.monotonic() + 60
    while not sender.rejoined():
        assert time.monotonic() < deadline, "the restarted actor never asked to rejoin"
        time.sleep(0.05)


@pytest.mark.parametrize(("moment", "n_actors"), [
    ("between publishes", 1),
    ("between publishes", 2),  # the live actor takes the version again
    ("before the first publish", 1),
    ("mid-transfer", 1),
])
def test_broadcast_actor_killed_at_any_moment_is_restarted_and_gets_the_current_weights(
        moment: str, n_actors: int) -> None:
    """Issue 37, D1: actor 0 SIGKILLed and restarted by the launcher. Between publishes the
    trainer waits for that actor's samples while the restart waits in its constructor for the
    group to form again; on main only the trainer's next publish formed it, which one actor
    never let come (the restart timed out). Now the trainer asks `rejoined()` as it waits and
    publishes its current version again (any version before the first publish); every member
    takes it. Mid-transfer, the version is sent again (as on main)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    first = [] if moment == "before the first publish" else [1]
    mid = moment == "mid-transfer"
    q_doomed, q_new, q_live = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    doomed = SPAWN.Process(target=_big_receiver, args=(
        init, 0, first + [2] * mid, q_doomed, False, mid, n_actors))
    again = 2 if mid else first[0] if first else 5  # what the trainer sends the restart
    restarted = SPAWN.Process(target=_big_receiver, args=(
        init, 0, [again, again + 1], q_new, True, False, n_actors))
    live = SPAWN.Process(target=_big_receiver, args=(
        init, 1, first + [again, again + 1], q_live, False, False, n_actors))
    doomed.start()
    if n_actors == 2:
        live.start()
    sender = BroadcastWeightSender(init, n_actors=n_actors, bucket_mb=4.0, timeout_s=30,
                                   rendezvous_timeout_s=60)
    queues = [q_new, q_live][:n_actors]

    def launcher() -> None:  # restart the actor once it has died
        doomed.join()
        restarted.start()

    watcher = threading.Thread(target=launcher)
    try:
        for v in first:
            sender.publish(_big_weights(v), v)
            assert [_get(q)[:2] for q in [q_doomed, q_live][:n_actors]] == [(0, v), (1, v)][:n_actors]
        watcher.start()
        if mid:
            sender.publish(_big_weights(2), 2)  # the actor dies inside this transfer
            assert doomed.exitcode == 7
        else:
            doomed.kill()
            _await_rejoined(sender)  # the trainer, waiting for samples
            sender.publish(_big_weights(again), again)
        for v in (again, again + 1):
            if v > again:
                sender.publish(_big_weights(v), v)
            assert [_get(q) for q in queues] == [(0, v, True), (1, v, True)][:n_actors]
        assert sender.epoch == 1
        sender.close()
        assert [_get(q) for q in queues] == [(0, "closed"), (1, "closed")][:n_actors]
    finally:
        sender.close()
        watcher.join(timeout=60)
        for p in (restarted, live):
            if p.pid is not None:
                p.kill()
        _reap(*(p for p in (doomed, restarted, live) if p.pid is not None))


def _gloo_resources() -> tuple[int, int]:
    """(threads, sockets) of this process."""
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile (the listing's own fd)
            pass
    return len(os.listdir("/proc/self/task")), sockets


def test_broadcast_groups_left_by_restarted_actors_are_released() -> None:
    """Issue 37, D5: every regroup left the old gloo group, with its threads and sockets, for
    the rest of the run (here 3 threads and a socket per restart). A group with nothing posted
    in it is released: three restarts of the only actor leave the sender as after one."""
    init = f"tcp://127.0.0.1:{free_port()}"
    q = SPAWN.Queue()
    actor = SPAWN.Process(target=_bcast_receiver, args=(init, 0, 1, [1], torch.float32, 30.0, q))
    actor.start()
    sender = BroadcastWeightSender(init, n_actors=1, timeout_s=30, rendezvous_timeout_s=60)
    held = []
    try:
        sender.publish(_weights(1), 1)
        assert _get(q)[:2] == (0, 1)
        for v in range(2, 5):
            actor.kill()
            actor.join()
            actor.close()
            q = SPAWN.Queue()
            actor = SPAWN.Process(target=_bcast_receiver,
                                  args=(init, 0, 1, [v], torch.float32, 30.0, q, True))
            actor.start()
            sender.publish(_weights(v), v)  # forms the group again to take the restart
            assert _get(q)[:2] == (0, v)
            held.append(_gloo_resources())
        assert sender.epoch == 3
        assert held[-1] == held[0], held
    finally:
        sender.close()
        actor.kill()
        _reap(actor)


class _OneTensor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(_BIG))


def _sharded_trainer(rank: int, world: int, init: str) -> int | None:
    """A 2-rank FSDP2 trainer publishing through `Trainer`: versions 1 and 2 (a receiver dies
    inside 2), then, waiting for samples, its current version to a restarted receiver, then 3.
    The sender's epoch (rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pipelinerl.config import load_config
    from pipelinerl.rl.process_group import share_groups
    from pipelinerl.roles.trainer import Trainer

    model = fully_shard(_OneTensor(), mesh=init_device_mesh("cpu", (world,)))
    sender = (BroadcastWeightSender(init, n_actors=1, bucket_mb=4.0, timeout_s=30,
                                    rendezvous_timeout_s=60) if rank == 0 else None)
    trainer = Trainer(load_config(overrides=["trainer.strategy=fsdp2"]), model, None, sender)

    def publish(version: int) -> None:
        trainer.step = version
        with torch.no_grad():
            model.w.to_local().fill_(float(version))  # this rank's shard
        trainer.publish()

    publish(1)
    publish(2)  # the receiver dies inside it: every rank gathers again
    if sender is None:  # rank 0 waits for samples: the other ranks wait for its batch
        share_groups(None, rank, world, trainer.publish)
    else:
        deadline = time.monotonic() + 60
        while sender.epoch < 2:  # a second restart, taken in while waiting
            assert time.monotonic() < deadline, "the second restart never rejoined"
            trainer.serve_rejoined()
            time.sleep(0.05)
        share_groups([], rank, world)
    publish(3)
    if sender is None:
        return None
    sender.close()
    return sender.epoch


def test_a_sharded_trainer_sends_a_version_again_to_restarted_receivers() -> None:
    """Issue 37: FSDP2 gathers are collectives of every trainer rank, so on main a transfer cut
    by a dead receiver could not be sent again from rank 0 alone (the channel broke, 'streamed
    (sharded) weights cannot be sent again'). Rank 0 now leads each walk of the gathers and
    the other ranks follow: they gather again for the resend, and again when rank 0 publishes
    to a restart while it waits for samples."""
    from ranks import run_ranks

    init = f"tcp://127.0.0.1:{free_port()}"
    q_doomed, q_new, q_last = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    go_new, go_last = SPAWN.Event(), SPAWN.Event()
    doomed = SPAWN.Process(target=_big_receiver, args=(init, 0, [1, 2], q_doomed, False, True, 1))
    restarted = SPAWN.Process(target=_big_receiver,
                              args=(init, 0, [2], q_new, True, False, 1, go_new))
    last = SPAWN.Process(target=_big_receiver,
                         args=(init, 0, [2, 3], q_last, True, False, 1, go_last))
    got: list[Any] = []

    def launcher() -> None:  # restart the receiver when it dies; kill the restart once served
        doomed.join()
        go_new.set()
        got.append(_get(q_new))
        restarted.kill()
        restarted.join()
        go_last.set()

    for p in (doomed, restarted, last):
        p.start()
    watcher = threading.Thread(target=launcher)
    watcher.start()
    try:
        assert run_ranks(2, _sharded_trainer, init, timeout_s=180) == [2, None]
        watcher.join(timeout=60)
        assert _get(q_doomed) == (0, 1, True) and doomed.exitcode == 7
        assert got == [(0, 2, True)]
        assert [_get(q_last) for _ in range(3)] == [(0, 2, True), (0, 3, True), (0, "closed")]
    finally:
        watcher.join(timeout=60)
        restarted.kill()
        last.kill()
        _reap(doomed, restarted, last)


def test_broadcast_receiver_waiting_for_data_leaves_when_the_trainer_gives_up_hand_driven_sender() -> None:
    """A survivor whose data will never come (the sender failed on a dead member first) leaves
    its collective as soon as the sender settles the transfer, not at the collective's timeout.
    The sender's side is driven by hand through its store keys: go, then no data, then abort."""
    init = f"tcp://127.0.0.1:{free_port()}"
    q = SPAWN.Queue()
    actor = SPAWN.Process(target=_bcast_receiver, args=(init, 0, 1, [1], torch.float32, 30.0, q))
    actor.start()
    sender = BroadcastWeightSender(init, n_actors=1, timeout_s=30, rendezvous_timeout_s=60)
    try:
        assert sender.store is not None
        sender.store.set("manifest", WeightLayout.from_weights(_weights(1)).to_json())
        sender.store.set("version", "1")
        deadline = time.monotonic() + 30
        while sender.store.get("e0/peer/1") != b"1":
            assert time.monotonic() < deadline, "the actor never got ready for version 1"
            time.sleep(0.01)
        sender.store.set("e0/go/1", "ok")
        time.sleep(1.0)  # the actor now waits for the header, which is never sent
        t0 = time.monotonic()
        sender.store.set("e0/done/1", "abort: gave up before sending")
        tag, message = q.get(timeout=30)
        assert time.monotonic() - t0 < 5  # the collective's timeout is 30 s
        assert tag == "error" and "aborted version 1: abort: gave up" in message, message
    finally:
        if sender.store is not None:
            sender.store.set("e0/peer/1", "closed")
        sender.close()
        _reap(actor)


def test_broadcast_missing_actor_at_start_fails_loudly_naming_it() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            BroadcastWeightSender(init, n_actors=2, rendezvous_timeout_s=2)
        except BaseException as e:
            errors.append(e)

    t0 = time.monotonic()
    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        with pytest.raises(TimeoutError, match=r"actor 0 \(rank 1\).*missing: actor 1 \(rank 2\)$"):
            BroadcastWeightReceiver(init, 0, 2, rendezvous_timeout_s=1)
    finally:
        thread.join()
    assert time.monotonic() - t0 < 2 + 2
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
    assert str(errors[0]).endswith("missing: actor 1 (rank 2)")  # actor 0 did show up


def test_broadcast_mismatched_targets_fail_at_both_ends() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    errors: list[BaseException] = []

    def trainer() -> None:
        sender = BroadcastWeightSender(init, n_actors=1, timeout_s=10)
        try:
            sender.publish(_weights(1), 1)
        except BaseException as e:
            errors.append(e)
        finally:
            sender.close()

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        receiver = BroadcastWeightReceiver(init, 0, 1, timeout_s=10)
        while receiver.poll() is None:
            time.sleep(0.001)
        wrong = _targets(torch.float32) | {"model.norm.weight": torch.zeros(9)}
        with pytest.raises(ValueError, match="model.norm.weight"):
            receiver.receive_into(wrong)
    finally:
        thread.join()
    assert len(errors) == 1
    message = str(errors[0])
    assert re.search(r"actor 0 \(rank 1\) cannot take version 1: .*model.norm.weight", message)
    receiver.close()


def test_broadcast_backend_mismatch_fails_every_rank() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            BroadcastWeightSender(init, n_actors=1, rendezvous_timeout_s=10)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        with pytest.raises(ValueError, match="device cuda needs nccl but the trainer .* gloo"):
            BroadcastWeightReceiver(init, 0, 1, device="cuda", rendezvous_timeout_s=10)
    finally:
        thread.join()
    assert len(errors) == 1 and "actor 0 (rank 1): error: device cuda needs nccl" in str(errors[0])


def test_broadcast_receiver_without_trainer_times_out() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match="is the trainer up"):
        BroadcastWeightReceiver(init, 0, 1, rendezvous_timeout_s=0.5)
    with pytest.raises(ValueError, match="tcp://host:port"):
        BroadcastWeightReceiver("127.0.0.1:1234", 0, 1)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shm_into_cuda_page_locks_and_casts_on_the_device() -> None:
    run_id = _run_id()
    weights = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    sender, receiver = ShmWeightSender(run_id), ShmWeightReceiver(run_id)
    try:
        sender.publish({k: v.cuda() for k, v in weights.items()}, 1)
        assert sender._page_lock.ptr is not None  # GPU -> shm ran as DMA
        targets = {k: torch.zeros_like(v, dtype=torch.bfloat16, device="cuda")
                   for k, v in weights.items()}
        assert receiver.receive_into(targets) == 1
        assert receiver._page_lock.ptr is not None
        for k, v in weights.items():
            assert torch.equal(targets[k].cpu(), v.to(torch.bfloat16))
    finally:
        receiver.close()
        sender.close()


# ---- streamed weights (a sharded trainer's, gathered on demand) ----------------------------


_GLOO_THREADS = dist.ProcessGroupGloo._Options()._threads  # each may hold its last work


class _Streamed:
    """`StreamedWeights` over `_weights(version)` that yields fresh copies and records how
    many of them are alive whenever the sender asks for the next: a sender that kept them all
    (the whole model gathered at once) would show it."""

    replayable = False  # as a gathering source

    def __init__(self, version: int) -> None:
        self._weights = _weights(version)
        self.layout = WeightLayout.from_weights(self._weights)
        self.device = torch.device("cpu")
        self.most_alive = 0
        self.yielded = 0

    def tensors(self):
        alive: list[weakref.ref] = []
        for slot in self.layout.slots:
            self.most_alive = max(self.most_alive, sum(r() is not None for r in alive))
            t = self._weights[slot.names[0]].clone()
            alive.append(weakref.ref(t))
            self.yielded += 1
            yield t


def test_streamed_weights_are_sent_one_tensor_at_a_time_shm() -> None:
    run_id = _run_id()
    sender = ShmWeightSender(run_id)
    receiver = ShmWeightReceiver(run_id)
    try:
        for v in (1, 2):
            streamed = _Streamed(v)
            sender.publish(streamed, v)
            targets = _targets(torch.float32)
            assert receiver.receive_into(targets) == v
            _assert_same(targets, v)
            assert streamed.yielded == len(streamed.layout.slots)
            assert streamed.most_alive <= 1  # the previous copy at most, while the next is made
        with pytest.raises(ValueError, match="layout"):
            bigger = _Streamed(3)
            bigger.layout = WeightLayout.from_weights({**_weights(3), "x": torch.ones(2)})
            sender.publish(bigger, 3)
    finally:
        receiver.close()
        sender.close()


def test_streamed_weights_are_sent_one_tensor_at_a_time_broadcast() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    q = SPAWN.Queue()
    actor = SPAWN.Process(target=_bcast_receiver, args=(init, 0, 1, [1, 2], torch.float32, 30.0, q))
    actor.start()
    # 256-byte buckets: a tensor spans several buckets, a bucket holds pieces of several.
    sender = BroadcastWeightSender(init, n_actors=1, bucket_mb=256 / 2**20, timeout_s=30)
    try:
        for v in (1, 2):
            sender.per_parameter = v == 2
            streamed = _Streamed(v)
            sender.publish(streamed, v)
            _, got_v, received = _get(q)
            assert got_v == v
            _assert_same(_unpack(received), v)
            assert streamed.yielded == len(streamed.layout.slots)
            # Buckets are copies: at most the previous source. Per tensor, the source itself is
            # sent, and a gloo worker thread drops its reference to a finished broadcast only
            # just after `wait()` returned (it releases the work after marking it done): with
            # gloo's worker threads (2 by default) each holding its last one, up to 2 more may
            # be alive for a moment (seen: 2, and once 3 on a loaded machine); never the whole
            # stream (a sender holding it would show 4: the layout has 5 tensors).
            assert streamed.most_alive <= (1 + _GLOO_THREADS if sender.per_parameter else 1)
        sender.close()
        assert _get(q) == (0, "closed")
    finally:
        sender.close()
        _reap(actor)


def test_weights_cast_to_the_engine_dtype_halve_the_channel_and_arrive_as_the_engine_rounds_them(
) -> None:
    """A float32 trainer publishing to bfloat16 engines: the channel holds bfloat16 (half the
    floating bytes, ties kept, one tensor cast at a time), and an engine receives the very
    values it would have rounded float32 weights to."""
    run_id = _run_id()
    sender = ShmWeightSender(run_id)
    receiver = ShmWeightReceiver(run_id)
    try:
        for v in (1, 2):
            cast = CastWeights(_weights(v), torch.bfloat16)
            sender.publish(cast, v)
            bf16, fp32 = _targets(torch.bfloat16), _targets(torch.float32)
            assert receiver.receive_into(bf16) == v and receiver.receive_into(fp32) == v
            _assert_same(bf16, v)  # what casting float32 weights on receipt gives
            for name, t in fp32.items():
                assert torch.equal(t, _weights(v)[name].to(torch.bfloat16).float()), name
        assert {s.dtype for s in sender._layout.slots} == {torch.bfloat16}
        assert len(sender._layout.slots) == len(_weights(0)) - 1  # embed and head tied
        plain = WeightLayout.from_weights(_weights(0))
        floats32 = sum(s.nbytes for s in plain.slots if s.dtype == torch.float32)
        assert (sum(s.nbytes for s in plain.slots) - sum(s.nbytes for s in sender._layout.slots)
                == floats32 // 2)
    finally:
        receiver.close()
        sender.close()


class _Recording:
    """A sender that keeps what each publish handed it: the layout, and each tensor cast to
    its dtype, as the real senders copy it into the channel."""

    def __init__(self) -> None:
        self.published: list[tuple[WeightLayout, list[torch.Tensor]]] = []

    def publish(self, weights: Any, version: int) -> None:
        from pipelinerl.sync.base import open_weights

        layout, sources, _ = open_weights(weights, None)
        self.published.append((layout, [t.to(s.dtype, copy=True)
                                        for t, s in zip(sources, layout.slots, strict=True)]))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("engine_dtype", ["bfloat16", "float32"])
def test_an_unsharded_trainer_publishes_in_the_engine_dtype(engine_dtype: str) -> None:
    from tiny_models import tiny_hf_model

    from pipelinerl.config import load_config
    from pipelinerl.roles.trainer import Trainer, trainer_weights

    cfg = load_config(overrides=["model.path=unused", f"engine.dtype={engine_dtype}"])
    sender = _Recording()
    trainer = Trainer(cfg, tiny_hf_model("qwen2", seed=1).train(), source=None, sender=sender)
    trainer.maybe_publish()  # step 0: every step publishes
    (layout, tensors), = sender.published
    dtype = getattr(torch, engine_dtype)
    assert {s.dtype for s in layout.slots} == {dtype}
    master = trainer_weights(trainer.model)  # float32: the trainer's own
    assert {t.dtype for t in master.values()} == {torch.float32}
    for slot, t in zip(layout.slots, tensors, strict=True):
        assert torch.equal(t, master[slot.names[0]].to(dtype)), slot.names


def test_shm_poll_never_offers_a_version_whose_write_began_between_its_reads(monkeypatch) -> None:
    # The writer makes seq odd, then sets the version, then copies the data: a poll that read
    # the old even seq and then the new version would offer weights not written yet (a
    # deterministic actor then waited for that version and loaded the old one).
    run_id = _run_id()
    sender = ShmWeightSender(run_id)
    receiver = ShmWeightReceiver(run_id, timeout_s=5)
    try:
        sender.publish(_weights(1), 1)
        sender.settle()
        real_fence, writes = shm_mod._fence, []

        def writer_starts_between_the_reads() -> None:
            real_fence()
            if not writes:  # right after poll read the even seq: version 2's write begins
                header = sender._header
                header[shm_mod._SEQ_I] += 1
                header[shm_mod._VERSION_I] = 2
                writes.append(2)

        monkeypatch.setattr(shm_mod, "_fence", writer_starts_between_the_reads)
        assert receiver.poll() is None and writes == [2]
        monkeypatch.setattr(shm_mod, "_fence", real_fence)
        assert receiver.poll() is None  # still being written
    finally:
        receiver.close()
        sender.close()
