"""CUDA stream and event plumbing for the swap engine, with a CPU fallback.

On CUDA there are three streams: ``compute`` (the current stream when the engine is built),
``load`` (host -> device: weights, partial gradients, spilled layer inputs) and ``store``
(device -> host: gradients, spilled inputs). PCIe is full duplex, so loads and stores must not
queue behind each other. Streams order work only through events (``Marker``): a stream waits
for a marker, the host waits for one only on the optimizer worker thread. Nothing here calls a
device-wide synchronize.

On the CPU every operation runs when it is issued, so markers are always complete and the same
engine code runs unchanged (copies become memcpy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


def label(name: str) -> contextlib.AbstractContextManager[object]:
    """A named range in a ``torch.profiler`` trace (the engine's visits, copies and waits);
    a few microseconds when no profiler runs."""
    return torch.profiler.record_function(name)


class Marker:
    """A point in one stream's work (a CUDA event); on the CPU, always reached."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def synchronize(self) -> None:
        """Block the calling host thread until the marked work is done."""
        if self.event is not None:
            self.event.synchronize()


DONE = Marker()


class Streams:
    """The engine's three streams on one device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute: torch.cuda.Stream | None = None
        self.load: torch.cuda.Stream | None = None
        self.store: torch.cuda.Stream | None = None
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.load = torch.cuda.Stream(device)
            self.store = torch.cuda.Stream(device)

    def mark(self, stream: torch.cuda.Stream | None) -> Marker:
        """A marker for all work issued so far on ``stream``."""
        if stream is None:
            return DONE
        event = torch.cuda.Event()
        event.record(stream)
        return Marker(event)

    @staticmethod
    def wait(stream: torch.cuda.Stream | None, *markers: Marker) -> None:
        """Make later work on ``stream`` wait for ``markers`` (the host does not wait)."""
        if stream is None:
            return
        for m in markers:
            if m.event is not None:
                stream.wait_event(m.event)

    @staticmethod
    @contextlib.contextmanager
    def on(stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Issue the enclosed work on ``stream``."""
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    @staticmethod
    def hand_over(t: Tensor, stream: torch.cuda.Stream | None) -> None:
        """``t`` is used on ``stream`` too: the caching allocator must not reuse its memory
        before that stream's work on it is done (no-op on the CPU)."""
        if stream is not None and t.is_cuda:
            t.record_stream(stream)
