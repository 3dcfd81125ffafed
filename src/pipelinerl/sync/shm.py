"""Weight channel through one persistent shared-memory file: trainer and actors on one machine.

File layout (`<shm_dir>/pipelinerl-<run_id>-weights`), created by the sender at its first
`publish` and never resized:

    [0, 64)           header: int64 magic, seq, version, manifest offset/length, data offset/length
    [64, ...)         manifest: JSON list of parameters (name, shape, dtype, slot)
    [data_offset, ..) one flat region; each slot (a distinct tensor; tied names share one) sits
                      at a 64-byte aligned offset in manifest order

Consistency is a seqlock: the writer makes `seq` odd, writes the version and every slot (one
`copy_` per tensor, no pickling), then makes `seq` even again. A reader reads `seq`, copies
every slot into its targets, re-reads `seq`, and retries if it changed or was odd, so a reader
never keeps a torn mix of two versions and the writer never waits for readers.

Memory ordering. A seqlock needs the writer's stores seen in the order seq-odd, data, seq-even,
and the reader's loads done in the order seq, data, seq. x86-64 (TSO) keeps both orders by
itself; aarch64 (GH200/Grace) and other weakly ordered CPUs may reorder both. So each side
puts a full memory barrier (`_fence`: C11 `atomic_thread_fence(memory_order_seq_cst)`, a
`dmb ish` on aarch64, from GCC's libatomic through ctypes, about a microsecond) between the
seq access and the data on either side of it: writer `seq odd; fence; data; fence; seq even`,
reader `seq; fence; data; fence; seq`. The 8-byte header words are aligned, so each load and
store of `seq` is single-copy atomic. Copies that torch spreads over worker threads are joined
before `copy_` returns, and a barrier is cumulative, so it orders their accesses too. Without
libatomic, x86-64 runs without barriers (TSO suffices: Python calls are opaque to the C
compiler, so nothing reorders them either); other CPUs refuse to open the channel.

From a GPU the copies go straight into the page-locked file as DMA (`non_blocking`), in the
device's stream order (a later optimizer step cannot overwrite a weight before it is copied),
and `publish` returns once they are enqueued: a thread waits for them to land and then makes
`seq` even, so the trainer's next step is not held up by the transfer. `publish` and `close`
first wait for the previous publish to be visible.

The sender builds the file under a temporary name and renames it into place, so a reader sees
either no file or a complete one; a crashed run leaves its file behind and the next sender with
the same run id replaces it (readers notice the new inode, remap, and follow the new trainer's
versions even if they are not newer: it may have resumed from an older checkpoint). The file is
never truncated while mapped, so readers cannot fault on it.

A sender holds an exclusive `flock` on its file for its life. A sender killed outright never
unlinks its file, and /dev/shm is memory until reboot (538 MB for a 135M-parameter model in
fp32), so every new sender unlinks the weight files in its directory that no live sender
holds.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import platform
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from pipelinerl.sync.base import Weights, open_weights
from pipelinerl.sync.layout import WeightLayout, align

logger = logging.getLogger(__name__)

_MAGIC = 0x504C524C_57543031  # "PLRLWT01": format version 1
_HEADER_BYTES = 64
_MAGIC_I, _SEQ_I, _VERSION_I, _MAN_OFF_I, _MAN_LEN_I, _DATA_OFF_I, _DATA_LEN_I = range(7)
_SLOT_ALIGN = 64
_RUN_ID = re.compile(r"[A-Za-z0-9._-]+")
# A weight file younger than this may be one a sender has created and not locked yet.
_STALE_AFTER_S = 60.0


def _load_fence() -> Callable[[], None] | None:
    """A full memory barrier, or None where none can be had and the CPU needs one."""
    try:
        fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        if platform.machine().lower() in ("x86_64", "amd64"):
            return lambda: None  # TSO already keeps the orders the seqlock needs
        return None
    fence.argtypes, fence.restype = [ctypes.c_int], None
    seq_cst = 5  # memory_order_seq_cst in C11 <stdatomic.h>
    return lambda: fence(seq_cst)


_fence_or_none = _load_fence()


def _fence() -> None:
    """Full memory barrier between a seqlock's header and data accesses (module docstring)."""
    if _fence_or_none is None:
        raise RuntimeError(
            f"the shared-memory weight channel needs memory barriers on {platform.machine()}: "
            "install GCC's libatomic (Debian/Ubuntu: apt-get install libatomic1), or use "
            "sync.backend=broadcast"
        )
    _fence_or_none()


