"""Tensor parallelism over torch.distributed (gloo on CPUs, NCCL on GPUs).

Each of N ranks holds 1/N of every layer: its share of the query and KV heads (and those heads' KV
pool), of the MLP's columns, and of the vocabulary (embedding and LM head). Two sums over the ranks
per layer (after the attention's output projection and after the MLP's down projection), one for
the embedding, and one gather of the logits make every rank's hidden states and logits the same.

Every rank runs the same engine on the same requests: scheduling, sampling and verification are
functions of the requests, their seeds and the logits, all identical on every rank, so rank 0
sends each `generate` call's requests (seeds drawn) once, not each step's plan. Drafting and
PillarAttn selection run per KV head, so each rank drafts over its own heads unchanged.

Owns
  * `shard(model, rank, world)`: rank `rank`'s part of a loaded CausalLM, with the collectives;
  * `Workers`: ranks 1..N-1 as processes that the engine spawns (rank 0 is the caller's), each
    building the same `LLM` and running the calls rank 0 sends.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from .batch_invariant import Linear, linear
from .model import CausalLM, RotaryEmbedding


class RowParallelLinear(Linear):
    """A linear layer over this rank's slice of the input features, summed over the ranks:
    [T, in / N] -> [T, out] (the attention's output projection, the MLP's down projection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [first, first + V / N) of the embedding: ids elsewhere look up zeros, and
    the sum over the ranks is the full lookup. input_ids [T] -> [T, hidden]."""

    def __init__(self, weight: torch.Tensor, first: int):
        super().__init__()
        self.weight, self.first = nn.Parameter(weight, requires_grad=False), first

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = self.weight[local.clamp(0, self.weight.shape[0] - 1)] * mine[:, None]
        dist.all_reduce(out)
        return out


class VocabParallelHead(Linear):
    """This rank's rows of the LM head; the ranks' logits gathered in rank order:
    [N, hidden] -> [N, V]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = linear(x, self.weight)                                    # [N, V / world]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)


def check_divisible(cfg, world: int) -> None:
    """ValueError naming the first size that `world` ranks cannot share evenly."""
    for name in ("num_kv_heads", "intermediate_size", "vocab_size"):
        if getattr(cfg, name) % world:
            raise ValueError(f"tensor_parallel={world} does not divide the model's {name} "
                             f"({getattr(cfg, name)})")


def shard(model: CausalLM, rank: int, world: int) -> CausalLM:
    """Rank `rank`'s part of `model`: a CausalLM whose config counts this rank's heads and MLP
    columns (so the KV pool and every kernel size themselves to them), its weights the matching
    slices, and the parallel layers above in place of the split ones."""
    cfg = model.config
    check_divisible(cfg, world)
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // world,
                                num_kv_heads=cfg.num_kv_heads // world,
                                intermediate_size=cfg.intermediate_size // world)
    D, H, KV, inter = cfg.head_dim, local.num_heads, local.num_kv_heads, local.intermediate_size
    vocab = cfg.vocab_size // world

    def mine(w, size):                        # this rank's block of `size` rows of w
        return w[rank * size:(rank + 1) * size]

    state = {}
    for name, w in model.state_dict().items():
        if name.endswith("qkv_proj.weight"):  # rows q | k | v: this rank's heads of each
            q, k, v = w.split([cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D])
            w = torch.cat([mine(q, H * D), mine(k, KV * D), mine(v, KV * D)])
        elif name.endswith("o_proj.weight"):  # columns: this rank's heads
            w = mine(w.t(), H * D).t()
        elif name.endswith("gate_up_proj.weight"):  # rows gate | up
            gate, up = w.chunk(2)
            w = torch.cat([mine(gate, inter), mine(up, inter)])
        elif name.endswith("down_proj.weight"):
            w = mine(w.t(), inter).t()
        state[name] = w.contiguous()
    embedding = model.embed_tokens.weight                                  # [V, hidden]
    head = embedding if model.lm_head is None else model.lm_head.weight    # [V, hidden]
    with torch.device("meta"):
        ranks_part = CausalLM(local)
    ranks_part = ranks_part.to_empty(device=embedding.device).to(embedding.dtype)
    ranks_part.load_state_dict(state, strict=True)
    ranks_part.rope = RotaryEmbedding(local).to(embedding.device)
    ranks_part.embed_tokens = VocabParallelEmbedding(mine(embedding, vocab).clone(), rank * vocab)
    ranks_part.lm_head = VocabParallelHead(cfg.hidden_size, vocab)
    ranks_part.lm_head.weight = nn.Parameter(mine(head, vocab).clone(), requires_grad=False)
    for layer in ranks_part.layers:
        for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            split = getattr(owner, name)
            parallel = RowParallelLinear(split.in_features, split.out_features)
            parallel.weight = split.weight
            setattr(owner, name, parallel)
    return ranks_part.eval().requires_grad_(False)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: its own GPU (cuda:rank), or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init(rank: int, world: int, port: int, device: torch.device) -> None:
    """Join the process group of `world` ranks on this machine. On the CPU the ranks share its
    cores: each (rank 0's process too) computes with cpu_count / world threads."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(device)          # NCCL's collectives run on the current device
    # the workers wait for rank 0's next call as long as the user takes (torch's default: 30 min)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(days=1))


def _serve(rank: int, world: int, port: int, llm_kwargs: dict) -> None:
    """A worker rank: build the LLM's part, then run each call rank 0 sends, until None."""
    from .llm import LLM

    llm = LLM(**llm_kwargs, tensor_parallel=world, rank=rank, port=port)
    while True:
        call = [None]
        dist.broadcast_object_list(call, src=0)
        if call[0] is None:
            break
        llm.run_requests(*call[0])
    dist.destroy_process_group()


class Workers:
    """Ranks 1..world-1 as spawned processes, each building `LLM(**llm_kwargs)`'s part."""

    def __init__(self, world: int, llm_kwargs: dict):
        self.threads = torch.get_num_threads()   # this process's, restored by `close`
        with socket.socket() as s:            # a free port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        context = mp.get_context("spawn")
        self.processes = [context.Process(target=_serve, args=(rank, world, self.port, llm_kwargs),
                                          daemon=True) for rank in range(1, world)]
        for p in self.processes:
            p.start()

    def send(self, call: tuple | None) -> None:
        """Every worker runs `LLM.run_requests(*call)` (None: they stop)."""
        dist.broadcast_object_list([call], src=0)

    def close(self) -> None:
        if dist.is_initialized():
            self.send(None)
            dist.destroy_process_group()
        for p in self.processes:
            p.join(timeout=30)
        torch.set_num_threads(self.threads)
