"""PillarAttn, the paper's idea: the verification's attention chooses what the next drafts attend
to.

A verification step runs full attention for k + 1 query rows of a request anyway. Averaging those
rows' attention probabilities (and the query heads of each GQA group) gives, per layer and KV
head, a score for every position of the context; the top-B positions are the *critical* ones.
They form vertical pillars in the attention map: positions that many consecutive queries attend
to, so the next k draft queries probably attend to them too. Drafts then attend only to those B
positions plus the tokens written since the verification (attention.py), and the next
verification picks again.

Owns
  * the scores: `attention_logits` / `attention_probs` (explicit float32, grouped by KV head),
    `weighted_scores` and `pillar_scores`;
  * the selection policies: `select_pillar` (top-B of the scores; B = `SpecConfig.budget`; for a
    whole batch at once `top_positions`, which ranks `selection_keys` (`_kernels`: the fast path
    compiles them), and `for_every_layer` when only some layers score) and
    `select_streaming` (StreamingLLM: sinks + most recent, the baseline); `stacked` batches
    per-request selections;
  * re-ranking a selection within its budget: `kept_beside` (by rank, or by ring column:
    `ring_ranks`), `merge_ranked`, `keep_first` (through `_kernels`, as `top_positions`).
The first cycle after prefill has no verification yet: its scores come from the prompt's last row.

Must not know about scheduling, sampling or the KV cache's layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .device import Packed


def attention_logits(q, k, mask):
    """Scaled float32 attention logits, grouped by KV head, -inf where masked: q [B, Q, n_heads, D],
    k [B, L, n_kv, D], mask [B, Q, L] bool -> [B, n_kv, G, Q, L] (G query heads per KV head).
    One matmul per KV head reads that head's keys where they lie (no head-major copy of k)."""
    B, Q, H, D = q.shape
    n_kv = k.shape[2]
    # [B, n_kv, G, Q, D]
    scaled = (q * D ** -0.5).view(B, Q, n_kv, H // n_kv, D).permute(0, 2, 3, 1, 4)
    packed = scaled.reshape(B, n_kv, -1, D)                                # [B, n_kv, G*Q, D]
    logits = torch.stack([torch.bmm(packed[:, h], k[:, :, h].transpose(1, 2))
                          for h in range(n_kv)], dim=1)
    logits = logits.float().view(B, n_kv, H // n_kv, Q, -1)                # [B, n_kv, G, Q, L]
    return logits.masked_fill(~mask[:, None, None], float("-inf"))


def attention_probs(q, k, mask):
    """Explicit float32 attention probabilities: arguments and result as `attention_logits`."""
    return attention_logits(q, k, mask).softmax(dim=-1)


def weighted_scores(probs, score_weight):
    """probs [B, n_kv, G, Q, L], score_weight [B, Q] -> scores [B, n_kv, L]: the rows weighted
    and summed, the G query heads of each KV head averaged."""
    weight = score_weight.float()[:, None, None, :, None] / probs.shape[2]         # [B, 1, 1, Q, 1]
    return (probs * weight).sum(dim=(2, 3))


def pillar_scores(q, k, mask, score_weight):
    """PillarAttn scores of the weighted query rows: `weighted_scores` of `attention_probs`."""
    return weighted_scores(attention_probs(q, k, mask), score_weight)


# A selection is a LongTensor of positions [L, n_kv, n] for one request, n <= its budget; every
# (layer, KV head) selects the same number, so selections batch without ragged padding per head.

def select_pillar(scores: torch.Tensor, context_len, budget) -> list[torch.Tensor]:
    """PillarAttn: per (layer, KV head), the top-B positions of the verification scores, best first.

    scores: [L, B, n_kv, Lmax]; context_len: B ints, the positions that stay in the cache (later
    columns are rejected drafts or padding); budget: B ints -> per request
    [L, n_kv, min(B_b, len_b)] (`top_positions`, request by request)."""
    positions, widths = top_positions(scores, context_len, budget)
    return [positions[b, ..., :w] for b, w in enumerate(widths)]


def top_positions(scores: torch.Tensor, context_len, budget,
                  rows: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """`select_pillar` for the whole batch at once: arguments as there, or the requests `rows`
    (B ints) of scores [Ls, Bs, n_kv, Lmax] (None: all) -> (positions [B, L, n_kv, N] best first,
    position 0 past each request's own, and the widths min(B_b, len_b), B ints; N the largest).
    Ties break towards the lower position, so the selection is deterministic: one top-k over int32
    keys (`selection_keys`). The counts are host ints (one upload): nothing here waits for the
    device."""
    context, budget = [int(c) for c in context_len], [int(b) for b in budget]
    Lmax, device = scores.shape[-1], scores.device
    widths = [min(b, c) for b, c in zip(budget, context)]
    lists = Packed({"context": context, "widths": widths, "rows": rows or []}, device).views()
    keys = _kernels["keys"](scores, None if rows is None else lists["rows"], lists["context"],
                            max(1, (Lmax - 1).bit_length()))                  # [L, B, n_kv, Lmax]
    N = max(widths)
    order = keys.topk(N, dim=-1).indices.transpose(0, 1)                       # [B, L, n_kv, N]
    columns = torch.arange(N, device=device)
    real = columns[None, :] < lists["widths"][:, None]                          # [B, N]
    return torch.where(real[:, None, None, :], order, 0), widths


def selection_keys(scores: torch.Tensor, rows: torch.Tensor | None, context: torch.Tensor,
                   position_bits: int) -> torch.Tensor:
    """The keys `top_positions` ranks, for the requests rows [B] (None: all) of scores
    [Ls, Bs, n_kv, Lmax], of contexts context [B] -> int32 [Ls, B, n_kv, Lmax]: a score's float32
    bits above (a non-negative float's bits order like its value; -inf past the context, whose bits
    are negative: below every score) and its position's complement in the lowest `position_bits`
    (ceil(log2 Lmax)). Those bits are taken from the score's 23-bit mantissa: scores that agree
    to 1 part in 2^(23 - position_bits) (2^-11 at Lmax 4,096) count as tied, and the lower
    position wins. 32-bit keys take half the radix passes of 64-bit ones. One elementwise pass:
    the fast path compiles it into one kernel (kernels.py)."""
    Lmax = scores.shape[-1]
    columns = torch.arange(Lmax, device=scores.device, dtype=torch.int32)
    in_context = columns[None, :] < context[:, None]                          # [B, Lmax]
    selected = scores if rows is None else scores[:, rows]                   # [Ls, B, n_kv, Lmax]
    masked = selected.float().masked_fill(~in_context[None, :, None, :], float("-inf"))
    return (masked.view(torch.int32) >> position_bits << position_bits) | (Lmax - 1 - columns)


def for_every_layer(per_scored: torch.Tensor, score_every: int, num_layers: int,
                    dim: int = 1) -> torch.Tensor:
    """The scored layers' selections [B, Ls, n_kv, N] (layers 0, n, 2n, ...: n = score_every; or
    anything else per scored layer along `dim`) -> every layer's [B, L, n_kv, N]: a layer takes
    that of the scored layer before it."""
    if score_every == 1:
        return per_scored
    return per_scored.repeat_interleave(score_every, dim=dim).narrow(dim, 0, num_layers)


def stacked(selections: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Per-request selections [L, n_kv, n_b] -> (positions [B, L, n_kv, max n_b], position 0 past
    each request's own; widths n_b), as `top_positions` returns them."""
    return joined([s[None] for s in selections]), [s.shape[-1] for s in selections]


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Batches of selections [B_i, L, n_kv, N_i] -> one [sum B_i, L, n_kv, max N_i] (padded)."""
    width = max(p.shape[-1] for p in parts)
    padded = [F.pad(p, (0, width - p.shape[-1])) if p.shape[-1] < width else p for p in parts]
    return padded[0] if len(padded) == 1 else torch.cat(padded)


def select_streaming(context_len: int, budget: int, sink_tokens: int, num_layers: int,
                     num_kv_heads: int, device=None) -> torch.Tensor:
    """StreamingLLM: the first `sink_tokens` positions plus the most recent ones, `budget` in all
    -> [L, n_kv, n]."""
    if context_len <= budget:
        positions = torch.arange(context_len, device=device)
    else:
        sinks = min(sink_tokens, budget)
        positions = torch.cat([torch.arange(sinks, device=device),
                               torch.arange(context_len - (budget - sinks), context_len,
                                            device=device)])
    return positions.expand(num_layers, num_kv_heads, -1)


def kept_beside(selection: torch.Tensor, selection_len: torch.Tensor, extra: torch.Tensor,
                extra_valid: torch.Tensor, column_rank: torch.Tensor | None = None,
                held: torch.Tensor | None = None) -> torch.Tensor:
    """Which ranked positions stay beside the valid `extra` ones, so that their number stays the
    budget: those `extra` does not hold, the lowest-ranked making room.

    selection: [B, L, n_kv, N] distinct positions best first (as `top_positions` returns them),
    the first selection_len [B] of them real; extra, extra_valid: [B, M] (the valid ones distinct)
    -> keep [B, L, n_kv, N] bool, by rank; with `column_rank` [B, >= N] (`ring_ranks`), by column
    of a ring, column c holding rank column_rank[b, c]. `held` [B, L, n_kv, N] bool: whether a
    valid extra position equals each selection entry, where the caller has it (else compared here).
    A rank r that no extra position holds stays while r < kept_len + (held ranks below r): the
    kept_len best of those not held, each rank compared with the extras once."""
    B, N = selection.shape[0], selection.shape[-1]
    rank = torch.arange(N, device=selection.device)                              # [N]
    real = rank[None, :] < selection_len[:, None]                               # [B, N]
    if held is None:   # by rank, whether a valid extra position holds it (compared [..., N, M])
        held = ((selection[..., None] == extra[:, None, None, None, :])
                & extra_valid[:, None, None, None, :]).any(-1)                 # [B, L, n_kv, N]
    held = held & real[:, None, None, :]
    # held ranks below each: [B, L, n_kv, N] (int32: a rank's count fits, in half the bytes)
    held_below = held.cumsum(-1, dtype=torch.int32) - held.int()
    if column_rank is not None:                                  # each column's rank, gathered
        rank = column_rank[:, :N]                                                    # [B, N]
        at_column = rank[:, None, None, :].expand_as(held)                      # [B, L, n_kv, N]
        held, held_below = held.gather(-1, at_column), held_below.gather(-1, at_column)
    kept_len = selection_len - extra_valid.sum(1)                               # [B]
    return (real[:, None, None, :] & ~held
            & (rank.expand(B, N)[:, None, None, :] < kept_len[:, None, None, None] + held_below))


def ring_ranks(start: torch.Tensor, width: torch.Tensor, columns: int) -> torch.Tensor:
    """The rank each of `columns` columns holds in a ring of width [B] that holds rank r at column
    (start [B] + r) mod width: (c - start) mod width, and c itself past the width -> [B, columns]
    (`attention.ring_span_writes` keeps a selection so)."""
    column = torch.arange(columns, device=start.device)                           # [columns]
    in_ring = column[None, :] < width[:, None]                                   # [B, columns]
    return torch.where(in_ring, (column - start[:, None]) % width.clamp(min=1)[:, None], column)


def merge_ranked(selection: torch.Tensor, selection_len: torch.Tensor, extra: torch.Tensor,
                 extra_valid: torch.Tensor, extra_first: bool) -> torch.Tensor:
    """One list of the `kept_beside` positions in rank order and the valid extra ones in their
    order (first, or after the kept), selection_len in all (the rest is padding).

    Arguments as `kept_beside` -> [B, L, n_kv, N]."""
    B, L, n_kv, N = selection.shape
    M = extra.shape[1]
    keep = kept_beside(selection, selection_len, extra, extra_valid)
    kept_rank = keep.cumsum(-1) - 1                                            # [B, L, n_kv, N]
    extra_rank = extra_valid.cumsum(1) - 1                                     # [B, M]
    if extra_first:
        kept_rank = kept_rank + extra_valid.sum(1)[:, None, None, None]
    else:
        extra_rank = extra_rank + (selection_len - extra_valid.sum(1))[:, None]
    extra_rank = torch.where(extra_valid & (extra_rank < selection_len[:, None]), extra_rank, N)
    merged = torch.zeros(B, L, n_kv, N + 1, dtype=selection.dtype, device=selection.device)
    merged.scatter_(-1, torch.where(keep, kept_rank, N), selection)           # N: dropped
    merged.scatter_(-1, extra_rank[:, None, None, :].expand(B, L, n_kv, M),
                    extra[:, None, None, :].expand(B, L, n_kv, M))
    return merged[..., :N]


def keep_first(selection: torch.Tensor, selection_len: torch.Tensor, keep: torch.Tensor,
               keep_valid: torch.Tensor) -> torch.Tensor:
    """A ranked selection with the valid `keep` positions (distinct, inside the context) ranked
    first, the budget unchanged: arguments and result as `merge_ranked`."""
    return _kernels["merge"](selection, selection_len, keep, keep_valid, True)


def keep_spans_first(selection: torch.Tensor, selection_len: list[int], first: list[int],
                     count: list[int]) -> torch.Tensor:
    """`keep_first` of the spans first[b] .. first[b] + count[b] - 1 (request b's), from host
    lists (one upload): selection [B, L, n_kv, N] -> [B, L, n_kv, N]."""
    spans = Packed({"first": first, "count": count, "width": selection_len},
                   selection.device).views()
    return spans_kept_first(selection, spans["width"], spans["first"], spans["count"],
                            max(count))


def spans_kept_first(selection: torch.Tensor, selection_len: torch.Tensor, first: torch.Tensor,
                     count: torch.Tensor, longest: int) -> torch.Tensor:
    """`keep_spans_first` from device tensors [B] (counts at most `longest`)."""
    j = torch.arange(longest, device=selection.device)                               # [M]
    valid = j < count[:, None]                                                         # [B, M]
    keep = torch.where(valid, first[:, None] + j, 0)
    return keep_first(selection, selection_len, keep, valid)


# what `top_positions` and `keep_first` call: the eager functions, or the fast path's compiled ones
EAGER_KERNELS = {"keys": selection_keys, "merge": merge_ranked}
_kernels = dict(EAGER_KERNELS)
