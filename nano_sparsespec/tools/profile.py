"""The step profile (`bench --profile-steps`): what one step of each kind costs at a shape, and the
speedup that follows.

Owns `StepProfiler` (a plain, a draft, a verification and a balanced mixed step, the last two also
keeping their selections, for `--refresh-every`, of `batch` requests that hold `context` cached
positions, run through the engine's own `ModelRunner` on a KV pool of random K/V, back to back as
the engine's loop runs them, and where a step's device time goes, kernel by kernel; on the loaded
model or a named shape with random weights, model_shapes.py) and the speedup models: lock-step,
balanced, the ceiling (`balanced_speedup` over a plain step with one block of context, the part of
a step that is not attention, which no drafter that runs the model's layers undercuts) and a
generation's (`over_generation`: contexts growing from a batch's shortest profiled shape to a
longer one).
"""
from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

from .. import pillar_attn
from ..config import SamplingParams, SpecConfig
from ..kv_cache import KVCache
from ..llm import LLM
from ..model import CausalLM
from ..runner import ModelRunner
from ..scheduler import Sequence, Status, Work
from .measure import byte_model, model_label, synchronize, time_split
from .model_shapes import (MODEL_SHAPES, memory_available, parameter_count,
                           profile_memory_needed, random_model, shape_config)
from .trace import kernel_table


