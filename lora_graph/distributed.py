"""Tensor parallelism's process group and the collective a sharded step calls, on
``torch.distributed`` (NCCL on GPUs, gloo on the CPU).

:func:`tp_all_reduce` is the custom op ``lora_graph::tp_all_reduce_``: the sum of a
tensor over the ranks of the tensor-parallel group, in place (a row-parallel layer's partial
outputs, their LoRA deltas already added: :mod:`lora_graph.parallel`); nothing when no
group is set. As a custom op it is one opaque node to ``torch.compile``; on CUDA an NCCL
all-reduce inside it is captured by CUDA graphs.

The runner's side lives here too: :func:`start_workers` starts ranks ``1..size-1`` as
processes of their own (``multiprocessing``'s spawn), each building the same pipeline at its
rank and then serving rank 0's commands (:meth:`lora_graph.pipeline.PipelineModel.
serve_worker`); rank 0 runs the scheduler and sends every command over one :class:`Wire`, a
flat int32 buffer broadcast whole: a header (the command and its arguments) and, for a
step, the step buffer and the routing. A worker that dies takes rank 0 down with a message
naming it (:class:`Workers`' watchdog), never a hang in a collective; a worker whose rank 0
dies exits.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from lora_graph.parallel import TPRank

_RANK: TPRank | None = None
# in a worker process: (rank, init_method) it was started with, read by the pipeline it builds
_ASSIGNED: tuple[int, str] | None = None


def init_tensor_parallel(
    rank: int, size: int, *, init_method: str, backend: str | None = None
) -> TPRank:
    """Join a tensor-parallel group of ``size`` ranks as ``rank`` (one process each): the
    default process group, ``backend`` NCCL where CUDA is available else gloo, rendezvous
    at ``init_method`` (``"tcp://host:port"`` or ``"file:///path"``).

    Raises:
        ValueError: for a rank outside ``[0, size)``; RuntimeError: if a group is set.
    """
    tp = TPRank(rank, size)
    global _RANK
    if _RANK is not None:
        raise RuntimeError(f"this process is rank {_RANK.rank} of a group already")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        if backend == "nccl":  # (the communicator set up now, before any graph captures it)
            dist.all_reduce(torch.zeros(1, device="cuda"))
    except BaseException:  # (a failed or interrupted join: the next one starts clean)
        _forget_partial_group()
        raise
    _RANK = tp
    return tp


def _forget_partial_group() -> None:
    """Undo what a failed ``init_process_group`` left behind: the default group if it was
    made, and the count it names groups by. Left counted, the next join in this process
    names its group "1" while its freshly started workers name theirs "0", and the ranks
    wait for each other forever (a helper found the retry after a Ctrl-C at start-up hung)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def tensor_parallel() -> TPRank | None:
    """This process's rank in its tensor-parallel group (None: no group)."""
    return _RANK


_CLOSE: list[Any] = []  # rank 0: the running pipeline's close (one group a process)


def on_close(close: Any) -> None:
    """Rank 0: have :func:`shutdown` (the command line's end, and this process's exit) call
    ``close``, the running pipeline's."""
    if not _CLOSE:
        atexit.register(shutdown)  # (at exit the workers get STOP, not a watchdog's verdict)
    _CLOSE.append(close)


def shutdown() -> None:
    """Stop this process's tensor-parallel pipeline, its workers and its group, if any
    (the command line does at the end of every command; also done at exit)."""
    while _CLOSE:
        _CLOSE.pop()()
    close_tensor_parallel()


def close_tensor_parallel() -> None:
    """Leave the group (destroys the default process group)."""
    global _RANK
    if _RANK is not None:
        dist.destroy_process_group()
        _RANK = None


@torch.library.custom_op("lora_graph::tp_all_reduce_", mutates_args=("x",))
def _all_reduce_(x: Tensor) -> None:
    if _RANK is not None:
        dist.all_reduce(x)


