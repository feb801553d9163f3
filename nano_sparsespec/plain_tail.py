"""When drafting stops paying: the decoding requests that decode plainly near a run's end.

A speculating request makes at most accepted + 1 tokens a cycle of k + 1 steps (k + 2 delayed),
fewer than one a step; plain decoding makes one. So near a run's end, with no request offloaded,
two rules mark requests to decode plainly (`Sequence.decodes_plainly`): each then verifies its
pending drafts and decodes one token every step, running ahead on the token in flight like plain
decoding (`Scheduler.action`).

- Plain tail: once none wait and the decoding requests fall below `SpecConfig.plain_tail` of the
  most that decoded together, all of them. A step over so few requests costs about its floor,
  which drafts cannot undercut.
- Catch-up: before that, once a period, each request whose row, even were it to decode plainly
  from now on, would free after the batch's `SpecConfig.finish_quantile` row. A row frees when its
  request ends and then the waiting requests it takes (each waiting request, in queue order, goes
  to the row that frees first); each request is projected at the rate it has made tokens, a
  waiting one at the median rate. The least accepting requests would otherwise finish far behind
  the bulk, alone in steps that cost about the floor, or hold back the queue's last requests;
  plainly they finish with the bulk, at a higher cost a token. With more requests waiting than
  decoding, every row takes a fresh request: the catch-up waits.

The tokens a request has left are counted to its `token_limit` (max_new_tokens or the context end):
a request that ends early on EOS may switch early. Output is the same either way.
"""
from __future__ import annotations

import heapq
import statistics
from typing import TYPE_CHECKING

from .config import SpecConfig

if TYPE_CHECKING:                      # (the scheduler imports this module)
    from .scheduler import Sequence

MEASURED_PERIODS = 4      # periods a request decodes before its rate counts for the catch-up


def mark_plain(decoding: list[Sequence], waiting: list[Sequence], most_decoding: int,
               spec: SpecConfig, step: int, period: int) -> list[Sequence]:
    """Mark the requests of `decoding` (those decoding at `step`, none offloaded; `waiting` in
    queue order) that decode plainly from now on, by the plain tail and, on the first step of a
    period, the catch-up; return those newly marked."""
    if not waiting and len(decoding) < spec.plain_tail * most_decoding:
        chosen = decoding
    elif spec.finish_quantile < 1 and step % period == 0 and len(waiting) <= len(decoding):
        chosen = catching_up(decoding, waiting, spec.finish_quantile, step, period)
    else:
        return []
    newly = [s for s in chosen if not s.decodes_plainly]
    for seq in newly:
        seq.decodes_plainly = True
    return newly


def catching_up(decoding: list[Sequence], waiting: list[Sequence], quantile: float, step: int,
                period: int) -> list[Sequence]:
    """The requests of `decoding`, among those measured, whose rows free after the `quantile`
    row's even were they to decode plainly from now on."""
    measured = [row for row, seq in enumerate(decoding)
                if step - seq.decoding_since >= MEASURED_PERIODS * period]
    if not measured:
        return []
    own = [steps_to_finish(seq, step) for seq in decoding]        # per row: its request's steps
    queued = [0.0] * len(decoding)                                # and its waiting requests'
    if waiting:
        drafting = [decoding[row] for row in measured if not decoding[row].decodes_plainly]
        steps_a_token = 1.0 if not drafting else \
            statistics.median(steps_a_token_so_far(seq, step) for seq in drafting)
        frees = [(steps, row) for row, steps in enumerate(own)]
        heapq.heapify(frees)
        for seq in waiting:                        # each goes to the row that frees first
            steps, row = heapq.heappop(frees)
            fresh = tokens_left(seq) * steps_a_token
            queued[row] += fresh
            heapq.heappush(frees, (steps + fresh, row))
    frees_at = sorted(own[row] + queued[row] for row in measured)
    deadline = frees_at[int(quantile * (len(frees_at) - 1))]     # the bulk's rows free by then
    return [decoding[row] for row in measured
            if tokens_left(decoding[row]) + queued[row] >= deadline]


def tokens_left(seq: Sequence) -> int:
    """Tokens `seq` may still take."""
    return seq.token_limit - len(seq.tokens)


def steps_to_finish(seq: Sequence, step: int) -> float:
    """Steps `seq` needs for its tokens left at the rate it has made tokens since its prefill
    (one a step once it decodes plainly)."""
    if seq.decodes_plainly:
        return tokens_left(seq)
    return tokens_left(seq) * steps_a_token_so_far(seq, step)


def steps_a_token_so_far(seq: Sequence, step: int) -> float:
    """Steps `seq` has taken a token since its prefill."""
    made = seq.num_output - 1                       # (its first token came from its prefill)
    return (step - seq.decoding_since) / max(made, 0.5)