class StepProfiler:
    """One plain, one draft and one verification step of `batch` requests that each hold
    `context` cached positions, run through the engine's `ModelRunner` (the kernels and host work a
    real step uses); and the mixed step of balanced batching, where one request in k + 1 verifies
    while the others draft. Drafts attend as `method` drafts (pillar or pillar-lookup)."""

    def __init__(self, model: CausalLM, batch: int, context: int, stride: int,
                 device: torch.device, dtype: torch.dtype, budget_ratio: float, min_budget: int,
                 temperature: float, seed: int = 0, cuda_graphs: bool = False,
                 block_size: int = SpecConfig.block_size, method: str = "pillar",
                 score_every: int = 1):
        cfg = model.config
        self.model, self.batch, self.context, self.k, self.device = (model, batch, context,
                                                                      stride, device)
        common = dict(stride=stride, budget_ratio=budget_ratio, min_budget=min_budget,
                      max_batch=batch, block_size=block_size)
        self.plain_spec = SpecConfig(method="plain", **common)
        self.spec = SpecConfig(method=method, score_every=score_every, **common)
        block = self.spec.block_size
        per_request = -(-(context + stride + 1) // block)
        self.cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, batch * per_request,
                             block, dtype, device)
        g = torch.Generator(device=device).manual_seed(seed)
        # [L, slots, n_kv, head_dim] random keys and values
        self.cache.k.normal_(generator=g)
        self.cache.v.normal_(generator=g)
        params = SamplingParams(temperature=temperature, max_new_tokens=stride + 2, ignore_eos=True)
        cpu = torch.Generator().manual_seed(seed)
        self.seqs = []
        for b in range(batch):
            seq = Sequence(b, torch.randint(0, cfg.vocab_size, (context,), generator=cpu).tolist(),
                           params, seed + b)
            # The pending token.
            seq.tokens.append(int(torch.randint(0, cfg.vocab_size, (1,), generator=cpu)))
            seq.num_prefilled, seq.status, seq.row = context, Status.RUNNING, b
            self.cache.append(b, context)
            self.seqs.append(seq)
        self.budget = min(self.spec.budget(context), context)
        self.plain_runner = ModelRunner(model, self.cache, self.plain_spec, cuda_graphs)
        self.runner = ModelRunner(model, self.cache, self.spec, cuda_graphs)
        chosen = torch.rand(batch, cfg.num_layers, cfg.num_kv_heads, context, generator=g,
                            device=device)
        # critical positions: `budget` distinct random positions per (request, layer, KV head)
        self.runner.set_selections(
            self.seqs, chosen.topk(self.budget, dim=-1).indices.sort(dim=-1).values,
            [self.budget] * batch)
        if method == "pillar-lookup":                    # the drafts' token lookups search these
            self.runner.committed.send(self.seqs)
        self.bm = byte_model(model, dtype)

    def _steps(self, runner: ModelRunner, n_verify: int, verify_tokens: int, steps: int,
               select: bool = False) -> tuple[float, float]:
        """Run `steps` identical steps in which the first `n_verify` requests verify
        `verify_tokens` tokens (a plain step: 1 token) and the others draft one token, as the
        engine's delayed-verification loop (and plain decoding's run-ahead loop) runs them: each
        step is launched before the previous step's results are read -> (seconds per step, host
        seconds per step spent launching: lists built, device work queued). On a GPU a step's host
        work overlaps the device work of the step before; on the CPU they add up. Without `select`
        the verifications keep their selections: no scores (`SpecConfig.refresh_every`)."""
        works = [Work(seq, "verify", self.context, verify_tokens, reselects=select)
                 if i < n_verify else Work(seq, "draft", self.context, 1)
                 for i, seq in enumerate(self.seqs)]
        for w in works:
            self.cache.append(w.seq.seq_id, w.num_tokens)
            w.seq.num_drafts = w.num_tokens - 1 if w.kind == "verify" else 0
        synchronize(self.device)
        start, host, previous = time.perf_counter(), 0.0, None
        for _ in range(steps):
            launched = time.perf_counter()
            result = runner.launch(works)
            host += time.perf_counter() - launched
            if previous is not None:
                self._read(previous, n_verify, select)
            previous = result
        self._read(previous, n_verify, select)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        for w in works:
            self.cache.rollback(w.seq.seq_id, w.num_tokens)
            w.seq.num_drafts = 0
        return seconds / steps, host / steps

    def _read(self, result, n_verify: int, select: bool) -> None:
        """What the engine does with a step's results: read its verifications and, with
        `select`, pick the next cycle's critical positions from their scores."""
        if result.verify_works:
            result.fetch()
        if select:
            chosen, _ = pillar_attn.top_positions(result.scores, [self.context] * n_verify,
                                                  [self.budget] * n_verify)
            pillar_attn.for_every_layer(chosen, self.spec.score_every, self.model.config.num_layers)

    def plain(self, steps: int = 1) -> tuple[float, float]:
        return self._steps(self.plain_runner, self.batch, 1, steps)

    def draft(self, steps: int = 1) -> tuple[float, float]:
        return self._steps(self.runner, 0, 1, steps)

    def verify(self, steps: int = 1) -> tuple[float, float]:
        return self._steps(self.runner, self.batch, self.k + 1, steps, select=True)

    def mixed(self, steps: int = 1) -> tuple[float, float]:
        return self._steps(self.runner, -(-self.batch // (self.k + 1)), self.k + 1, steps,
                           select=True)

    def verify_kept(self, steps: int = 1) -> tuple[float, float]:   # no scores, no selection
        return self._steps(self.runner, self.batch, self.k + 1, steps)

    def mixed_kept(self, steps: int = 1) -> tuple[float, float]:    # no scores, no selection
        return self._steps(self.runner, -(-self.batch // (self.k + 1)), self.k + 1, steps)

    def step_bytes(self) -> dict:
        b, c, k, sel = self.batch, self.context, self.k, self.budget + 1
        n_verify = -(-b // (k + 1))
        verify = self.bm.step_bytes(b * (c + k + 1))
        mixed = self.bm.step_bytes(n_verify * (c + k + 1) + (b - n_verify) * sel)
        return {"plain": self.bm.step_bytes(b * (c + 1)), "draft": self.bm.step_bytes(b * sel),
                "verify": verify, "mixed": mixed, "verify_kept": verify, "mixed_kept": mixed}

    def measure(self, reps: int, runs: int = 3,
                kinds: tuple = ("plain", "draft", "verify", "mixed")) -> dict:
        """kind -> (seconds, host seconds) per step: the median over `runs` runs of `reps` steps
        each (after one warm-up run)."""
        out = {}
        for kind in kinds:
            fn = getattr(self, kind)
            fn(reps)
            measured = [fn(reps) for _ in range(runs)]
            out[kind] = tuple(statistics.median(run[i] for run in measured) for i in (0, 1))
        return out

    def kernel_times(self, kind: str, steps: int, top: int) -> dict:
        """Where the device time of a `kind` step goes, from torch.profiler over `steps` steps
        (after `steps` unprofiled ones: graphs recorded) -> `kernel_table`."""
        from torch.profiler import ProfilerActivity, profile

        run, cuda = getattr(self, kind), self.device.type == "cuda"
        run(steps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            run(steps)
        return kernel_table(prof, steps, cuda, top)

    def plain_breakdown(self, reps: int) -> dict:
        """Where a plain step's time goes (means over `reps` instrumented steps), in ms."""
        with time_split(self.model, self.device) as t:
            start = time.perf_counter()
            for _ in range(reps):
                self.plain()
            total = (time.perf_counter() - start) / reps
        t = {k: v / reps for k, v in t.items()}
        attention = t["attention_module"] - t["attention_linear"]
        ms = {"total": total, "linear_layers": t["linear"], "attention": attention,
              "other_layer_ops": t["forward"] - t["linear"] - attention,
              "lm_head_sampling_and_host": total - t["forward"]}
        return {k: round(v * 1e3, 3) for k, v in ms.items()}


def speedup_model(plain: float, draft: float, verify: float, k: int, accepted: float) -> float:
    """A cycle of k drafts + 1 verification yields accepted + 1 tokens; plain yields one token per
    step."""
    return (accepted + 1) * plain / (k * draft + verify)


def balanced_speedup(plain: float, step: float, k: int, accepted: float) -> float:
    """Balanced batching with every slot busy: each request writes accepted + 1 tokens per k + 1
    steps of cost `step`, against plain decoding's one token per step of cost `plain`.

    With `step` the measured mixed step, what the engine's balanced steps give at that shape; with
    `step` a plain step over one block of context (the part of a step that is not attention), the
    ceiling no drafter that runs the model's layers passes: near (accepted + 1) / (k + 1) where
    attention is a small part of a plain step.
    """
    return (accepted + 1) / (k + 1) * plain / step


def over_generation(entries: list[dict], k: int) -> None:
    """Add to each profiled entry with a shorter-context entry of its model and batch the balanced
    speedup over a generation whose context grows from that shorter context to its own:
    entry["over_generation"] = {"from": context, "balanced_at_accepted": {a: x}}. Each step's cost
    taken linear in context between the two shapes, it is the mean plain step's against the mean
    balanced step's (`mixed_refreshed_ms` where measured): the trapezoid rule, exact there."""
    timed = [e for e in entries if "plain" in e]
    for long in timed:
        short = min((e for e in timed if (e["model"], e["batch"]) == (long["model"], long["batch"])
                     and e["context"] < long["context"]), key=lambda e: e["context"], default=None)
        if short is None:
            continue
        plain = short["plain"]["ms"] + long["plain"]["ms"]
        mixed = sum(e.get("mixed_refreshed_ms", e["mixed"]["ms"]) for e in (short, long))
        long["over_generation"] = {"from": short["context"], "balanced_at_accepted": {
            a: round(balanced_speedup(plain, mixed, k, float(a)), 3)
            for a in long["balanced_at_accepted"]}}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        try:
            b, c = item.lower().split("x")
            b, c = int(b), int(c.rstrip("k")) * (1024 if c.endswith("k") else 1)
        except ValueError:
            raise ValueError(f"bad profile shape {item!r}: expected BATCHxCONTEXT, "
                             f"e.g. 8x1024 or 64x8k") from None
        if b < 1 or c < 1:
            raise ValueError(f"bad profile shape {item!r}: batch and context must be >= 1")
        shapes.append((b, c))
    return shapes


def run_profile(args, llm: LLM | None, device: torch.device, dtype: torch.dtype,
                accepted: list[float]) -> list[dict]:
    shapes = parse_shapes(args.profile_shapes)
    max_context = max(c for _, c in shapes) + args.stride + 2
    floor_context = min([args.block_size] + [c for _, c in shapes])
    results = []
    for name in [m.strip() for m in args.profile_models.split(",") if m.strip()]:
        if name == "model":
            if llm is None:
                llm = LLM(args.model, device=str(device), dtype=dtype, gguf=args.gguf)
            model, label, loaded = llm.model, f"model ({model_label(llm.model_path)})", True
            cfg = model.config
        elif name in MODEL_SHAPES:
            model, label, loaded, cfg = None, name, False, shape_config(name, max_context)
        else:
            raise ValueError(f"unknown profile model {name!r}: "
                             f"expected 'model' or one of {list(MODEL_SHAPES)}")
        built = False
        # batch -> (seconds, host seconds) of a plain step over at most one block of context
        floors = {}
        for batch, context in shapes:
            entry = {"model": label, "batch": batch, "context": context, "stride": args.stride,
                     "dtype": str(dtype).replace("torch.", "")}
            if context + args.stride + 1 > cfg.max_position_embeddings:
                entry["skipped"] = (f"context {context} + k + 1 exceeds the model's "
                                    f"{cfg.max_position_embeddings}")
            else:
                need = profile_memory_needed(cfg, dtype, batch, context, args.stride,
                                             loaded or built)
                have = memory_available(device)
                if need > 0.85 * have:
                    entry["skipped"] = (f"needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} "
                                        f"GiB available on {device.type}")
            if "skipped" in entry:
                print(f"profile {label} {batch}x{context}: skipped: {entry['skipped']}",
                      file=sys.stderr)
                results.append(entry)
                continue
            if model is None:
                print(f"profile: building {label} with random weights "
                      f"({parameter_count(cfg) / 1e9:.2f} B parameters, {entry['dtype']}) ...",
                      file=sys.stderr)
                model, built = random_model(cfg, device, dtype, args.seed), True
            print(f"profile {label} {batch}x{context} ...", file=sys.stderr)
            prof = StepProfiler(model, batch, context, args.stride, device, dtype,
                                args.budget_ratio, args.min_budget, args.temperature, args.seed,
                                args.cuda_graphs, args.block_size, args.pillar_method,
                                args.score_every)
            kept = ("verify_kept", "mixed_kept") if args.refresh_every > 1 else ()
            kinds = ("plain", "draft", "verify", "mixed") + kept
            measured = prof.measure(args.profile_reps, kinds=kinds)
            times = {kind: seconds for kind, (seconds, _) in measured.items()}
            nbytes = prof.step_bytes()
            entry["budget"], entry["drafter"] = prof.budget, args.pillar_method
            entry["score_every"], entry["refresh_every"] = args.score_every, args.refresh_every
            for kind, (seconds, host) in measured.items():
                entry[kind] = {"ms": round(seconds * 1e3, 3), "host_ms": round(host * 1e3, 3),
                               "bytes": nbytes[kind], "gbs": round(nbytes[kind] / seconds / 1e9, 2)}
            entry["draft_over_plain"] = round(times["draft"] / times["plain"], 3)
            entry["verify_over_plain"] = round(times["verify"] / times["plain"], 3)
            # A balanced step against the mean step of lock-step batching (k drafts + 1
            # verification over k + 1 steps): the same work per request, spread differently.
            # Above 1: balancing costs time.
            lockstep_mean = (args.stride * times["draft"] + times["verify"]) / (args.stride + 1)
            entry["mixed_over_lockstep_mean"] = round(times["mixed"] / lockstep_mean, 3)
            entry["speedup_at_accepted"] = {f"{a:g}": round(speedup_model(
                times["plain"], times["draft"], times["verify"], args.stride, a), 3)
                for a in accepted}
            if batch not in floors:
                floor = StepProfiler(model, batch, floor_context, args.stride, device, dtype,
                                     args.budget_ratio, args.min_budget, args.temperature,
                                     args.seed, args.cuda_graphs, args.block_size)
                floors[batch] = floor.measure(args.profile_reps, kinds=("plain",))["plain"]
                del floor
            entry["plain_floor"] = {"context": floor_context,
                                    "ms": round(floors[batch][0] * 1e3, 3),
                                    "host_ms": round(floors[batch][1] * 1e3, 3)}
            entry["balanced_at_accepted"] = {f"{a:g}": round(balanced_speedup(
                times["plain"], times["mixed"], args.stride, a), 3) for a in accepted}
            if kept:   # the engine re-selects in one period in refresh_every: its mean mixed step
                n = args.refresh_every
                mean = (times["mixed"] + (n - 1) * times["mixed_kept"]) / n
                entry["mixed_refreshed_ms"] = round(mean * 1e3, 3)
                entry["balanced_refreshed_at_accepted"] = {f"{a:g}": round(balanced_speedup(
                    times["plain"], mean, args.stride, a), 3) for a in accepted}
            entry["ceiling_at_accepted"] = {f"{a:g}": round(balanced_speedup(
                times["plain"], floors[batch][0], args.stride, a), 3) for a in accepted}
            if args.profile_kernels:
                entry["kernels"] = {kind: prof.kernel_times(kind, args.profile_reps,
                                                             args.profile_kernels)
                                    for kind in kinds}
            if not args.cuda_graphs:   # a replayed graph runs no Python per module: no split
                entry["plain_breakdown_ms"] = prof.plain_breakdown(args.profile_reps)
            results.append(entry)
            del prof
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if built:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    over_generation(results, args.stride)
    return results