def shm_path(run_id: str, shm_dir: str | Path = "/dev/shm") -> Path:
    """The shared-memory file of a run."""
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id {run_id!r} must match {_RUN_ID.pattern}")
    return Path(shm_dir) / f"pipelinerl-{run_id}-weights"


def _reclaim_stale(own: Path) -> None:
    """Unlink the weight files (and half-built temporary ones) beside `own` that no live
    sender holds, `own` aside: the next sender of its run replaces it in one rename."""
    now = time.time()
    for path in own.parent.glob("pipelinerl-*-weights*"):
        if path == own:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone already, or another user's
            continue
        try:
            if now - os.fstat(fd).st_mtime < _STALE_AFTER_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # locked: its sender is alive
            continue
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        logger.info("removed %s: no live sender holds it (a run killed outright left it)", path)


class ShmWeightSender:
    """Publishes weights into the run's shared-memory file (see module docstring)."""

    def __init__(self, run_id: str, shm_dir: str | Path = "/dev/shm"):
        _fence()  # refuses, at start, a CPU that needs barriers and has none
        self.path = shm_path(run_id, shm_dir)
        self._layout: WeightLayout | None = None
        self._mm: mmap.mmap | None = None
        self._header: np.ndarray | None = None
        self._views: list[torch.Tensor] = []
        self._data: torch.Tensor | None = None
        self._page_lock = _PageLock(read_only=False)
        self._inode: tuple[int, int] | None = None
        self._version: int | None = None
        self.last_transfer_s = 0.0  # the last visible publish: from its start until readers see it
        self._fd: int | None = None  # open while the file is ours: it holds the flock
        self._landing: threading.Thread | None = None  # finishes a publish from a GPU
        self._landing_error: BaseException | None = None
        _reclaim_stale(self.path)

    def _create(self, layout: WeightLayout) -> None:
        manifest = layout.to_json().encode()
        offsets, data_len = layout.slot_offsets(_SLOT_ALIGN)
        data_off = align(_HEADER_BYTES + len(manifest), mmap.PAGESIZE)
        size = data_off + max(data_len, 1)
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # ours while this sender lives (_reclaim_stale)
            # Reserve the pages now: a full /dev/shm (64 MB in a default Docker container)
            # fails here with ENOSPC instead of killing the trainer with SIGBUS mid-copy.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
            st = os.fstat(fd)
        except BaseException:
            os.unlink(tmp)
            os.close(fd)
            raise
        self._fd = fd
        mm[_HEADER_BYTES:_HEADER_BYTES + len(manifest)] = manifest
        header = np.frombuffer(mm, dtype=np.int64, count=8)
        header[[_SEQ_I, _VERSION_I]] = 0
        header[[_MAN_OFF_I, _MAN_LEN_I, _DATA_OFF_I, _DATA_LEN_I]] = (
            _HEADER_BYTES, len(manifest), data_off, data_len)
        header[_MAGIC_I] = _MAGIC
        data = torch.frombuffer(mm, dtype=torch.uint8, count=size - data_off, offset=data_off)
        self._views = [
            data[off:off + s.nbytes].view(s.dtype).view(s.shape)
            for s, off in zip(layout.slots, offsets, strict=True)
        ]
        os.replace(tmp, self.path)
        self._mm, self._header, self._layout, self._data = mm, header, layout, data
        self._inode = (st.st_dev, st.st_ino)

    def publish(self, weights: Weights, version: int) -> None:
        self.settle()
        if self._version is not None and version <= self._version:
            raise ValueError(f"version {version} is not newer than {self._version}")
        t0 = time.perf_counter()
        layout, sources, gpu = open_weights(weights, self._layout)
        if self._layout is None:
            self._create(layout)
        assert self._header is not None and self._data is not None
        if gpu is not None:
            self._page_lock.ensure(self._data, gpu)
        header = self._header
        seq = int(header[_SEQ_I])
        header[_SEQ_I] = seq + 1  # odd: readers retry until the write is done
        _fence()  # the odd seq is visible before any new data
        header[_VERSION_I] = version
        with torch.no_grad():
            for view, src in zip(self._views, sources, strict=True):
                view.copy_(src, non_blocking=gpu is not None)
        wait = _landing(gpu)
        if wait is None:
            self._make_visible(seq + 2, version, t0)
            return
        self._landing = threading.Thread(target=self._land, args=(wait, seq + 2, version, t0),
                                         name="shm-publish", daemon=True)
        self._landing.start()

    def _land(self, wait: Callable[[], None], seq: int, version: int, t0: float) -> None:
        try:
            wait()
            self._make_visible(seq, version, t0)
        except BaseException as exc:  # noqa: BLE001 - raised again on the trainer's thread
            self._landing_error = exc

    def _make_visible(self, seq: int, version: int, t0: float) -> None:
        assert self._header is not None
        _fence()  # all new data is visible before the even seq
        self._header[_SEQ_I] = seq
        self._version = version
        self.last_transfer_s = time.perf_counter() - t0
        logger.debug("published weights version %d to %s in %.1f ms", version, self.path,
                     1e3 * self.last_transfer_s)

    def settle(self) -> None:
        """Wait until the last publish is visible to readers; raise what stopped it."""
        if self._landing is not None:
            self._landing.join()
            self._landing = None
        if self._landing_error is not None:
            error, self._landing_error = self._landing_error, None
            raise RuntimeError(f"publishing weights to {self.path} failed") from error

    def close(self) -> None:
        if self._mm is None:
            return
        try:
            self.settle()
        finally:
            self._unmap_and_unlink()

    def _unmap_and_unlink(self) -> None:
        assert self._mm is not None
        self._page_lock.release()
        self._views, self._header, self._data = [], None, None  # release the buffer exports
        self._mm.close()
        self._mm = None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            pass
        else:
            if (st.st_dev, st.st_ino) == self._inode:  # never unlink a newer sender's file
                self.path.unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)  # releases the flock, after the unlink
            self._fd = None