def tp_all_reduce(x: Tensor) -> Tensor:
    """The sum of ``x`` over the tensor-parallel ranks, in place (``x`` returned): the
    custom op ``lora_graph::tp_all_reduce_``, which mutates its input (a row-parallel
    layer's fresh output: inductor then reduces it where it lies, no copy); ``x`` itself
    when there is no group. A group of one rank runs the collective too (the distributed
    path at size 1, as measured against the plain one)."""
    _all_reduce_(x)
    return x


@torch.library.custom_op("lora_graph::tp_all_gather", mutates_args=())
def tp_all_gather(x: Tensor) -> Tensor:
    """``x`` ``[..., n]`` of every rank side by side along the last dim, ``[..., size * n]``
    in rank order (a vocabulary-parallel LM head's logits); a copy without a group."""
    if _RANK is None:
        return x.clone()
    shape = x.shape
    x = x.contiguous().view(-1, x.shape[-1])  # [rows, n]
    out = x.new_empty((_RANK.size * x.shape[0], x.shape[1]))  # every rank's, stacked
    dist.all_gather_into_tensor(out, x)
    gathered = out.view(_RANK.size, *x.shape).movedim(0, 1).reshape(x.shape[0], -1)
    return gathered.view(*shape[:-1], _RANK.size * shape[-1])


@tp_all_gather.register_fake
def _(x: Tensor) -> Tensor:
    size = _RANK.size if _RANK is not None else 1
    return x.new_empty((*x.shape[:-1], size * x.shape[-1]))


def agree_min(values: Sequence[int], device: torch.device) -> list[int]:
    """Each of ``values``' minimum over the ranks (sizes every rank must share, as the KV
    cache's pages: rank 0 hands out page numbers for all); the values themselves without
    a group."""
    if _RANK is None:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]


# ---- the runner's processes and wire -------------------------------------------------
STEP, SLOT, CAPTURE, STOP, LOGITS_AT = 1, 2, 3, 4, 5  # a wire header's command
HEADER = 8  # ints of the header


def worker_assignment() -> tuple[int, str] | None:
    """In a worker process :func:`start_workers` started: ``(rank, init_method)``; else None."""
    return _ASSIGNED


