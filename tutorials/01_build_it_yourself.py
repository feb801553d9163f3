"""Tutorial 01: build it yourself: sparse self-speculative decoding of one request in plain torch.

    python -m tutorials.01_build_it_yourself            # about a minute on a laptop CPU
    python -m tutorials.01_build_it_yourself --quick    # seconds, tiny random model

The whole algorithm, written out over `model.py`'s modules (embedding, each layer's norm, qkv projection, RoPE,
o_proj and MLP, final norm, LM head). Every later tutorial's engine call is this, batched and paged.

1. A dense KV cache (per layer, K and V [n_kv, T, D]) and `forward`, which appends new tokens' K/V and returns
   logits and attention probabilities; checked against the package's cache-free `full_logits` and its engine.
2. Naive self-speculation: k drafts (one forward each), then ONE verification forward over the pending token and
   the k drafts. Greedy verification keeps the longest prefix of drafts equal to the target's argmax, then the
   target's own token. Dense drafts are never wrong and save nothing: each one costs a full step.
3. Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept x ~ q with probability min(1, p(x)/q(x)),
   else sample normalize(max(0, p - q)). Over many seeded trials the output matches p by a chi-square test,
   although the drafts come from a very different q (the raw drafts fail the same test).
4. Sparse drafts (PillarAttn, the paper's drafter): the verification's attention probabilities, averaged over its
   rows and each KV head's query heads, rank the context; each (layer, KV head) keeps its top-B positions and the
   next k drafts attend to those plus the tokens written since. The drafts' approximate K/V is dropped and
   recomputed by the verification, so greedy output equals plain decoding token for token (asserted); acceptance
   falls below k. With T > 0 the same loop verifies by rejection sampling.

With the embedded model (k = 8, B = 16 of ~270 positions) one run gave 2.1 of 8 drafts accepted (T = 0.8: 2.6),
the engine's `method="pillar"` 2.3, and a chi-square p-value of 0.89 for rejection sampling (raw drafts: 0).
Plot: tutorials/out/01_rejection_sampling.png, the histogram of p, q and the output.

Next: tutorial 02 runs the same loop through the engine, with a StreamingLLM window as the drafter.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a file: put the repository root on the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import math

import torch

from nano_sparsespec import SamplingParams
from nano_sparsespec.model import apply_rope

from tutorials._common import PROMPT, load_llm, parser, save_plot, section, start, table, with_spec


class DenseKV:
    """One request's KV cache: per layer, K and V of every position so far, [n_kv, T, D] each."""

    def __init__(self, model):
        c = model.config
        empty = model.embed_tokens.weight.new_zeros(c.num_kv_heads, 0, c.head_dim)
        self.k, self.v = [empty] * c.num_layers, [empty] * c.num_layers

    def __len__(self) -> int:
        return self.k[0].shape[1]

    def truncate(self, length: int) -> None:   # forget positions >= length: rejected drafts, approximate K/V
        self.k, self.v = [k[:, :length] for k in self.k], [v[:, :length] for v in self.v]


def attend(q, k, v, q_pos, k_pos):
    """q [n_heads, T, D]; k, v [n_kv, S, D]; q_pos [T]; k_pos [n_kv, S] (which position each key holds)
    -> out [n_heads, T, D], probs [n_kv, G, T, S]: each query sees keys at or before its own position."""
    n_kv, S, D = k.shape
    q = q.view(n_kv, -1, q.shape[1], D)                                     # [n_kv, G, T, D]: GQA groups
    logits = q @ k.transpose(1, 2)[:, None] * D ** -0.5                     # [n_kv, G, T, S]
    logits = logits.masked_fill(k_pos[:, None, None, :] > q_pos[:, None], float("-inf"))
    probs = logits.softmax(-1)
    return (probs @ v[:, None]).flatten(0, 1), probs


