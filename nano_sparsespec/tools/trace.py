"""What torch.profiler saw over some steps of a run: their kernels, the host's calls, the device's
timeline.

Owns `kernel_table` (the largest kernels or operators of a profiled stretch, per step),
`device_timeline` (how busy a list of device activities kept the device), `chrome_trace` (a
profile's Chrome trace events, optionally kept as a file), `StepWindow` (torch.profiler over a
window of a run's steps: `bench --trace-steps`) and `HostSampler` (where the host's time goes in a
whole run, by sampling its Python stack: `bench --sample-host`).
"""
from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from .measure import synchronize


def kernel_table(prof, steps: int, cuda: bool, top: int) -> dict:
    """torch.profiler's record `prof` of `steps` steps -> {"total_ms": all kernels' own device time
    per step, "top": the `top` kernels by it, [{"name", "ms", "calls"}] per step}. On a CPU,
    operators and their own CPU time instead."""
    events = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == cuda]
    own = [(e.self_device_time_total if cuda else e.self_cpu_time_total) / steps / 1e3
           for e in events]                                                # ms per step
    ranked = sorted(zip(own, events), key=lambda pair: -pair[0])[:top]
    return {"total_ms": round(sum(own), 4),
            "top": [{"name": e.key, "ms": round(ms, 4), "calls": round(e.count / steps, 2)}
                    for ms, e in ranked]}


# An idle gap of the device at least this long (microseconds, the Chrome trace's unit) is one where
# its queue ran dry and it waited for the host; a CUDA graph starts each kernel a few microseconds
# after the one before.
HOST_WAIT_US = 20.0


def device_timeline(intervals: list[tuple[float, float]],
                    waited_gap: float = HOST_WAIT_US) -> tuple[float, float, float]:
    """The device's activities [(start, end), ...] -> (span: the first start to the last end,
    busy: the length of their union, waiting: the idle gaps of at least `waited_gap`); span - busy
    is what the device sat idle between them, waiting the part of it spent waiting for work."""
    if not intervals:
        return 0.0, 0.0, 0.0
    ordered = sorted(intervals)
    busy, waiting, (start, end) = 0.0, 0.0, ordered[0]
    for a, b in ordered[1:]:
        if a > end:                       # an idle gap: close the busy stretch
            busy, start = busy + end - start, a
            waiting += a - end if a - end >= waited_gap else 0.0
        end = max(end, b)
    return end - ordered[0][0], busy + end - start, waiting


