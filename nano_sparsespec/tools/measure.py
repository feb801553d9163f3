"""What the benchmark tools measure with: the byte model, peak memory, bandwidth, the machine.

Owns `ByteModel` (a step must read the weights once plus, for every request, the K and V of each
position it attends to), `PeakMemory`, `CompiledFrames` (torch.compile's compilations per
function), `kernel_table`, `device_timeline` and `StepWindow` (the kernels of a run's steps and
how busy they kept the device, from torch.profiler),
`StepClock` and `tenths` (where in a run its time goes), the device's copy bandwidth and the
roofline peak, and the machine and git state a result records; `time_split`, where a forward's
time goes.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import platform
import gc
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..model import CausalLM

H200_PEAK_GBS = 4300.0


@dataclass(frozen=True)
class ByteModel:
    """Bytes one step must read: the weights once, plus K and V of every attended (request,
    position) pair."""
    # Parameters read once per step (an untied embedding table is only looked up: not counted).
    weight_bytes: int
    kv_bytes_per_position: int    # K and V of one position, all layers and KV heads

    def step_bytes(self, kv_positions: int) -> int:
        return self.weight_bytes + kv_positions * self.kv_bytes_per_position

    def run_bytes(self, steps: int, kv_positions: int) -> int:
        return steps * self.weight_bytes + kv_positions * self.kv_bytes_per_position


def byte_model(model: CausalLM, kv_dtype: torch.dtype) -> ByteModel:
    cfg = model.config
    weights = model.weight_bytes()
    # Untied: each step reads only its tokens' rows of the embedding table.
    if model.lm_head is not None:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
          * torch.tensor([], dtype=kv_dtype).element_size())
    return ByteModel(weights, kv)



def _left_padded(token_ids: list[list[int]], device) -> dict:
    """input_ids and attention_mask [B, width] of these prompts, left-padded with 0 (as
    `generate` takes them)."""
    width = max(len(t) for t in token_ids)
    input_ids = torch.zeros(len(token_ids), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(token_ids):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        mask[i, width - len(ids):] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


def hf_kv_positions(prompt_lens: list[int], output_lens: list[int]) -> int:
    """KV positions transformers' batched generate must read (without its padding).

    A request of p prompt tokens that writes n tokens reads p positions in the prefill step,
    then p + t at decode step t = 1 .. n-1.
    """
    return sum(p + sum(p + t for t in range(1, n)) for p, n in zip(prompt_lens, output_lens))


# --------------------------------------------------------------------------------------------------
# Measuring: synchronisation, memory, peak bandwidth

def model_label(path: Path) -> str:
    """A model directory's name without the cache's hash suffix
    (`SmolLM2-135M-Instruct.Q4_1-7219ceb7bc91`)."""
    name = Path(path).name
    stem, _, tail = name.rpartition("-")
    return stem if stem and len(tail) == 12 and all(c in "0123456789abcdef" for c in tail) else name


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Peak memory above what the process held when the block started.

    CUDA allocator peak on a GPU, process RSS (sampled every 5 ms by a thread) on the CPU.
    """

    def __init__(self, device: torch.device):
        self.device, self.peak_bytes = device, 0
        self._stop = threading.Event()

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._start = self._max = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._max = max(self._max, _rss_bytes())

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._max, _rss_bytes())
        self.peak_bytes = max(0, peak - self._start)
        return False


class CompiledFrames:
    """torch.compile's compilations while the block runs, per compiled function: `frames`
    {name: [compilations, seconds]} from dynamo's record of each frame it compiled (tracing and
    code generation, or a cache hit's reload). Where start-up goes: a function is compiled once
    per shape it is specialised on."""

    def __enter__(self):
        from torch._dynamo import utils
        utils.set_compilation_metrics_limit(1 << 20)     # torch keeps the last 64 by default
        self._before, self.frames = len(utils.get_compilation_metrics()), {}
        return self

    def __exit__(self, *exc):
        from torch._dynamo import utils
        for frame in utils.get_compilation_metrics()[self._before:]:
            if frame.co_name is not None:
                entry = self.frames.setdefault(frame.co_name, [0, 0.0])
                entry[0] += 1
                entry[1] += frame.entire_frame_compile_time_s or 0.0
        return False


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


