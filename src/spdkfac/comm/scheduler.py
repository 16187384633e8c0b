"""The run-time side of ``comm_scheduler="priority"``: one process group, one issue order.

A :class:`CommScheduler` owns a dedicated group. During a *window* (a backward pass whose
factor buckets are pipelined, :mod:`spdkfac.planning.schedule`), the gradient and factor streams
hand their collectives to it through :class:`~spdkfac.comm.streams.ScheduledStream` (a
:class:`~spdkfac.comm.base.Communicator`), and one dispatcher thread issues their chunks
in the :class:`~spdkfac.planning.schedule.CommSchedule`'s order, at most ``credits`` chunks in
flight: a chunk waits locally for its data, never for another rank's clock. Everything
else — calls outside a window, beyond the planned ones, or before a schedule exists — goes
to the stream's own group unchanged (``"fifo"``, today's behaviour).

Whether a window is planned is decided from replicated facts only (the factor step, the
fusion plan's bucket sizes, the number of windows recorded), and the schedule is planned
from rank 0's recorded readiness times (one broadcast), so every rank walks the same order.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm.base import Communicator
from spdkfac.comm.streams import ScheduledStream
from spdkfac.comm.window import Call, Window
from spdkfac.costmodel import AlphaBetaModel
from spdkfac.planning.schedule import (
    FACTORS,
    GRADIENTS,
    STREAMS,
    CommSchedule,
    ScheduledCall,
    chunk_count,
    chunk_elements_for,
    gradient_busy,
    plan_priority,
)

__all__ = ["CommScheduler"]

#: Windows recorded before a schedule is planned (their median readiness times).
DEFAULT_RECORDED_WINDOWS = 3
_KEPT_WINDOWS = 8

Record = tuple[tuple[str, int, int, float], ...]


class CommScheduler:
    """Issues the planned chunks of each window in one order, on one group.

    Args:
        group: A group of its own (no other caller issues collectives on it).
        allreduce: The all-reduce cost model the schedule is planned with.
        bytes_per_element: Element size of the streams' tensors (chunk sizing).
        credits: Chunks in flight at most (2 keeps the link busy between chunks).
        recorded_windows: Windows recorded before planning.
        timeout: Seconds the dispatcher waits for a planned call's data before failing.
    """

    def __init__(
        self,
        group: Communicator,
        allreduce: AlphaBetaModel,
        *,
        bytes_per_element: int = 4,
        credits: int = 2,
        recorded_windows: int = DEFAULT_RECORDED_WINDOWS,
        timeout: float = 1800.0,
    ) -> None:
        if credits < 1 or recorded_windows < 1:
            raise ValueError("credits and recorded_windows must be >= 1")
        self._group = group
        self._allreduce = allreduce
        self._bytes_per_element = bytes_per_element
        self._chunk_elements = chunk_elements_for(allreduce, bytes_per_element)
        self._credits = threading.Semaphore(credits)
        self._recorded_windows = recorded_windows
        self._timeout = timeout
        self._lock = threading.Condition(threading.RLock())
        self._done_lock = threading.Lock()
        self._schedule: CommSchedule | None = None
        self._window: Window | None = None
        self._records: list[Record] = []
        self._queue: list[tuple[Window, CommSchedule]] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._nothing_to_order = False
        self._closed = False

    @property
    def group(self) -> Communicator:
        """The scheduler's own group (every scheduled chunk travels on it)."""
        return self._group

    @property
    def schedule(self) -> CommSchedule | None:
        """The schedule planned windows follow (None: not planned yet)."""
        return self._schedule

    def stream(self, name: str, fifo: Communicator) -> ScheduledStream:
        """The communicator ``name``'s calls go through (``fifo`` outside planned windows)."""
        if name not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, got {name!r}")
        return ScheduledStream(self, name, fifo)

    @property
    def planned(self) -> bool:
        """Whether the open window follows a schedule."""
        window = self._window
        return window is not None and window.schedule is not None

    def adopt(self, schedule: CommSchedule) -> None:
        """Follow ``schedule`` from the next window on (every rank must adopt the same one;
        :meth:`plan` does it from rank 0's records)."""
        with self._lock:
            self._schedule = schedule

    def reset(self) -> None:
        """Forget the schedule and the records (the streams' calls changed)."""
        with self._lock:
            self._schedule = None
            self._records = []
            self._nothing_to_order = False

    # ------------------------------------------------------------------ windows
    def open_window(self, factor_sizes: Sequence[int]) -> None:
        """A factor step's pass begins handing factors over (from a hook, on every rank).

        The window is planned when a schedule exists for exactly these factor buckets.
        """
        with self._lock:
            schedule = self._schedule
            if schedule is not None and (
                self._closed or schedule.sizes(FACTORS) != tuple(factor_sizes)
            ):
                schedule = None
            self._window = Window(schedule, len(factor_sizes))
            if schedule is not None:
                self._start_dispatcher()
                self._queue.append((self._window, schedule))
                self._lock.notify_all()

    def end_of_gradients(self) -> None:
        """The step begins: no more gradient calls this window. Planned ones that did not
        come (a pass without DDP's all-reduce) are skipped; their count is the same on
        every rank, so every dispatcher skips the same entries."""
        with self._lock:
            window = self._window
            if window is not None:
                window.limit[GRADIENTS] = window.counts[GRADIENTS]
                self._lock.notify_all()

    def close_window(self) -> None:
        """The factor step ends (after its exchange completed): keep what was recorded."""
        with self._lock:
            window, self._window = self._window, None
        if window is None:
            return
        self._records = [*self._records[-(_KEPT_WINDOWS - 1) :], tuple(window.record)]

    def plan_due(self) -> bool:
        """Whether enough windows were recorded to plan (replicated: count and contents'
        shapes are the same on every rank)."""
        return (
            self._schedule is None
            and not self._nothing_to_order
            and len(self._records) >= self._recorded_windows
        )

    def plan(self, communicator: Communicator) -> CommSchedule | None:
        """Every rank plans the same schedule from rank 0's records (a collective).

        Returns None (and stays unplanned) when there is nothing to order: a window
        without gradient calls (no DDP) or without factor calls.
        """
        calls = self._agreed_calls(communicator)
        if not all(any(c.stream == s for c in calls) for s in STREAMS):
            self._nothing_to_order = True  # stay on the streams' own groups
            return None
        self._schedule = plan_priority(
            calls,
            self._allreduce,
            bytes_per_element=self._bytes_per_element,
            chunk_elements=self._chunk_elements,
        )
        return self._schedule

    @property
    def chunk_elements(self) -> int:
        """Elements per chunk of the schedules it plans."""
        return self._chunk_elements

    def gradient_busy(self, communicator: Communicator) -> tuple[tuple[float, float], ...]:
        """The link intervals rank 0's recorded gradient calls hold under a priority
        schedule, from a window's start (a collective; empty before any window)."""
        if not self._records:
            return ()
        return gradient_busy(
            self._agreed_calls(communicator),
            self._allreduce,
            bytes_per_element=self._bytes_per_element,
            chunk_elements=self._chunk_elements,
        )

    def _agreed_calls(self, communicator: Communicator) -> list[ScheduledCall]:
        """Rank 0's latest window's calls at their median readiness (one all-reduce checks
        that every rank recorded as many, one broadcast shares them)."""
        latest = self._records[-1]
        shape = [(stream, index, elements) for stream, index, elements, _ in latest]
        alike = [r for r in self._records if [e[:3] for e in r] == shape]
        ready = [statistics.median(r[i][3] for r in alike) for i in range(len(shape))]
        local = torch.tensor(
            [[STREAMS.index(s), i, n, t] for (s, i, n), t in zip(shape, ready, strict=True)],
            dtype=torch.float64,
        ).reshape(-1, 4)
        count = torch.tensor([float(len(shape))], device=communicator.device)
        if float(agreed := communicator.all_reduce_max(count.clone()).wait()) != float(count):
            raise RuntimeError(
                "spdkfac: comm_scheduler='priority': ranks recorded different numbers of "
                f"collectives in a window ({int(count)} here, {int(agreed)} elsewhere)"
            )
        shared = communicator.broadcast(local.to(communicator.device), src=0).wait().cpu()
        return [
            ScheduledCall(STREAMS[round(s)], round(i), round(n), max(0.0, t))
            for s, i, n, t in shared.tolist()
        ]

    # ------------------------------------------------------------------ calls
    def admit(self, stream: str, elements: int) -> int | None:
        """Record ``stream``'s next call; its index when the window plans it, else None
        (the caller issues it on its own group)."""
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"spdkfac: the communication scheduler failed: {self._error}")
            window = self._window
            if window is None:
                return None
            index = window.counts[stream]
            window.counts[stream] += 1
            if index >= window.limit[stream]:
                return None
            window.record.append((stream, index, elements, time.perf_counter() - window.start))
            schedule = window.schedule
            if schedule is None or index >= window.planned[stream]:
                return None
            planned = schedule.sizes(stream)[index]
            if elements != planned:
                raise RuntimeError(
                    f"spdkfac: comm_scheduler='priority': {stream} call {index} moves "
                    f"{elements} elements, the schedule planned {planned} (the buckets "
                    "changed after it was made)"
                )
            return index

    def enqueue(
        self,
        stream: str,
        index: int,
        segments: list[tuple[Tensor, int | None]],
        result: Tensor,
    ) -> Future[Tensor]:
        """Hand the data of an admitted call to the dispatcher (``segments``: flat pieces
        and their owner rank, None to all-reduce); the future gives ``result`` once every
        chunk is reduced."""
        with self._lock:
            window = self._window
            assert window is not None and window.schedule is not None
            schedule = window.schedule
            call = Call(segments, result)
            call.cut(schedule.chunk_elements)
            if not call.chunks:
                call.completed = True
                call.future.set_result(result)
            window.calls[(stream, index)] = call
            self._lock.notify_all()
            return call.future

    # ------------------------------------------------------------------ dispatcher
    def close(self) -> None:
        """End the dispatcher thread: the calls handed to it are still issued, calls not
        handed over by now (a pass that stopped part-way) are no longer waited for."""
        with self._lock:
            self._closed = True
            for window, _ in self._queue:
                window.limit = dict(window.counts)
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout)

    def _start_dispatcher(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._dispatch, name="spdkfac-comm-scheduler", daemon=True
            )
            self._thread.start()

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    if self._closed:
                        return
                    self._lock.wait()
                window, schedule = self._queue[0]
            try:
                for stream, index, chunk in schedule.order:
                    call = self._wait_for(window, stream, index)
                    if call is None:
                        continue
                    # A call of several segments (a reduce-scatter by owner) is cut per
                    # segment, so it may hold more chunks than the plan counted: its last
                    # planned chunk sends the rest.
                    last = chunk_count(schedule.sizes(stream)[index], schedule.chunk_elements) - 1
                    for piece in (
                        call.chunks[chunk:] if chunk == last else call.chunks[chunk : chunk + 1]
                    ):
                        self._issue(call, piece)
            except BaseException as error:
                self._fail(window, error)
            with self._lock:
                self._queue.pop(0)

    def _wait_for(self, window: Window, stream: str, index: int) -> Call | None:
        """The call once its data is handed over; None when it will not come."""
        deadline = time.monotonic() + self._timeout
        with self._lock:
            while (stream, index) not in window.calls:
                if index >= window.limit[stream]:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{stream} call {index} of the schedule never came ({self._timeout:.0f} s)"
                    )
                self._lock.wait(timeout=min(left, 1.0))
            return window.calls[(stream, index)]

    def _issue(self, call: Call, chunk: tuple[Tensor, int | None]) -> None:
        self._credits.acquire()
        piece, owner = chunk
        group = self._group
        if owner is None:
            future = group.all_reduce_sum(piece)
        else:
            empty = piece.new_zeros(0)
            future = group.reduce_scatter(
                [piece if r == owner else empty for r in range(group.world_size)]
            )
        future.add_done_callback(lambda done: self._chunk_done(call, done))

    def _chunk_done(self, call: Call, done: Future[Tensor]) -> None:
        """Runs on the group's worker threads (several at once): counts under a lock."""
        self._credits.release()
        failed: BaseException | None = None
        try:
            done.wait()
        except BaseException as error:
            failed = error
        with self._done_lock:
            call.left -= 1
            finished = call.left == 0 or failed is not None
            if not finished or call.completed:
                return
            call.completed = True
        if failed is not None:
            call.future.set_exception(failed)  # type: ignore[arg-type]
        else:
            call.future.set_result(call.result)

    def _fail(self, window: Window, error: BaseException) -> None:
        with self._lock:
            self._error = error
            for call in window.calls.values():
                with self._done_lock:
                    if call.completed:
                        continue
                    call.completed = True
                    failure = RuntimeError(f"spdkfac: the communication scheduler failed: {error}")
                    call.future.set_exception(failure)  # type: ignore[arg-type]