def torchrun_assignment(size: int) -> tuple[int, str] | None:
    """Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` in the environment):
    ``(RANK, "env://")``; else None.

    Raises:
        ValueError: if torchrun started another number of processes than ``size``.
    """
    env = os.environ
    if not {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(env):
        return None
    if int(env["WORLD_SIZE"]) != size:
        raise ValueError(
            f"torchrun started {env['WORLD_SIZE']} processes, but the tensor-parallel size is "
            f"{size}: give --nproc-per-node {size}"
        )
    return int(env["RANK"]), "env://"


def free_init_method() -> str:
    """A ``tcp://127.0.0.1:<port>`` rendezvous on a port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


STOP_TIMEOUT = 10.0  # seconds rank 0 waits for its workers to end on STOP, then kills them


def _quietly(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):
        fn()


_ON_WORKER_DEATH: list[Callable[[str], None]] = []
WORKER_DEATH_GRACE = 1.0  # seconds rank 0 lives on after the hooks, for their answers


def on_worker_death(hook: Callable[[str], None]) -> Callable[[], None]:
    """Rank 0: have ``hook(message)`` called, on the watchdog's thread, when a worker dies,
    before this process ends (:data:`WORKER_DEATH_GRACE` seconds after the hooks): the
    server fails its requests in flight with the message, so each client gets an error
    rather than a cut connection. Returns the function that removes the hook."""
    _ON_WORKER_DEATH.append(hook)
    return lambda: _ON_WORKER_DEATH.remove(hook) if hook in _ON_WORKER_DEATH else None


class Workers:
    """Rank 0's handle on its worker processes: :meth:`close` stops them (also at exit);
    a watchdog thread ends this process, with a message naming the worker, if one exits
    before (rank 0 would otherwise wait in its next collective forever)."""

    def __init__(self, processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
        self.processes = list(processes)
        self.closing = False
        self._stopping = threading.Lock()
        threading.Thread(target=self._watch, name="lora_graph-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        ready = wait([p.sentinel for p in self.processes])
        if not self.closing:
            self._stop_for(ready[0])

    def fail_if_dead(self, timeout: float) -> None:
        """If a worker exits within ``timeout`` seconds (a collective that just failed
        on rank 0 usually means one did), end this process with the watchdog's message."""
        ready = wait([p.sentinel for p in self.processes], timeout=timeout)
        if ready and not self.closing:
            self._stop_for(ready[0])

    def _stop_for(self, sentinel: Any) -> None:
        if not self._stopping.acquire(blocking=False):  # (the watchdog and a failed step)
            time.sleep(WORKER_DEATH_GRACE + 10)  # the first one ends the process, saying why
            os._exit(1)
        rank = next(r for r, p in enumerate(self.processes, start=1) if p.sentinel == sentinel)
        process = self.processes[rank - 1]
        process.join(timeout=5)
        for p in self.processes:  # the others: their collectives would only fail, noisily
            if p.is_alive():
                p.kill()
        message = (
            f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
            f"{process.exitcode}; stopping rank 0 (its collectives would wait for it forever)"
        )
        print(
            f"\nlora_graph: {message}. The worker's own error, if any, is above.",
            file=sys.stderr,
            flush=True,
        )
        hooks = list(_ON_WORKER_DEATH)
        for hook in hooks:
            with contextlib.suppress(Exception):
                hook(message)
        if hooks:  # (their answers written before the process ends)
            time.sleep(WORKER_DEATH_GRACE)
        os._exit(1)

    def close(self, stop: Any = None, *, kill: bool = False) -> None:
        """Stop the workers: ``stop()`` (sends them STOP) if given, then join them; a worker
        not ended :data:`STOP_TIMEOUT` seconds after (stopped or hung, not dead; the send
        itself may wait behind a stuck step on CUDA) is killed (SIGTERM would not do: a
        worker ignores it, :func:`leave_signals_to_rank_0`). ``kill``: kill them at once
        (they wait in a collective rank 0 will not reach)."""
        if self.closing:
            return
        self.closing = True
        deadline = time.monotonic() + STOP_TIMEOUT
        sender = None
        if stop is not None and not kill:
            # (a group already broken: the workers are killed below)
            sender = threading.Thread(target=_quietly, args=(stop,), daemon=True)
            sender.start()
            sender.join(timeout=STOP_TIMEOUT)
        for p in self.processes:
            if not kill:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        if sender is not None:  # (its collective fails now: done before this process ends)
            sender.join(timeout=5)


_LEFT_TO_RANK_0 = (signal.SIGINT, signal.SIGTERM)  # (the signals workers ignore)


def start_workers(size: int, init_method: str, build: tuple[Any, ...]) -> Workers:
    """Start ranks ``1..size-1``, each a spawned process that builds ``cls(*args,
    **kwargs)`` (``build``, pickled) at its rank and serves rank 0's commands. Each starts
    with SIGINT and SIGTERM ignored (:func:`leave_signals_to_rank_0` from its first
    instruction: an ignored signal stays ignored across ``exec``, and Python installs its
    KeyboardInterrupt handler only over the default one), so a Ctrl-C while a worker still
    imports is rank 0's alone too."""
    ctx = multiprocessing.get_context("spawn")
    processes = []
    main = threading.current_thread() is threading.main_thread()
    kept = [(sig, signal.signal(sig, signal.SIG_IGN)) for sig in _LEFT_TO_RANK_0] if main else []
    try:
        for rank in range(1, size):
            p = ctx.Process(
                target=_worker_main,
                args=(rank, init_method, build),
                name=f"lora_graph-tp-rank{rank}",
                daemon=True,
            )
            p.start()
            processes.append(p)
    finally:
        for sig, handler in kept:  # (a signal in these milliseconds is lost)
            signal.signal(sig, handler)
    return Workers(processes)


def leave_signals_to_rank_0() -> None:
    """A worker ignores SIGINT and SIGTERM: a terminal's Ctrl-C, ``kill -- -PGID``,
    ``timeout`` and ``systemctl stop`` signal every process of the group, and rank 0's
    graceful shutdown (requests in flight finished or aborted, then STOP to the workers)
    needs its workers until the end. A worker whose rank 0 is gone still exits (the
    spawned ones' watch on their parent; torchrun kills its own); ``Workers.close`` kills
    one that does not stop. Main thread only (Python's signal handlers)."""
    if threading.current_thread() is threading.main_thread():
        for sig in _LEFT_TO_RANK_0:
            signal.signal(sig, signal.SIG_IGN)


def _worker_main(rank: int, init_method: str, build: tuple[Any, ...]) -> None:
    global _ASSIGNED
    leave_signals_to_rank_0()
    parent = multiprocessing.parent_process()
    if parent is not None:  # rank 0 gone: nothing will ever come over the wire

        def orphaned() -> None:
            wait([parent.sentinel])
            os._exit(1)

        threading.Thread(target=orphaned, daemon=True).start()
    _ASSIGNED = (rank, init_method)
    cls, args, kwargs = build
    try:
        cls(*args, **kwargs).serve_worker()  # (ends this process)
    except BaseException:
        if parent is not None and wait([parent.sentinel], timeout=3.0):
            os._exit(1)  # rank 0 ended (and said why): this is only its collectives breaking
        print(f"lora_graph: tensor-parallel worker rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def exit_worker() -> NoReturn:
    """End a worker process (its pipeline stopped, its group left) now, without the
    interpreter's finalization: a gloo thread may still be releasing the last collective,
    whose tensors' Python objects need the GIL finalization holds, and the process would
    abort ("terminate called without an active exception"; a race seen in about 1 of 10
    exits on the CPU). Flushes stdout and stderr first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Wire:
    """The commands rank 0 sends its workers: one flat int32 buffer on the device, a
    header of :data:`HEADER` ints (the command, its arguments) then ``parts`` (int32 device
    tensors: the step buffer and the routing), broadcast whole from rank 0.

    Args:
        parts: the tensors a step carries, the same on every rank (persistent buffers).
        device: where the wire lives (NCCL broadcasts device memory).
    """

    def __init__(self, parts: Sequence[Tensor], device: torch.device) -> None:
        self.parts = list(parts)
        total = HEADER + sum(p.numel() for p in self.parts)
        self.buffer = torch.zeros(total, dtype=torch.int32, device=device)
        pin = self.buffer.is_cuda
        self._header = torch.zeros(HEADER, dtype=torch.int32, pin_memory=pin)
        self._staged = torch.cuda.Event() if pin else None  # the last header's copy
        self.views = []
        start = HEADER
        for p in self.parts:
            self.views.append(self.buffer[start : start + p.numel()])
            start += p.numel()

    def send(self, command: int, *args: int, carry: Sequence[int] = ()) -> None:
        """Rank 0: broadcast ``command`` and ``args``, with the parts numbered ``carry``.
        On CUDA the header goes up from pinned memory without waiting for the stream (a
        pageable copy would wait for the previous step, undoing asynchronous scheduling)."""
        values = [command, *args]
        if len(values) > HEADER:
            raise ValueError(f"a wire header holds {HEADER} ints, got {len(values)}")
        if self._staged is not None:
            self._staged.synchronize()  # the last header must have left the staging buffer
        for i in range(HEADER):
            self._header[i] = values[i] if i < len(values) else 0
        self.buffer[:HEADER].copy_(self._header, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        for i in carry:
            self.views[i].copy_(self.parts[i].view(-1))
        dist.broadcast(self.buffer, src=0)

    def receive(self) -> list[int]:
        """A worker: wait for the next command; its header ``[command, *args]``."""
        dist.broadcast(self.buffer, src=0)
        return [int(v) for v in self.buffer[:HEADER].tolist()]

    def unpack(self, carry: Sequence[int]) -> None:
        """A worker: copy the parts numbered ``carry`` out of the wire into place."""
        for i in carry:
            self.parts[i].view(-1).copy_(self.views[i])


__all__ = [
    "Wire",
    "Workers",
    "agree_min",
    "close_tensor_parallel",
    "free_init_method",
    "on_worker_death",
    "shutdown",
    "init_tensor_parallel",
    "start_workers",
    "tensor_parallel",
    "torchrun_assignment",
    "tp_all_gather",
    "tp_all_reduce",
    "worker_assignment",
]