def device_timeline(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """The device's activities [(start, end), ...] -> (span: the first start to the last end,
    busy: the length of their union); span - busy is what the device sat idle between them."""
    if not intervals:
        return 0.0, 0.0
    ordered = sorted(intervals)
    busy, (start, end) = 0.0, ordered[0]
    for a, b in ordered[1:]:
        if a > end:                       # an idle gap: close the busy stretch
            busy, start = busy + end - start, a
        end = max(end, b)
    return end - ordered[0][0], busy + end - start


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


def profiled_device_timeline(events: list[dict]) -> tuple[float, float]:
    """`device_timeline` in ms of a Chrome trace's `events`: its kernels, copies and fills."""
    span, busy = device_timeline([(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")])
    return span / 1e3, busy / 1e3


class StepWindow:
    """torch.profiler over `count` steps of a run, from step `first` on: pass `on_step` to
    `LLM.generate`, then `finish()` -> {"first", "steps", "ms_per_step" (wall), "works",
    "verifications" (works that check drafts), "drafts" (means per step), "kernels"
    (`kernel_table`), "host" (on CUDA: `kernel_table` of the host's operators and CUDA calls,
    where a step's host time goes and which calls wait for the device), "graphs_recorded" (CUDA
    graphs recorded inside the window), "device_span_ms" and "device_busy_ms" (`device_timeline`
    per step; None on a CPU)}, or None if the run ended before `first`. `trace_path`: where the
    window's Chrome trace is written (.json.gz), to read the host's and the device's timelines side
    by side (chrome://tracing, Perfetto). The window opens after step
    first - 1 (or the first launched after it) and closes after the count-th launched step, each at
    a synchronisation: it holds the device work of its steps and the host-queued work (critical
    positions refreshed) of processing as many steps before."""

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
        span, busy = profiled_device_timeline(events) if cuda else (None, None)

        def per_step(ms):
            return None if ms is None else round(ms / n, 3)

        return {"first": self.seen[0][0], "steps": n,
                "ms_per_step": round(self.seconds / n * 1e3, 3), "works": works,
                "verifications": verifications, "drafts": drafts,
                "kernels": kernel_table(self.prof, n, cuda, self.top),
                **({"host": kernel_table(self.prof, n, False, self.top)} if cuda else {}),
                "graphs_recorded": self.graphs_after - self.graphs_before,
                "device_span_ms": per_step(span), "device_busy_ms": per_step(busy)}


def tenths(steps: int) -> list[tuple[int, int]]:
    """A run's steps [0, steps) cut into ten parts in turn, (first, end) each (fewer parts for
    fewer than ten steps)."""
    parts = min(10, steps)
    bounds = [steps * i // parts for i in range(parts + 1)] if parts else []
    return list(zip(bounds, bounds[1:]))


class StepClock:
    """When each launched step of a run began, on a clock that leaves out CUDA-graph recording:
    pass `on_step` to `LLM.generate`, then `time_by_tenth(end)`."""

    def __init__(self):
        self.starts: list[float] = []
        self.recorded = 0.0          # graph recording so far, before the step now observed

    def on_step(self, event) -> None:
        self.starts.append(event.started - self.recorded)
        self.recorded = event.graph_record_seconds     # ... now with this step's recording

    def time_by_tenth(self, end: float) -> list[float]:
        """The share of the run's time (to `end`, time.perf_counter() when it ended) spent in each
        tenth of its steps (`tenths`): whether a tail of few busy slots is cheap or dear."""
        if not self.starts:
            return []
        marks = self.starts + [end - self.recorded]
        total = marks[-1] - marks[0]
        return [round((marks[stop] - marks[first]) / total, 4)
                for first, stop in tenths(len(self.starts))]


def copy_bandwidth_gbs(device: torch.device, nbytes: int | None = None, reps: int = 5) -> float:
    """Measured copy bandwidth (read + write bytes per second) of one large tensor on `device`."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    synchronize(device)
    seconds = time.perf_counter() - start
    return 2 * nbytes * reps / seconds / 1e9


def peak_bandwidth(device: torch.device, given: float | None) -> tuple[float, str, float]:
    """(peak GB/s used for the roofline, where it comes from, measured copy GB/s)."""
    measured = copy_bandwidth_gbs(device)
    if given is not None:
        return given, "--peak-bandwidth", measured
    if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device):
        return H200_PEAK_GBS, "H200 (4.3 TB/s)", measured
    return measured, "measured copy", measured


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": str(device)}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    info["git"] = git_state()
    return info


def git_state() -> dict | None:
    """The checkout's commit and whether the package has uncommitted changes (None outside a
    git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "nano_sparsespec"],
                               capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "package_dirty": bool(dirty)}


@contextlib.contextmanager
def time_split(model: CausalLM, device: torch.device):
    """Seconds spent in the decoder's linear layers, in its attention modules besides their linear
    layers (attention, RoPE, q/k norms) and in its whole forward, measured with forward hooks; each
    timed call is bracketed by synchronisations (on a GPU a small distortion)."""
    totals = {"linear": 0.0, "attention_module": 0.0, "attention_linear": 0.0, "forward": 0.0}
    started: dict[int, float] = {}
    attention_linears = {id(m) for layer in model.layers
                         for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)}

    def before(module, args):
        synchronize(device)
        started[id(module)] = time.perf_counter()

    def after(kinds):
        def hook(module, args, output):
            synchronize(device)
            seconds = time.perf_counter() - started.pop(id(module))
            for kind in kinds(module):
                totals[kind] += seconds
        return hook

    handles = []
    for m in model.layers.modules():
        if isinstance(m, nn.Linear):
            kinds = (lambda mod: ("linear", "attention_linear")
                     if id(mod) in attention_linears else ("linear",))
        elif m.__class__.__name__ == "Attention":
            kinds = (lambda mod: ("attention_module",))
        else:
            continue
        handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after(kinds))]
    handles += [model.register_forward_pre_hook(before),
                model.register_forward_hook(after(lambda mod: ("forward",)))]
    try:
        yield totals
    finally:
        for h in handles:
            h.remove()