def _landing(gpu: torch.device | None) -> Callable[[], None] | None:
    """A wait for the device-to-host copies just enqueued on `gpu`'s current stream to land;
    None when the sources were on the host (the copies are done). The event is recorded on that
    device's stream, not the current device's: a trainer on cuda:1 beside an engine on cuda:0
    would otherwise record on cuda:0's idle stream, complete at once and offer a version whose
    copies are still in flight."""
    if gpu is None:
        return None
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(gpu))
    return done.synchronize


_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the device's
_CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the actors' mapping is PROT_READ


class _PageLock:
    """Page-locks (cudaHostRegister) a mapping the first time a copy involves a GPU, so copies
    between it and the GPU run as DMA instead of through the driver's pageable staging (H100,
    2 GB: 294 ms pageable against 36 ms pinned; benchmarks/RESULTS.md "GPU"). A refusal (an
    old driver, a memlock limit) is logged once and the copies stay pageable."""

    def __init__(self, read_only: bool) -> None:
        self.flags = _CUDA_HOST_REGISTER_PORTABLE | (_CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
        self.ptr: int | None = None
        self.device: torch.device | None = None
        self.refused = False

    def ensure(self, data: torch.Tensor, device: torch.device) -> None:
        """Page-lock `data` from `device`'s context (the GPU the copies run on), never from
        whichever is current: that would open a context on another process's GPU."""
        if self.ptr is not None or self.refused:
            return
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), self.flags)
        if int(err) != 0:
            self.refused = True
            logger.warning("could not page-lock the weight buffer (cudaHostRegister error %d): "
                           "weight copies to the GPU stay pageable (slower)", int(err))
            return
        self.ptr, self.device = data.data_ptr(), device

    def release(self) -> None:
        if self.ptr is not None:
            with torch.cuda.device(self.device):
                torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.ptr = None


