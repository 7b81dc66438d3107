"""The engine thread: one background thread owns the :class:`~lora_graph.engine.LLMEngine`,
steps it while anything is unfinished, and between steps runs the commands other threads
send (:meth:`EngineLoop.call`). HTTP handlers never touch the engine themselves."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lora_graph.engine import LLMEngine, Request, RequestOutput, TokenLogprob


@dataclass
class Watcher:
    """Where one engine request's tokens go: called on the engine thread. ``on_token``
    takes the token, its logprob (None unless asked), with the first token of a request
    that asked for them its prompt's logprobs (else None), and with the first token the
    prompt tokens the prefix cache served (else None)."""

    on_token: Callable[
        [int, TokenLogprob | None, list[TokenLogprob | None] | None, int | None], None
    ]
    on_finish: Callable[[RequestOutput], None]


class EngineStopped(RuntimeError):
    """A command for an engine thread that is not running (it stopped, or a worker died)."""


class EngineLoop:
    """Runs ``engine`` on one background thread: steps while anything is unfinished, and
    between steps runs the commands other threads send (:meth:`call`).

    Args:
        engine: the engine; no other thread may use it once :meth:`start` is called.
        on_step: called on the engine thread after each step (metrics).
    """

    def __init__(self, engine: LLMEngine, on_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]]
        self._commands = queue.SimpleQueue()
        self._watchers: dict[str, Watcher] = {}
        self._stop = threading.Event()
        self._on_step = on_step
        self._thread = threading.Thread(target=self._run, name="lora-graph-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight (each request finishes with ``error="aborted"``) and end
        the thread."""
        if not self._thread.is_alive():
            return
        stuck = False
        try:
            self.call(self.abort_all).result(timeout)
        except concurrent.futures.TimeoutError:
            stuck = True  # (inside a step that does not end: a stopped tensor-parallel worker)
        except Exception:  # noqa: BLE001 - the engine's own error: it is stopping anyway
            pass
        self._stop.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        self._thread.join(0 if stuck else timeout)  # (a stuck one does not end by waiting)
        if self._thread.is_alive():  # stuck in a step: refuse what comes next
            self.error = self.error or EngineStopped("the engine was stopped inside a step")
        self._fail_commands()  # (queued: a runtime load would wait for it forever)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps; its result (or exception) comes
        back through the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(EngineStopped("the engine is not running"))
            return future
        self._commands.put((fn, future))
        if not self.alive:  # (it stopped in between: its queue may never be read again)
            self._fail_commands()
        return future

    def submit(self, request: Request, watcher: Watcher) -> None:
        """Queue ``request`` (engine thread only, inside a :meth:`call`).

        Raises:
            ValueError: the engine's validation message, if the request is refused.
        """
        self.engine.add_request(request)
        refused = self.engine.finished.get(request.id)
        if refused is not None and refused.error is not None:
            del self.engine.finished[request.id]
            raise ValueError(refused.error)
        self._watchers[request.id] = watcher

    def abort(self, request_id: str) -> None:
        """Abort a request (engine thread only); its watcher hears the ``aborted`` finish."""
        self.engine.abort_request(request_id)
        self._deliver_finished()

    def abort_all(self) -> None:
        """Abort every request in flight (engine thread only)."""
        for request_id in list(self._watchers):
            self.engine.abort_request(request_id)
        self._deliver_finished()

    def fail_all(self, reason: str) -> None:
        """Fail every request in flight with ``reason`` (each client gets an error) and
        answer 503 from now on; from any thread (the engine thread may be stuck in a
        collective that will never end: a tensor-parallel worker died)."""
        self.error = self.error or RuntimeError(reason)
        for request_id, watcher in list(self._watchers.items()):
            with contextlib.suppress(Exception):
                watcher.on_finish(RequestOutput(request_id, None, error=reason))
        self._fail_commands()

    def _fail_commands(self) -> None:
        """Answer every queued command :class:`EngineStopped` (a 503): the engine thread
        ended, or is stuck in a step, and will not run them."""
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():  # (False: its caller gave up)
                future.set_exception(EngineStopped("the engine is not running"))

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting up to 50 ms for one if ``block``); return
        whether any ran."""
        ran = False
        while True:
            try:
                fn, future = self._commands.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return ran
            block = False
            ran = True
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                ran = self._run_commands(block=not self.engine.has_unfinished())
                if ran and self._on_step is not None:  # an abort or a load changed the state
                    self._on_step()
                if self._stop.is_set() or not self.engine.has_unfinished():
                    continue
                tokens = self.engine.step()
                prompts = self.engine.step_prompt_logprobs
                cached = self.engine.step_cached_tokens
                for (request_id, token), lp in zip(tokens, self.engine.step_logprobs, strict=True):
                    watcher = self._watchers.get(request_id)
                    if watcher is not None:
                        watcher.on_token(token, lp, prompts.get(request_id), cached.get(request_id))
                self._deliver_finished()
                if self._on_step is not None:
                    self._on_step()
        except BaseException as e:  # noqa: BLE001 - a fault of the engine: fail every request
            self.error = e
            log = logging.getLogger("lora_graph.server")
            if self._stop.is_set():  # (stopped inside a step; its collective broke at exit)
                log.info("the engine thread ended inside a step at shutdown: %r", e)
            else:
                log.exception(
                    "the engine failed; every request in flight is failed and the server "
                    "answers 503 until it is restarted"
                )
            self.fail_all(f"engine failed: {e!r}")  # (each watcher, and the queued commands)
            self._watchers.clear()

    def _deliver_finished(self) -> None:
        for request_id in [i for i in self.engine.finished if i in self._watchers]:
            out = self.engine.finished.pop(request_id)
            self._watchers.pop(request_id).on_finish(out)
