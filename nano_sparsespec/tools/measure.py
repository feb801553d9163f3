"""What the benchmark tools measure with: the byte model, peak memory, bandwidth, the machine.

Owns `ByteModel` (a step must read the weights once plus, for every request, the K and V of each
position it attends to), `PeakMemory`, `CompiledFrames` (torch.compile's compilations per
function), `StepClock` and `tenths` (where in a run its time goes), the device's copy bandwidth
and the roofline peak, and the machine and git state a result records; `time_split`, where a
forward's time goes.
"""
from __future__ import annotations

import contextlib
import gc
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..cuda_graphs import compile_seconds
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


def tenths(steps: int) -> list[tuple[int, int]]:
    """A run's steps [0, steps) cut into ten parts in turn, (first, end) each (fewer parts for
    fewer than ten steps)."""
    parts = min(10, steps)
    bounds = [steps * i // parts for i in range(parts + 1)] if parts else []
    return list(zip(bounds, bounds[1:]))


class StepClock:
    """When each launched step of a run began, on a clock that leaves out the one-time costs a
    row's `seconds` leaves out (CUDA-graph recording and compiling outside it), and how long the
    host had waited for results by then. Pass `on_step` to `LLM.generate`, then
    `time_by_tenth(end)`, `wait_by_tenth(end, waited)`."""

    def __init__(self):
        self.starts: list[float] = []
        self.waits: list[float] = []
        self.one_time = 0.0          # one-time costs so far, before the step now observed
        self.compiled = compile_seconds()

    def on_step(self, event) -> None:
        self.starts.append(event.started - self.one_time)
        self.waits.append(event.result_wait_seconds)
        # ... now with this step's: its recording, and compiling that no recording holds
        compiling = compile_seconds() - self.compiled - event.graph_record_compile_seconds
        self.one_time = event.graph_record_seconds + compiling

    def time_by_tenth(self, end: float) -> list[float]:
        """The share of the run's time (to `end`, time.perf_counter() when it ended) spent in each
        tenth of its steps (`tenths`): whether a tail of few busy slots is cheap or dear."""
        if not self.starts:
            return []
        marks = self.starts + [end - self.one_time]
        total = marks[-1] - marks[0]
        return [round((marks[stop] - marks[first]) / total, 4)
                for first, stop in tenths(len(self.starts))]

    def wait_by_tenth(self, end: float, waited: float) -> list[float]:
        """The share of each tenth's time (`time_by_tenth`) the host sat waiting for steps'
        results (`waited`: its seconds over the whole run): near 0 where the host's work bounds
        the steps, the device's queue running dry; larger where the device does."""
        marks, waits = self.starts + [end - self.one_time], self.waits + [waited]
        return [round((waits[stop] - waits[first]) / (marks[stop] - marks[first]), 4)
                if marks[stop] > marks[first] else 0.0 for first, stop in tenths(len(self.starts))]


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


PACKAGE = Path(__file__).resolve().parent.parent


def git_state(package: Path = PACKAGE) -> dict | None:
    """The checkout's commit, whether the package has uncommitted changes (None outside a git
    checkout), and `source_digest`, which names the code that ran where the checkout's git is
    stale (a copy of the working tree beside an older .git)."""
    import subprocess

    try:
        commit = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "package_dirty": bool(dirty),
            "source_digest": source_digest(package)}


def source_digest(package: Path = PACKAGE) -> str:
    """The first 12 hex digits of sha256 over the package's Python files (relative paths and
    contents, in path order): equal digests, the same code."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


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