def _copy_weight(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Host view -> engine tensor. Into an accelerator tensor of another dtype, upload first and
    convert there: `copy_` would convert on the CPU, one slow thread (H100, 0.5B fp32 -> bf16:
    567 ms against 293 ms uploading then converting; benchmarks/RESULTS.md "GPU")."""
    if dest.dtype != src.dtype and dest.device.type != "cpu":
        src = src.to(dest.device)
    dest.copy_(src)


class ShmWeightReceiver:
    """Loads weights from the run's shared-memory file into an engine's tensors in place.

    `timeout_s` bounds how long `receive_into` waits for a consistent copy (a writer that
    crashed mid-publish leaves the seqlock odd forever); after that TimeoutError the targets
    may hold a mix of versions, so it is fatal to the engine.
    """

    def __init__(self, run_id: str, shm_dir: str | Path = "/dev/shm", timeout_s: float = 60.0):
        _fence()  # refuses, at start, a CPU that needs barriers and has none
        self.path = shm_path(run_id, shm_dir)
        self.timeout_s = timeout_s
        self.last_version: int | None = None
        self.last_transfer_s = 0.0
        self.torn_retries = 0  # copies redone because the writer published meanwhile
        self._mm: mmap.mmap | None = None
        self._header: np.ndarray | None = None
        self._layout: WeightLayout | None = None
        self._views: list[torch.Tensor] = []
        self._data: torch.Tensor | None = None
        self._page_lock = _PageLock(read_only=True)
        self._inode: tuple[int, int] | None = None

    def _unmap(self) -> None:
        self._page_lock.release()
        self._page_lock = _PageLock(read_only=True)
        self._views, self._header, self._layout, self._data = [], None, None, None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def _refresh(self) -> bool:
        """Map the current file if it exists and is not the one mapped; True if mapped."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self._mm is not None  # sender gone: the last mapping still holds its weights
        if (st.st_dev, st.st_ino) == self._inode:
            return True
        if self._inode is not None:
            # A restarted trainer (maybe resumed from an older checkpoint) owns the new file:
            # follow whatever it publishes, even a version not newer than the last one loaded.
            self.last_version = None
        self._unmap()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            st = os.fstat(fd)
            # Read-only mapping: a bug in an actor cannot corrupt what other actors read.
            mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        header = np.frombuffer(mm, dtype=np.int64, count=8)
        if int(header[_MAGIC_I]) != _MAGIC:
            del header
            mm.close()
            raise RuntimeError(f"{self.path} is not a pipelinerl weight file of this version")
        man_off, man_len, data_off, data_len = (int(x) for x in header[_MAN_OFF_I:_DATA_LEN_I + 1])
        layout = WeightLayout.from_json(mm[man_off:man_off + man_len].decode())
        offsets, _ = layout.slot_offsets(_SLOT_ALIGN)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            data = torch.frombuffer(mm, dtype=torch.uint8, count=max(data_len, 1), offset=data_off)
        self._views = [
            data[off:off + s.nbytes].view(s.dtype).view(s.shape)
            for s, off in zip(layout.slots, offsets, strict=True)
        ]
        self._mm, self._header, self._layout, self._data = mm, header, layout, data
        self._inode = (st.st_dev, st.st_ino)
        return True

    def poll(self) -> int | None:
        if not self._refresh():
            return None
        assert self._header is not None
        seq = int(self._header[_SEQ_I])
        if seq == 0 or seq % 2:  # nothing published yet, or a write in progress
            return None
        _fence()  # the version load after the seq load
        version = int(self._header[_VERSION_I])
        _fence()
        if int(self._header[_SEQ_I]) != seq:
            # A write began after the seq load: the version may be the one being written,
            # its weights not there yet.
            return None
        if self.last_version is not None and version <= self.last_version:
            return None
        return version

    def receive_into(self, targets: Mapping[str, torch.Tensor]) -> int:
        t0 = time.perf_counter()
        if not self._refresh():
            raise RuntimeError(f"no weights published yet at {self.path}")
        assert self._layout is not None and self._header is not None
        dests = self._layout.bind(targets)
        assert self._data is not None
        gpu = next((t.device for ts in dests for t in ts if t.is_cuda), None)
        if gpu is not None:
            self._page_lock.ensure(self._data, gpu)
        header = self._header
        deadline = time.monotonic() + self.timeout_s
        with torch.no_grad():
            while True:
                seq = int(header[_SEQ_I])
                if seq == 0:
                    raise RuntimeError(f"no weights published yet at {self.path}")
                if seq % 2 == 0:
                    _fence()  # no data load before the seq load
                    version = int(header[_VERSION_I])
                    for view, ts in zip(self._views, dests, strict=True):
                        for t in ts:
                            _copy_weight(t, view)
                    _fence()  # every data load done before seq is read again
                    if int(header[_SEQ_I]) == seq:
                        break
                    self.torn_retries += 1
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no consistent copy of {self.path} within {self.timeout_s} s: the "
                        "trainer is publishing faster than this actor copies, or crashed mid-write"
                    )
                if seq % 2:
                    time.sleep(0.0005)
        self.last_version = version
        self.last_transfer_s = time.perf_counter() - t0
        return version

    def close(self) -> None:
        self._unmap()
        self._inode = None
