"""Streams: the fork/join that runs the base and LoRA alignments side by side.

Each device gets two side streams and three events, created once. A fork records an event on
the caller's stream and makes both side streams wait on it; the join records an event on each
side stream and makes the caller's stream wait on both. The host never blocks, and the pattern
is legal inside a CUDA graph capture (the join brings both side streams back into it).
"""

from __future__ import annotations

import threading


class SideStreams:
    def __init__(self, device_id: int):
        import cupy

        with cupy.cuda.Device(device_id):
            self.first = cupy.cuda.Stream(non_blocking=True)
            self.second = cupy.cuda.Stream(non_blocking=True)
            self.forked = cupy.cuda.Event(disable_timing=True)
            self.first_done = cupy.cuda.Event(disable_timing=True)
            self.second_done = cupy.cuda.Event(disable_timing=True)
        # The events are re-recorded by every fork: host threads take turns through it.
        self.lock = threading.Lock()

    def run(self, caller, first_work, second_work):
        """Run ``first_work(stream)`` and ``second_work(stream)`` concurrently after all work
        already queued on ``caller``; work queued on ``caller`` afterwards sees both done."""
        self.run_raw(caller.ptr, lambda _: first_work(self.first),
                     lambda _: second_work(self.second))

    def run_raw(self, caller_ptr: int, first_work, second_work):
        """``run`` with raw stream pointers (a prepared call's replay): the caller's stream,
        and the side stream each work is given."""
        from cupy.cuda import runtime

        with self.lock:
            runtime.eventRecord(self.forked.ptr, caller_ptr)
            runtime.streamWaitEvent(self.first.ptr, self.forked.ptr)
            runtime.streamWaitEvent(self.second.ptr, self.forked.ptr)
            try:
                first_work(self.first.ptr)
                second_work(self.second.ptr)
            finally:
                # Join even on error: a fork without a join would invalidate a graph capture.
                runtime.eventRecord(self.first_done.ptr, self.first.ptr)
                runtime.eventRecord(self.second_done.ptr, self.second.ptr)
                runtime.streamWaitEvent(caller_ptr, self.first_done.ptr)
                runtime.streamWaitEvent(caller_ptr, self.second_done.ptr)


_made: dict = {}
_made_lock = threading.Lock()


def side_streams(device_id: int) -> SideStreams:
    """The side streams of a device, made once however many threads ask at once."""
    sides = _made.get(device_id)
    if sides is None:
        with _made_lock:
            sides = _made.get(device_id)
            if sides is None:
                sides = _made[device_id] = SideStreams(device_id)
    return sides
