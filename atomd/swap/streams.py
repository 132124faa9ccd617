"""CUDA stream and event plumbing for the swap engine, with a CPU fallback and a recorder.

On CUDA there are three streams (``Lane``s): ``compute`` (the current stream when the engine is
built), ``load`` (host -> device: weights, spilled layer inputs, a device optimizer step's
state) and ``store`` (device -> host: gradients, spilled inputs, a device step's results). PCIe
is full duplex, so loads and stores must not queue behind each other. Streams order work only
through events (``Marker``): a stream waits for a marker, the host waits for one only on the
optimizer worker thread. Nothing here calls a device-wide synchronize.

On the CPU every operation runs when it is issued, so markers are always complete and the same
engine code runs unchanged (copies become memcpy).

With a ``Recorder`` attached (``atomd.swap.trace``), every piece of work the engine issues is
also written down with its lane, what it waits for and what it is (a layer's forward, a load of
its weights...), on the CPU as on CUDA: the schedule can be checked and simulated without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from atomd.swap.record import Recorder, Work


def label(name: str) -> contextlib.AbstractContextManager[object]:
    """A named range in a ``torch.profiler`` trace (the engine's visits, copies and waits);
    a few microseconds when no profiler runs."""
    return torch.profiler.record_function(name)


class Marker:
    """A point in one lane's work (a CUDA event); on the CPU, always reached. ``at``: the
    recorded work it follows, when a recorder runs."""

    def __init__(self, event: torch.cuda.Event | None = None, at: Work | None = None) -> None:
        self.event = event
        self.at = at

    def synchronize(self) -> None:
        """Block the calling host thread until the marked work is done."""
        if self.event is not None:
            self.event.synchronize()


DONE = Marker()


class Lane:
    """One of the engine's streams: its name and, on CUDA, the stream itself."""

    def __init__(self, name: str, stream: torch.cuda.Stream | None) -> None:
        self.name = name
        self.stream = stream

    def __repr__(self) -> str:
        return f"Lane({self.name})"


class Streams:
    """The engine's three lanes on one device, and the recorder when one is attached."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        cur = torch.cuda.current_stream(device) if self.cuda else None
        self.compute = Lane("compute", cur)
        self.load = Lane("load", torch.cuda.Stream(device) if self.cuda else None)
        self.store = Lane("store", torch.cuda.Stream(device) if self.cuda else None)
        self.recorder: Recorder | None = None

    def mark(self, lane: Lane) -> Marker:
        """A marker for all work issued so far on ``lane``."""
        at = self.recorder.last(lane.name) if self.recorder is not None else None
        if lane.stream is None:
            return Marker(None, at)
        event = torch.cuda.Event()
        event.record(lane.stream)
        return Marker(event, at)

    def wait(self, lane: Lane, *markers: Marker) -> None:
        """Make later work on ``lane`` wait for ``markers`` (the host does not wait)."""
        if self.recorder is not None:
            self.recorder.wait(lane.name, (m.at for m in markers))
        if lane.stream is None:
            return
        for m in markers:
            if m.event is not None:
                lane.stream.wait_event(m.event)

    def work(self, lane: Lane, kind: str, layer: int, **what: int | bool) -> None:
        """Record the work just issued on ``lane`` (no-op without a recorder)."""
        if self.recorder is not None:
            self.recorder.work(lane.name, kind, layer, what)

    def host_reads(self, lane: Lane, why: str) -> None:
        """The host is about to read a result of ``lane`` (a loss, a clipping coefficient):
        it waits for the lane's work so far. Recorded; the read itself synchronizes."""
        if self.recorder is not None:
            self.recorder.block(self.recorder.last(lane.name), why)

    @staticmethod
    @contextlib.contextmanager
    def on(lane: Lane) -> Iterator[None]:
        """Issue the enclosed work on ``lane``."""
        if lane.stream is None:
            yield
            return
        with torch.cuda.stream(lane.stream):
            yield

    @staticmethod
    def hand_over(t: Tensor, lane: Lane) -> None:
        """``t`` is used on ``lane`` too: the caching allocator must not reuse its memory
        before that lane's work on it is done (no-op on the CPU)."""
        if lane.stream is not None and t.is_cuda:
            t.record_stream(lane.stream)