@torch.inference_mode()
def forward(model, cache: DenseKV, tokens: list[int], select=None, verified: int = 0):
    """Run `tokens` (the positions after the cache's) through the model; append their K/V to the cache.
    select=None: dense attention. Else, per layer, [n_kv, B] positions below `verified` that each KV head's
    queries may see, plus every position from `verified` on (the tokens written since the verification).
    -> logits [T, vocab], attention probs per layer [n_kv, G, T, S]."""
    T, start = len(tokens), len(cache)
    pos = torch.arange(start, start + T)
    cos, sin = model.rope(pos)
    x = model.embed_tokens(torch.tensor(tokens))                            # [T, hidden]
    all_probs = []
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        qkv = a.qkv_proj(layer.input_layernorm(x)).view(T, a.n_heads + 2 * a.n_kv, a.head_dim)
        q, k, v = qkv.split([a.n_heads, a.n_kv, a.n_kv], dim=1)              # [T, heads, D]
        if a.q_norm is not None:                                            # Qwen3; Llama has none
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.k[i] = K = torch.cat([cache.k[i], k.transpose(0, 1)], dim=1)  # [n_kv, S, D]: append
        cache.v[i] = V = torch.cat([cache.v[i], v.transpose(0, 1)], dim=1)
        k_pos = torch.arange(K.shape[1]).expand(a.n_kv, -1)                 # [n_kv, S]
        if select is not None:                                              # sparse: a gather per KV head
            k_pos = torch.cat([select[i], k_pos[:, verified:]], dim=1)      # [n_kv, B + window]
            idx = k_pos[..., None].expand(-1, -1, a.head_dim)
            K, V = K.gather(1, idx), V.gather(1, idx)
        out, probs = attend(q.transpose(0, 1), K, V, pos, k_pos)
        all_probs.append(probs)
        x = x + a.o_proj(out.transpose(0, 1).reshape(T, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.logits(model.norm(x)), all_probs


def verify_greedy(logits, drafts):
    """logits [k+1, vocab] of the verification rows -> (accepted drafts, the target's own next token)."""
    target = logits.argmax(-1).tolist()                     # target[j]: what the target writes after row j
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n, target[n]                                     # a correction, or the bonus token if n == k


def verify_sampled(p, q, drafts, gen):
    """p [k+1, V] target probs, q [k, V] draft probs -> (accepted drafts, next token): lossless."""
    for j, x in enumerate(drafts):
        if torch.rand((), generator=gen) * q[j, x] >= p[j, x]:           # accepted w.p. min(1, p(x)/q(x))
            residual = (p[j] - q[j]).clamp_min(0)
            return j, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=gen))  # all accepted: a bonus token


def select_top_b(probs, context: int, budget: int):
    """PillarAttn: per layer [n_kv, G, rows, S] -> [n_kv, B] top positions below `context`, by the attention
    probability averaged over the verification's rows and each KV head's query heads."""
    return [p.mean(dim=(1, 2))[:, :context].topk(min(budget, context), dim=-1).indices for p in probs]


def speculate(model, prompt, new_tokens, k, budget=None, temperature=0.0, seed=0):
    """Self-speculative decoding of one request: -> (tokens, [(accepted, offered) per verification])."""
    gen = torch.Generator().manual_seed(seed)
    dist = lambda logits: (logits / temperature).softmax(-1)              # noqa: E731
    pick = lambda logits: int(logits.argmax()) if temperature == 0 else \
        int(torch.multinomial(dist(logits), 1, generator=gen))           # noqa: E731
    cache = DenseKV(model)
    logits, probs = forward(model, cache, prompt)
    out, accepted = [pick(logits[-1])], []
    select = select_top_b([p[:, :, -1:] for p in probs], len(cache), budget) if budget else None
    while len(out) < new_tokens:
        verified = len(cache)                               # exact K/V below; out[-1] is pending, not cached
        drafts, q = [], []
        for _ in range(min(k, new_tokens - len(out))):      # k drafts: sparse (or dense) single-token steps
            logits, _ = forward(model, cache, [drafts[-1] if drafts else out[-1]], select, verified)
            drafts.append(pick(logits[-1]))
            q.append(dist(logits[-1]) if temperature else None)
        cache.truncate(verified)                            # the drafts' K/V were approximate: drop them
        logits, probs = forward(model, cache, [out[-1]] + drafts)           # ONE dense step, k + 1 rows
        n, nxt = verify_greedy(logits, drafts) if temperature == 0 else \
            verify_sampled(dist(logits), torch.stack(q), drafts, gen)
        cache.truncate(verified + 1 + n)                    # keep the pending token and the accepted drafts
        out += drafts[:n] + [nxt]
        accepted.append((n, len(drafts)))
        if budget:                                          # the verification's attention picks the next B
            select = select_top_b(probs, len(cache), budget)
    return out[:new_tokens], accepted


