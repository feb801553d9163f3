"""Verification <-> decode parity (`python -m nano_sparsespec.tools.parity`): does a
verification row compute, bit for bit, what the plain decode step computes for its position?

Each prompt is decoded twice, alone: plain greedy, then greedy with a drafter. Forward hooks keep,
per position, what every layer's pieces produce (the input of the qkv projection, the qkv
projection, attention, the output projection, the MLP's two projections, the final hidden state)
for the rows that attend densely (decode, verification; not padding, not sparse drafts).
For each verification row whose input token equals plain decoding's, the tool names the first
piece, in the order the forward runs them, whose bits differ from the decode row's: the operation
that breaks parity (everything after it differs because it did). Greedy speculation is lossless
in a dtype exactly when no row has one. With `--cuda-graphs` (and `--compile`) the fast path's
padded steps run unrecorded, so that the hooks see them: the same kernels a replay runs.

With `--outputs` it checks whole generations instead: plain greedy decoding of a batch of
reasoning prompts, then every drafter with naive batching and with balanced batching and delayed
verification, counting the outputs identical to plain decoding's.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

from ..config import SamplingParams
from ..llm import DTYPES, LLM, read_prompts_file
from ..runner import ModelRunner
from .acceptance import BUILTIN_PROMPTS
from .rows import DEFAULT_PROMPTS

PIECES = (("qkv_in", "self_attn.qkv_proj", "input"), ("qkv", "self_attn.qkv_proj", "output"),
          ("attention", "self_attn.o_proj", "input"), ("o_proj", "self_attn.o_proj", "output"),
          ("gate_up", "mlp.gate_up_proj", "output"), ("down", "mlp.down_proj", "output"))


class UnrecordedRunner(ModelRunner):
    """The model runner with its padded static steps run eagerly, unrecorded (`StepGraphs.record`
    off): Python hooks then see the fast path's every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.graphs is not None:
            self.graphs.record = False


def dense_rows(positions: list[int], ctx) -> dict[int, tuple[int, int]]:
    """A forward's rows that attend densely -> {token row: (position, query rows of its request)}.
    The query rows tell decode rows (1) from verification rows (k + 1); padding rows (not valid)
    and sparse drafts (not in the dense batch) are left out."""
    if ctx is None or ctx.dense is None:
        return {}
    found = {}
    for indices, valid in zip(ctx.dense.q_index.tolist(), ctx.dense.q_valid.tolist()):
        found.update({i: (positions[i], sum(valid)) for i, ok in zip(indices, valid) if ok})
    return found


def record_rows(llm: LLM, prompt: str | list[int], params: SamplingParams
                ) -> tuple[list[int], dict]:
    """Generate for `prompt` (text or token ids) alone, keeping each forward's dense rows ->
    (token ids, {(piece, position, query rows of its request): row}) (`dense_rows`)."""
    rows, forward, hooks = {}, {}, []

    def keep(name, tensor):
        for i, (position, queries) in forward["rows"].items():
            rows[name, position, queries] = tensor[i].detach().clone()

    def start(module, args):
        forward["rows"] = dense_rows(args[1].tolist(), args[2] if len(args) > 2 else None)
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
        if isinstance(prompt, str):
            return llm.generate(prompt, params)[0].token_ids, rows
        return llm.generate(None, params, prompt_token_ids=[prompt])[0].token_ids, rows
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


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_rows(args, options: dict) -> None:
    """Per verification row: the first piece whose bits differ from the decode row's."""
    options = dict(options, runner_class=UnrecordedRunner)
    plain = LLM(args.model, method="plain", **options)
    spec = LLM(args.model, method=args.methods[0], batch_policy="naive", **options)
    order = pieces_in_order(plain.model.config.num_layers)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    total, identical = Counter(), 0
    for prompt in BUILTIN_PROMPTS[:args.prompts]:
        plain_tokens, plain_rows = record_rows(plain, prompt, params)
        spec_tokens, spec_rows = record_rows(spec, prompt, params)
        identical += plain_tokens == spec_tokens
        total.update(compare(plain_rows, spec_rows, order))
    path = ", cuda_graphs" * args.cuda_graphs + ", compile" * args.compile
    print(f"{args.methods[0]}, {args.dtype}, {args.device}{path}: {identical} / {args.prompts} "
          f"outputs identical to plain decoding; {total[None]} / {sum(total.values())} "
          f"verification rows bit-identical to their decode rows")
    for piece, count in total.most_common():
        if piece is not None:
            print(f"  first difference in {piece}: {count} rows")


def check_outputs(args, options: dict) -> None:
    """Whole generations of a batch: every drafter x batching against plain decoding."""
    prompts = read_prompts_file(str(DEFAULT_PROMPTS)) + BUILTIN_PROMPTS
    prompts = [prompts[i % len(prompts)] for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    plain = [o.token_ids for o in LLM(args.model, method="plain", **options).generate(prompts,
                                                                                       params)]
    print(f"{args.dtype}, {args.device}, cuda_graphs={args.cuda_graphs}, compile={args.compile}, "
          f"exact={args.exact}: "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy")
    print("| method | batching | identical to plain | mean / min common prefix |")
    print("|---|---|---|---|")
    for method in args.methods:
        for batching, policy, delayed in (("naive", "naive", False),
                                          ("balanced + delayed", "balanced", True)):
            llm = LLM(args.model, method=method, batch_policy=policy, async_verify=delayed,
                      **options)
            outputs = [o.token_ids for o in llm.generate(prompts, params)]
            prefixes = [common_prefix(a, b) for a, b in zip(outputs, plain)]
            same = sum(a == b for a, b in zip(outputs, plain))
            print(f"| {method} | {batching} | {same} / {len(prompts)} | "
                  f"{sum(prefixes) / len(prefixes):.0f} / {min(prefixes)} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="embedded (default), a .gguf or HF dir")
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--methods", default="pillar-lookup",
                        help="comma-separated drafters (per-row mode: the first)")
    parser.add_argument("--prompts", type=int, default=2, help="how many prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--outputs", action="store_true",
                        help="compare whole generations of a batch instead of rows")
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--exact", action="store_true", help="the paged kernel's exact rows")
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    options = dict(device=args.device, dtype=args.dtype, gguf=args.gguf,
                   cuda_graphs=args.cuda_graphs, compile=args.compile, exact=args.exact)
    (check_outputs if args.outputs else check_rows)(args, options)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
