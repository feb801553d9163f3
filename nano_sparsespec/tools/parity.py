"""Verification <-> decode parity (`python -m nano_sparsespec.tools.parity`): does a
verification row compute, bit for bit, what the plain decode step computes for its position?

Each prompt is decoded twice, alone: plain greedy, then greedy with a drafter. Forward hooks keep,
per position, what every layer's pieces produce (the input of the qkv projection, the qkv
projection, attention, the output projection, the MLP's two projections, the final hidden state).
For each verification row whose input token equals plain decoding's, the tool names the first
piece, in the order the forward runs them, whose bits differ from the decode row's: the operation
that breaks parity (everything after it differs because it did). Greedy speculation is lossless
in a dtype exactly when no row has one.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

from ..config import SamplingParams
from ..llm import DTYPES, LLM
from .acceptance import BUILTIN_PROMPTS

PIECES = (("qkv_in", "self_attn.qkv_proj", "input"), ("qkv", "self_attn.qkv_proj", "output"),
          ("attention", "self_attn.o_proj", "input"), ("o_proj", "self_attn.o_proj", "output"),
          ("gate_up", "mlp.gate_up_proj", "output"), ("down", "mlp.down_proj", "output"))


def record_rows(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], dict]:
    """Generate for `prompt` alone, keeping each forward's rows -> (token ids, {(piece, position,
    rows in the forward): row}). The forward's rows tell decode rows (1) from verification rows
    (k + 1)."""
    rows, forward, hooks = {}, {}, []

    def keep(name, tensor):
        for i, p in enumerate(forward["positions"]):
            rows[name, p, len(forward["positions"])] = tensor[i].detach().clone()

    def start(module, args):
        forward["positions"] = args[1].tolist()
    hooks.append(llm.model.register_forward_pre_hook(start))
    for layer_id, layer in enumerate(llm.model.layers):
        for piece, path, which in PIECES:
            module = layer.get_submodule(path)
            name = f"layer {layer_id} {piece}"
            hooks.append(module.register_forward_hook(
                lambda m, args, out, name=name, which=which:
                keep(name, args[0] if which == "input" else out)))
    hooks.append(llm.model.register_forward_hook(lambda m, args, out: keep("final hidden", out)))
    try:
        return llm.generate(prompt, params)[0].token_ids, rows
    finally:
        for hook in hooks:
            hook.remove()


def pieces_in_order(num_layers: int) -> list[str]:
    return [f"layer {i} {piece}" for i in range(num_layers) for piece, _, _ in PIECES] + \
        ["final hidden"]


def compare(plain: dict, spec: dict, order: list[str]) -> Counter:
    """First differing piece of every verification row that has a decode row to compare with
    (None: identical throughout)."""
    firsts = Counter()
    for name, position, rows in spec:
        if name != "final hidden" or rows == 1 or ("final hidden", position, 1) not in plain:
            continue
        if not torch.equal(plain["layer 0 qkv_in", position, 1],
                           spec["layer 0 qkv_in", position, rows]):
            continue                                     # a rejected draft: another input token
        firsts[next((n for n in order if not torch.equal(plain[n, position, 1],
                                                         spec[n, position, rows])), None)] += 1
    return firsts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="embedded (default), a .gguf or HF dir")
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--method", default="pillar-lookup")
    parser.add_argument("--prompts", type=int, default=2, help="how many built-in prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    options = dict(device=args.device, dtype=args.dtype, gguf=args.gguf,
                   cuda_graphs=args.cuda_graphs, compile=args.compile)
    plain = LLM(args.model, method="plain", **options)
    spec = LLM(args.model, method=args.method, batch_policy="naive", **options)
    order = pieces_in_order(plain.model.config.num_layers)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    total, identical = Counter(), 0
    for prompt in BUILTIN_PROMPTS[:args.prompts]:
        plain_tokens, plain_rows = record_rows(plain, prompt, params)
        spec_tokens, spec_rows = record_rows(spec, prompt, params)
        identical += plain_tokens == spec_tokens
        total.update(compare(plain_rows, spec_rows, order))
    rows = sum(total.values())
    print(f"{args.method}, {args.dtype}, {args.device}: {identical} / {args.prompts} outputs "
          f"identical to plain decoding; {total[None]} / {rows} verification rows bit-identical "
          f"to their decode rows")
    for piece, count in total.most_common():
        if piece is not None:
            print(f"  first difference in {piece}: {count} rows")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
