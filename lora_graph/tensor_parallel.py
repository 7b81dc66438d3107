"""The runner's side of tensor parallelism: one pipeline's place in a group of ranks
(:class:`RankLink`), what rank 0 sends over the wire (each step, each slot write, each
capture, stop) and the loop a worker rank runs on what it receives.

A pipeline built with ``tensor_parallel_size`` holds one :class:`RankLink` (``pipeline.
link``). On rank 0 it starts the workers (or finds torchrun's), joins the group and sends;
on a worker it joins and :meth:`RankLink.serve` runs the commands until rank 0 stops. The
collectives and processes themselves are :mod:`lora_graph.distributed`'s; what each rank
holds is :mod:`lora_graph.parallel`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lora_graph import distributed
from lora_graph.loading.model_files import Select, select_state
from lora_graph.parallel import TPRank, checkpoint_share, pad_rows, vocab_rows
from lora_graph.step import ModelInputs
from lora_graph.targets import LoraTarget, module_map


def served_targets(
    targets: dict[str, LoraTarget], tp: TPRank | None, vocab_parallel_lm_head: bool
) -> dict[str, LoraTarget]:
    """The LoRA targets as served: the declared table; under tensor parallelism with the
    LM head whole on every rank, a per-segment target (the LM head) replicated
    (``parallel="none"``)."""
    if tp is None or vocab_parallel_lm_head:
        return targets
    return {
        name: replace(t, parallel="none") if t.per_segment else t for name, t in targets.items()
    }


def check_group_size(size: int, device: torch.device) -> None:
    """Refuse a group of ``size`` ranks from ``device`` before any process starts: a size
    below 1, more GPUs than are visible from ``device``'s index, or a second group in this
    process (one a process, ``torch.distributed``'s default group).

    Raises:
        ValueError: naming the cause.
    """
    if distributed.tensor_parallel() is not None and distributed.worker_assignment() is None:
        raise ValueError(
            "this process already runs a tensor-parallel pipeline (one process group a "
            "process): close() it first"
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer of at least 1, got {size!r}")
    first = device.index or 0
    if device.type == "cuda" and first + size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {size} needs {size} GPUs from {device}; "
            f"{torch.cuda.device_count()} are visible"
        )


def checkpoint_shares(
    read: Callable[[Select | None], dict[str, Tensor]],
    targets: dict[str, LoraTarget],
    num_layers: int,
    tp: TPRank,
    ties: dict[str, str],
) -> dict[str, Tensor]:
    """The checkpoint as rank ``tp`` holds it, read through ``read(select)``
    (:func:`lora_graph.loading.model_files.read_checkpoint`'s ``select``): a target's
    module its share by the target's parallel mode (:func:`lora_graph.parallel.
    checkpoint_share`; ``targets`` as served, :func:`served_targets`), every other tensor
    whole. The model's LM head is untied under tensor parallelism: a checkpoint that ties
    it to the embedding (``ties``, head module to embedding module) may hold the shared
    matrix under either name (``save_pretrained`` keeps the embedding's, safetensors'
    ``save_model`` the head's; transformers loads both); the other name gets the rows its
    target holds (whole, or this rank's vocabulary range), a whole head's embedding read
    whole once, then cut."""
    lookup = module_map(targets, num_layers)
    whole_heads = {h for h in ties if targets[_target_of(lookup, h)].parallel == "none"}
    read_whole = {f"{ties[h]}.weight" for h in whole_heads}

    def share(name: str, shape: tuple[int, ...]) -> list[tuple[slice, ...]] | None:
        module, _, param = name.rpartition(".")
        ref = lookup(module)
        if ref is None:
            return [tuple(slice(None) for _ in shape)]
        t = targets[ref.target]
        return checkpoint_share(t, t.module_slices(ref.shard_id), param, shape, tp)

    def select(name: str, shape: tuple[int, ...]) -> list[tuple[slice, ...]] | None:
        return [tuple(slice(None) for _ in shape)] if name in read_whole else share(name, shape)

    state = dict(read(select if tp.size > 1 else None))
    for head, embedding in ties.items():
        e, h = f"{embedding}.weight", f"{head}.weight"
        if e in state and h not in state:  # (a vocabulary-parallel head: the same rows)
            state[h] = state[e]
        elif h in state and e not in state:
            state[e] = state[h]
        if e in state and head in whole_heads and tp.size > 1:  # read whole: now its share
            state[e] = select_state({e: state[e]}, share)[e]
    for name, t in state.items():  # an embedding's token ids: padded to the rows it holds
        ref = lookup(name.rpartition(".")[0])
        if ref is not None and targets[ref.target].kind == "embedding":
            state[name] = pad_rows(t, vocab_rows(targets[ref.target].in_features, tp)[2])
    return state


def _target_of(lookup: Callable[[str], Any], module: str) -> str:
    ref = lookup(module)
    assert ref is not None, module
    return str(ref.target)


class RankLink:
    """One pipeline's rank in a tensor-parallel group of ``size`` ranks.

    Joining: as the worker rank this process was started as (:func:`lora_graph.
    distributed.start_workers`), as the rank torchrun gave it (``env://``; nothing is
    started), or else as rank 0, which starts ranks ``1..size-1``, each building
    ``build`` (the pipeline's class, positional and keyword arguments). Each rank takes
    its own device: ``cuda:<first + rank>``, or on the CPU an equal share of the cores.

    Args:
        size: ranks of the group.
        device: the pipeline's device as given (its index: the first GPU).
        build: ``(cls, args, kwargs)`` a worker builds its pipeline from.

    Attributes:
        tp: this rank; device: its device; workers: rank 0's started workers (None
            otherwise); torchrun: whether torchrun started the ranks.
    """

    def __init__(self, size: int, device: torch.device, build: tuple[Any, ...]) -> None:
        assigned = distributed.worker_assignment()
        from_torchrun = distributed.torchrun_assignment(size) if assigned is None else None
        self.torchrun = from_torchrun is not None
        self.out_of_step = True  # (until connect(): the workers are building their pipelines)
        self.workers: distributed.Workers | None = None
        self.wire: distributed.Wire | None = None
        if assigned is None and from_torchrun is None:
            rank, init_method = 0, distributed.free_init_method()
            if size > 1:
                self.workers = distributed.start_workers(size, init_method, build)
        else:
            rank, init_method = assigned or from_torchrun  # type: ignore[misc]
            if rank > 0:
                distributed.leave_signals_to_rank_0()
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + rank)
            torch.cuda.set_device(device)
        else:  # the CPU's cores shared among the ranks (more threads than cores spin)
            share = max(1, (os.cpu_count() or 1) // size)
            torch.set_num_threads(min(torch.get_num_threads(), share))
        self.device = device
        try:
            self.tp = distributed.init_tensor_parallel(
                rank,
                size,
                init_method=init_method,
                backend="nccl" if device.type == "cuda" else "gloo",
            )
        except BaseException:  # (Ctrl-C at start-up: the started workers go with it)
            if self.workers is not None:
                self.workers.close(kill=True)
            raise

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Rank 0: one command, from its send to the end of rank 0's own part. A collective
        that fails because a worker died ends this process with the message naming the
        worker (:meth:`Workers.fail_if_dead`), not the backend's traceback. Anything else
        that escapes it (Ctrl-C's KeyboardInterrupt in the middle of a step, an error in
        rank 0's part) leaves the workers inside the command, waiting in a collective rank
        0 will not reach: the link is then out of step (:attr:`out_of_step`), refuses
        further commands, and :meth:`close` kills the workers rather than send STOP.

        Raises:
            RuntimeError: if the link is out of step already.
        """
        if self.out_of_step:
            raise RuntimeError(
                "the tensor-parallel ranks are out of step (a command was interrupted on "
                "rank 0): close() this pipeline and build another"
            )
        try:
            yield
        except BaseException as e:
            if isinstance(e, RuntimeError) and self.workers and not self.out_of_step:
                self.workers.fail_if_dead(timeout=5.0)
            self.out_of_step = True
            raise

    @property
    def sends(self) -> bool:
        """Whether this rank sends commands: rank 0 of a group of several."""
        return self.wire is not None and self.tp.rank == 0

    def connect(self, pipeline: Any) -> None:
        """The wire between the ranks, carrying the pipeline's step buffer and routing, and
        rank 0's slot writer (every rank's share of an adapter image, :meth:`send_slot`).
        The last step of every rank's pipeline construction: the ranks are in step from here
        (closed before it, rank 0 kills its workers, whatever they were building)."""
        self.out_of_step = False
        if self.tp.size == 1:
            return
        parts = [pipeline.step_buffer.buffer]
        manager = pipeline.manager
        if manager is not None:
            parts.append(manager.routing.buffer)
            if self.tp.rank == 0:
                manager.slot_writer = lambda slot, shares: self.send_slot(manager, slot, shares)
        self.wire = distributed.Wire(parts, self.device)

    # ---- rank 0 ---------------------------------------------------------------------------
    def send_step(self, inputs: ModelInputs) -> None:
        """Rank 0: the step about to run (its width, LoRA or not, every token's logits or
        not), with the step buffer and, for a LoRA step, the routing: one broadcast."""
        assert self.wire is not None
        lora = inputs.routing is not None
        with self.guard():
            self.wire.send(
                distributed.STEP,
                *inputs.width,
                int(lora),
                int(inputs.all_logits),
                carry=(0, 1) if lora else (0,),
            )

    def send_capture(self, mode: str, token_buckets: list[int]) -> None:
        """Rank 0: every rank captures the same graphs in the same order (the collectives
        inside them meet)."""
        assert self.wire is not None
        with self.guard():
            self.wire.send(distributed.CAPTURE)
            dist.broadcast_object_list([(mode, token_buckets)], src=0)

    def send_slot(self, manager: Any, slot: int, shares: list[Any]) -> None:
        """Rank 0's slot writer: rank ``r`` gets ``shares[r]`` (an adapter image of its
        slot layout: :meth:`LoRAManager._write_shares`) in ``slot``, by one scatter."""
        assert self.wire is not None
        target = manager.slots.pool[slot]
        parts = []
        for share in shares:
            part = torch.zeros_like(target)
            share.write(part)
            parts.append(part)
        with self.guard():
            self.wire.send(distributed.SLOT, slot, shares[0].rank)
            dist.scatter(target, parts, src=0)

    def send_logits_at(self, index: Tensor, lora: bool) -> None:
        """Rank 0: the rows ``index`` (``[R]`` int64) of the last step whose logits it
        computes (a vocabulary-parallel LM head needs every rank), with the routing."""
        assert self.wire is not None
        with self.guard():
            self.wire.send(
                distributed.LOGITS_AT, index.numel(), int(lora), carry=(1,) if lora else ()
            )
            dist.broadcast(index.to(self.device), src=0)

    # ---- a worker -------------------------------------------------------------------------
    def serve(self, pipeline: Any) -> None:
        """A worker rank's loop: run each command rank 0 sends (a step, a slot write, a
        capture) on ``pipeline`` until it says stop."""
        wire = self.wire
        assert wire is not None
        while True:
            command, *args = wire.receive()
            if command == distributed.STEP:
                tokens, seqs, lora, all_logits = args[:4]
                wire.unpack((0, 1) if lora else (0,))
                width = (tokens, seqs)
                routing = pipeline.routing_buffer if lora else None
                views = pipeline.step_buffer.views(width)
                pipeline.execute(ModelInputs(views, routing, [], width, bool(all_logits)))
            elif command == distributed.SLOT:
                slot, rank = args[:2]
                dist.scatter(pipeline.manager.slots.pool[slot], None, src=0)
                pipeline.manager.slots.ranks[slot] = rank
            elif command == distributed.CAPTURE:
                spec: list[Any] = [None]
                dist.broadcast_object_list(spec, src=0)
                mode, buckets = spec[0]
                pipeline.enable_compile(mode, token_buckets=buckets, progress=False)
            elif command == distributed.LOGITS_AT:
                n, lora = args[:2]
                wire.unpack((1,) if lora else ())
                index = torch.empty(n, dtype=torch.long, device=self.device)
                dist.broadcast(index, src=0)
                with torch.inference_mode():
                    pipeline.head_logits(index, pipeline.routing_buffer if lora else None)
            elif command == distributed.STOP:
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {command}")

    def close(self) -> None:
        """Rank 0: stop the workers (its own, or torchrun's: STOP; its own killed when the
        ranks are out of step, torchrun's left to torchrun); every rank: leave the
        group."""
        wire, self.wire = self.wire, None
        if self.out_of_step:  # (a STOP would wait forever beside the workers' collective)
            wire = None
        if self.workers is not None:  # (its watchdog told first: the workers now exit)
            if wire is None:
                self.workers.close(kill=True)
            else:
                self.workers.close(stop=lambda: wire.send(distributed.STOP))
            self.workers = None
        elif wire is not None and self.tp.rank == 0:
            with contextlib.suppress(Exception):  # torchrun's workers (a broken group: gone)
                wire.send(distributed.STOP)
        distributed.close_tensor_parallel()


__all__ = ["RankLink", "check_group_size", "checkpoint_shares", "served_targets"]