def chi_square_pvalue(stat: float, df: int) -> float:
    """P(chi2 with df degrees of freedom > stat) = Q(df/2, stat/2), the regularized upper gamma function: from
    Q(1/2, z) = erfc(sqrt z) or Q(1, z) = exp(-z), step up by Q(a + 1, z) = Q(a, z) + z^a exp(-z) / Gamma(a + 1)."""
    z = stat / 2
    if z <= 0:
        return 1.0
    a, tail = (0.5, math.erfc(math.sqrt(z))) if df % 2 else (1.0, math.exp(-z))
    while a < df / 2:
        tail += math.exp(a * math.log(z) - z - math.lgamma(a + 1))
        a += 1
    return tail


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    start(args, "Tutorial 01: build it yourself")
    llm = load_llm(args)
    model, ids = llm.model, llm.encode(PROMPT)
    new_tokens, k, budget, trials = (16, 4, 8, 4000) if args.quick else (48, 8, 16, 20000)

    section("1. A dense KV cache over model.py's modules, and plain greedy decoding")
    logits, _ = forward(model, DenseKV(model), ids)
    print(f"prompt: {len(ids)} tokens; our forward vs the package's full_logits: largest difference "
          f"{(logits - model.full_logits(torch.tensor(ids))).abs().max():.1e}")
    plain, cache, steps = [], DenseKV(model), []
    logits, _ = forward(model, cache, ids)
    while len(plain) < new_tokens:
        steps.append(logits[-1].softmax(-1))                # the target's next-token distribution, kept for 3.
        plain.append(int(steps[-1].argmax()))
        logits, _ = forward(model, cache, plain[-1:])
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine = with_spec(llm, method="plain").generate(None, params, prompt_token_ids=[ids])[0]
    print(f"{new_tokens} tokens in {new_tokens} forwards; same as the engine's plain decoding: "
          f"{plain == engine.token_ids}\ntext: {llm.decode(plain)[:120]!r}")

    section(f"2. Naive self-speculation: k = {k} dense drafts, one verification, greedy")
    naive, acc = speculate(model, ids, new_tokens, k)
    assert naive == plain, "greedy speculation changed the output"
    print(f"{len(acc)} verifications, {sum(n for n, _ in acc)} of {sum(o for _, o in acc)} drafts accepted, "
          f"{sum(o + 1 for _, o in acc)} forwards after the prompt's for {new_tokens} tokens: no forward saved, and "
          f"each draft read all weights and all K/V, like a plain step")

    section("3. Rejection sampling keeps the target distribution (8 tokens of the model's next-token distribution)")
    slices = [d.topk(8).values / d.topk(8).values.sum() for d in steps]    # each step's 8 likeliest, renormalised
    p = max(slices, key=lambda s: float(s.min()))           # the target: the step where the model hesitates most
    q = torch.tensor([0.02, 0.03, 0.05, 0.1, 0.1, 0.2, 0.2, 0.3])    # a poor drafter, most mass on p's tail
    gen, counts, raw = torch.Generator().manual_seed(0), torch.zeros(8), torch.zeros(8)
    for _ in range(trials):
        x = int(torch.multinomial(q, 1, generator=gen))
        n, nxt = verify_sampled(torch.stack([p, p]), q[None], [x], gen)
        counts[x if n else nxt] += 1
        raw[x] += 1
    tests = {}
    assert trials * p.min() >= 5, "too few trials for a chi-square test (expected counts below 5)"
    for name, c in (("rejection sampling", counts), ("raw drafts", raw)):
        stat = float(((c - trials * p) ** 2 / (trials * p)).sum())
        tests[name] = (stat, chi_square_pvalue(stat, 7))
    table(["token", "p (target)", "q (draft)", "rejection sampling", "raw drafts"],
          [[i, float(p[i]), float(q[i]), float(counts[i] / trials), float(raw[i] / trials)] for i in range(8)])
    for name, (stat, pval) in tests.items():
        print(f"{name}: chi-square {stat:.1f} on 7 df, p-value {pval:.3g} "
              f"({'matches' if pval > 0.01 else 'differs from'} the target)")
    assert tests["rejection sampling"][1] > 0.01 > tests["raw drafts"][1]
    print(f"chi-square test passes: {tests['rejection sampling'][1] > 0.01}")

    section(f"4. Sparse drafts: each (layer, KV head) attends to its top-{budget} positions + the new tokens")
    sparse, acc = speculate(model, ids, new_tokens, k, budget)
    assert sparse == plain, "sparse greedy speculation changed the output"
    rate = sum(n for n, _ in acc) / len(acc)
    print(f"{len(acc)} verifications, {rate:.2f} of {k} drafts accepted per verification, "
          f"{sum(o + 1 for _, o in acc)} forwards; each draft reads {budget} of ~{len(ids) + new_tokens // 2} "
          f"positions per KV head, plus the tokens since the verification")
    print(f"greedy speculative output equals plain greedy output, token for token: {sparse == plain}")
    _, sampled = speculate(model, ids, new_tokens, k, budget, temperature=0.8)
    print(f"T = 0.8 with rejection sampling: {sum(n for n, _ in sampled) / len(sampled):.2f} drafts accepted per "
          f"verification")
    with_spec(llm, method="pillar", stride=k, min_budget=budget, budget_ratio=0.01, batch_policy="naive",
              keep_accepted=False)                  # PillarAttn alone, as written above
    got = llm.generate(None, params, prompt_token_ids=[ids])[0]
    print(f"the engine (method='pillar', k={k}, budget {budget}): same tokens {got.token_ids == plain}, "
          f"{llm.last_stats.summary(k)['mean_accepted']} accepted per verification")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        width, x = 0.27, torch.arange(8)
        ax.bar(x - width, p, width, label="target p")
        ax.bar(x, q, width, label="draft q")
        ax.bar(x + width, counts / trials, width, label=f"rejection sampling ({trials:,} trials)")
        ax.set(xlabel="token (8 most likely of the model's next token)", ylabel="probability",
               title=f"output matches p: chi-square {tests['rejection sampling'][0]:.1f}, "
                     f"p-value {tests['rejection sampling'][1]:.2f} (raw drafts: {tests['raw drafts'][0]:.0f})")
        ax.legend(fontsize=8)

    save_plot(args, "01_rejection_sampling", draw)


if __name__ == "__main__":
    main()