def chrome_trace(prof, keep: str | None = None) -> list[dict]:
    """torch.profiler's record `prof` as its Chrome trace's events; `keep`: a path (.json.gz) where
    that trace is also written."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        text = Path(path).read_text()
    if keep:
        Path(keep).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(keep, "wt") as f:
            f.write(text)
    return json.loads(text)["traceEvents"]


def profiled_device_timeline(events: list[dict], launched: float | None = None
                              ) -> tuple[float, float, float]:
    """`device_timeline` in ms of a Chrome trace's `events`: its kernels, copies and fills. With
    `launched` (the trace's clock, us: when the host had launched a window's first step), from the
    end of the last wait of the device that began before then: a window opens at a
    synchronisation, so the device idles while the host prepares and launches that step, a wait
    the run itself does not have."""
    intervals = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                       if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if launched is not None and intervals:
        start, end = intervals[0]                       # the device busy from start to end
        for a, b in intervals[1:]:
            if end > launched:                          # a gap from here on is the run's own
                break
            if a - end >= HOST_WAIT_US:
                start = a
            end = max(end, b)
        intervals = [(a, b) for a, b in intervals if a >= start]
    return tuple(us / 1e3 for us in device_timeline(intervals))


# The name of the profiler mark a step window leaves as it sees each step (`StepWindow`)
STEP_MARK = "nano_sparsespec.step_seen"


class StepWindow:
    """torch.profiler over `count` steps of a run, from step `first` on: pass `on_step` to
    `LLM.generate`, then `finish()` -> {"first", "steps", "ms_per_step" (wall), "works",
    "verifications" (works that check drafts), "drafts" (means per step), "kernels"
    (`kernel_table`), "host" (on CUDA: `kernel_table` of the host's operators and CUDA calls, where
    a step's host time goes and which calls wait for the device), "graphs_recorded" (CUDA graphs
    recorded inside the window), "device_span_ms", "device_busy_ms" and "device_waiting_ms"
    (`device_timeline` per step, from the first step's launch on: `profiled_device_timeline`; None
    on a CPU)}, or None if the run ended before `first`. `trace_path`: where the window's Chrome
    trace is written (.json.gz), to read the host's and the device's timelines side by side
    (chrome://tracing, Perfetto). The window opens after step first - 1 (or the first launched after
    it) and closes after the count-th launched step, each at a synchronisation: it holds the device
    work of its steps and the host-queued work (critical positions refreshed) of processing as many
    steps before."""

    def __init__(self, device: torch.device, first: int, count: int, top: int,
                 trace_path: str | None = None):
        self.device, self.first, self.count, self.top = device, first, count, top
        self.trace_path = trace_path
        self.prof, self.started, self.seconds, self.seen = None, 0.0, 0.0, []
        self.graphs_before = self.graphs_after = 0

    def on_step(self, event) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self.prof is None and event.step >= self.first - 1:
            synchronize(self.device)
            cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self.prof = profile(activities=[ProfilerActivity.CPU] + cuda)
            self.prof.__enter__()
            self.started = time.perf_counter()
            self.graphs_before = event.graphs_recorded
        elif self.prof is not None and not self.seconds:
            checking = sum(w.kind == "verify" and w.num_tokens > 1 for w in event.works)
            drafting = sum(w.kind == "draft" for w in event.works)
            self.seen.append((event.step, len(event.works), checking, drafting))
            with torch.profiler.record_function(STEP_MARK):
                pass
            self.graphs_after = event.graphs_recorded
            if len(self.seen) == self.count:
                self._close()

    def _close(self) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.started
        self.prof.__exit__(None, None, None)

    def finish(self) -> dict | None:
        if self.prof is None or not self.seen:
            return None
        if not self.seconds:                          # the run ended inside the window
            self._close()
        n = len(self.seen)
        works, verifications, drafts = (sum(s[i] for s in self.seen) / n for i in (1, 2, 3))
        cuda = self.device.type == "cuda"
        events = chrome_trace(self.prof, self.trace_path) if cuda or self.trace_path else []
        launched = min((e["ts"] for e in events if e.get("name") == STEP_MARK), default=None)
        span, busy, waiting = (profiled_device_timeline(events, launched) if cuda
                               else (None, None, None))

        def per_step(ms):
            return None if ms is None else round(ms / n, 3)

        return {"first": self.seen[0][0], "steps": n,
                "ms_per_step": round(self.seconds / n * 1e3, 3), "works": works,
                "verifications": verifications, "drafts": drafts,
                "kernels": kernel_table(self.prof, n, cuda, self.top),
                **({"host": kernel_table(self.prof, n, False, self.top)} if cuda else {}),
                "graphs_recorded": self.graphs_after - self.graphs_before,
                "device_span_ms": per_step(span), "device_busy_ms": per_step(busy),
                "device_waiting_ms": per_step(waiting)}


class HostSampler:
    """Where a run's host time goes, by sampling: every `interval` seconds a thread reads the main
    thread's Python stack and counts, among this package's functions, the innermost one with its
    line (`own`: the torch call made there is billed to it) and each one on the stack (`within`).
    Samples taken while a CUDA graph is recorded (one-time work) are left out. A sample holds the
    interpreter ~20 us (a stack of ~50 frames): at 5 ms intervals, under 0.5% of the host's time."""

    PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def __init__(self, interval: float, top: int = 30):
        self.interval, self.top = interval, top
        self.own, self.within, self.samples, self.recording = Counter(), Counter(), 0, 0
        self._stop, self._thread = threading.Event(), None
        self._names: dict = {}             # code object -> 'file:function' or None

    def __enter__(self) -> "HostSampler":
        # the main thread hands the interpreter over within 50 us of a sample's request, not 5 ms
        # (Python's default switch interval), so that a sample lands where the main thread is,
        # not at the next place where it lets go of the interpreter (a torch call, typically)
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(5e-5)
        main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._sample, args=(main,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)

    def _where(self, code) -> str | None:
        """'file:function' of a code object of this package (None for any other), made once."""
        if code not in self._names:
            inside = code.co_filename.startswith(self.PACKAGE)
            self._names[code] = (f"{os.path.relpath(code.co_filename, self.PACKAGE)}:"
                                 f"{code.co_name}" if inside else None)
        return self._names[code]

    def _sample(self, main: int) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(main)
            innermost, seen = None, set()   # this package's functions on the stack
            while frame is not None:
                where = self._where(frame.f_code)
                if where is not None:
                    if where == "cuda_graphs.py:_record":
                        self.recording += 1
                        break
                    if innermost is None:          # (line 0: the frame has none just now)
                        innermost = f"{where}:{frame.f_lineno or 0}"
                    seen.add(where)
                frame = frame.f_back
            else:
                if innermost is not None:
                    self.samples += 1
                    self.own[innermost] += 1
                    self.within.update(seen)

    def result(self) -> dict:
        """{"interval_ms", "samples" (in this package, outside recording), "recording" (samples
        left out), "own" and "within": the `top` functions by share of the samples}."""
        def shares(counter):
            return [[name, round(n / max(self.samples, 1), 4)]
                    for name, n in counter.most_common(self.top)]
        return {"interval_ms": self.interval * 1e3, "samples": self.samples,
                "recording": self.recording, "own": shares(self.own), "within": shares(self.within)}
