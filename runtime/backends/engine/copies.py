"""Host -> device expert copies: where they run, how the compute waits for them, the stalls measured, and
the copies in flight per MoE layer.

- CUDA: two streams beside the compute stream, `copy` (synchronous fetches, lookahead prefetches, the
  exact path's streamed experts) and `adm` (background admissions). A copy waits for its buffer's
  `freed` event (the last reader done), then records the buffer's `ready` event, which is its handle.
- CPU device mode: one link thread (a one-worker ThreadPoolExecutor) copies; the handle is its Future.
- In flight, per layer and by expert (`Pending`: due token, staging buffer, handle): `pending[l]`, the
  admissions the kernel queued (started at their queued token, admitted `admission_delay` tokens later
  or released), and `prefetch[l]`, the lookahead copies issued one layer ahead.
- Stalls: a late copy's wait is timed (CPU: perf_counter on the main thread; CUDA: two timing events on
  the compute stream, read after the run's final synchronize) into the shared `stats`.

A pageable host store makes CUDA copies synchronous (they block the host thread; docs/engine.md).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.backends.engine.slots import ExpertBuf, SlotPool
    from runtime.backends.engine.store import HostStore

STALL_MIN_S = 5e-6  # CUDA: a shorter wait between two timing events is their own spacing, not a stall


@dataclass
class Pending:
    due: int  # the token before which the kernel pops it (queued token + admission delay)
    buf: ExpertBuf
    handle: object  # CPU: Future of the copy; CUDA: the buffer's `ready` event


class Copies:
    """The copies of one engine: from `store` to buffers on `device`, for `L` MoE layers; stall times and
    counts go into `stats` (the engine's dict, shared)."""

    def __init__(self, store: HostStore, device: torch.device, L: int, stats: dict) -> None:
        self.store, self.device, self.cuda, self.stats = store, device, device.type == "cuda", stats
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)  # synchronous fetches, prefetches, prefill stream
            self.adm_stream = torch.cuda.Stream(device)  # background admissions
            self._link = None
        else:
            self._link = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertsweep-link")
        self.pending: list[dict[int, Pending]] = [{} for _ in range(L)]  # admissions in flight, by expert
        self.prefetch: list[dict[int, Pending]] = [{} for _ in range(L)]  # lookahead copies in flight
        self.stall_events: list[tuple] = []

    def close(self) -> None:
        if self._link is not None:
            self._link.shutdown(wait=True)
            self._link = None

    def copy_async(self, layer: int, e: int, buf: ExpertBuf, stream: str = "adm"):
        """Start copying expert e of `layer` into `buf` (stream 'adm' or 'copy'); returns the handle
        `wait_copy` takes."""
        if not self.cuda:
            return self._link.submit(self._copy_on_link, layer, e, buf)
        s = self.adm_stream if stream == "adm" else self.copy_stream
        if buf.freed is not None:
            s.wait_event(buf.freed)
        with torch.cuda.stream(s):
            self.store.copy_into(layer, e, buf, non_blocking=True)
            buf.ready.record(s)
        return buf.ready

    def _copy_on_link(self, layer: int, e: int, buf: ExpertBuf) -> None:
        with torch.no_grad():
            self.store.copy_into(layer, e, buf)

    def copy_now(self, layer: int, e: int, buf: ExpertBuf) -> None:
        """A synchronous fetch: CUDA, on the copy stream behind the compute queued so far (the evicted
        expert's last readers), and the compute waits for it; CPU device mode, a plain copy."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(cur)  # the evicted expert's last readers are done
            with torch.cuda.stream(self.copy_stream):
                self.store.copy_into(layer, e, buf, non_blocking=True)
                buf.ready.record(self.copy_stream)
            cur.wait_event(buf.ready)
        else:
            self.store.copy_into(layer, e, buf)

    def wait_copy(self, handle, timed: str | None = None) -> bool:
        """Make the compute wait for a copy; True if it had not finished when asked (a stall).

        CPU device mode: the main thread blocks on the link thread's future (timed with perf_counter).
        CUDA: the compute stream waits on the copy's event; with `timed` (a stats key), a late copy's wait
        is bracketed by two timing events on the compute stream, whose elapsed time (read after the run's
        final synchronize, `collect_stalls`) is the time the device really stood still."""
        if not self.cuda:
            late = not handle.done()
            t0 = time.perf_counter()
            handle.result()
            if timed and late:
                self.stats[timed] += time.perf_counter() - t0
            return late
        late = not handle.query()
        cur = torch.cuda.current_stream(self.device)
        if timed and late:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(cur)
            cur.wait_event(handle)
            b.record(cur)
            self.stall_events.append((a, b, timed))
        else:
            cur.wait_event(handle)
        return late

    def collect_stalls(self) -> None:
        """CUDA: add the device-side stalls measured since the last call (after a synchronize). A stall is
        counted from its measured time: a wait of at least STALL_MIN_S (the host saw the copy unfinished
        when it queued the wait, but the device may have got there after the copy landed)."""
        for a, b, key in self.stall_events:
            dt = a.elapsed_time(b) / 1e3
            self.stats[key] += dt
            if dt >= STALL_MIN_S:
                self.stats[key.replace("_stall_s", "_stalls")] += 1
        self.stall_events = []

    def drain(self, pool: SlotPool) -> None:
        """Wait for and drop every admission and prefetch copy still in flight, their buffers back to
        `pool`'s staging buffers; then synchronize and (CUDA) collect the stalls (end of a run)."""
        for q in (*self.pending, *self.prefetch):
            for p in q.values():
                self.wait_copy(p.handle)
                pool.give_staging(p.buf)
            q.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.collect_stalls()
