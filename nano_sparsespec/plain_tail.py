"""When drafting stops paying: the decoding requests that decode plainly near a run's end.

A speculating request makes at most accepted + 1 tokens a cycle of k + 1 steps (k + 2 delayed),
fewer than one a step; plain decoding makes one. So near a run's end, with no request offloaded,
two rules mark requests to decode plainly (`Sequence.decodes_plainly`): each then verifies its
pending drafts and decodes one token every step, running ahead on the token in flight like plain
decoding (`Scheduler.action`).

- Plain tail: once none wait and the decoding requests fall below `SpecConfig.plain_tail` of the
  most that decoded together, all of them. A step over so few requests costs about its floor,
  which drafts cannot undercut.
- Catch-up: before that, once none wait, once a period, each request that, even were it to decode
  plainly from now on, would end after the batch's `SpecConfig.finish_quantile` request (each
  projected at the rate it has made tokens). The least accepting requests would otherwise finish
  far behind the bulk, alone in steps that cost about the floor; plainly they finish with the bulk,
  at a higher cost a token. While requests wait, a slow row only takes fewer of them (each goes to
  the row that frees first), and a request marked then would read its whole context every step for
  the rest of its life: the catch-up waits for the last requests.

The tokens a request has left are counted to its `token_limit` (max_new_tokens or the context end):
a request that ends early on EOS may switch early. Output is the same either way.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import SpecConfig

if TYPE_CHECKING:                      # (the scheduler imports this module)
    from .scheduler import Sequence

MEASURED_PERIODS = 4      # periods a request decodes before its rate counts for the catch-up


def mark_plain(decoding: list[Sequence], waiting: list[Sequence], most_decoding: int,
               spec: SpecConfig, step: int, period: int) -> list[Sequence]:
    """Mark the requests of `decoding` (those decoding at `step`, none offloaded) that decode
    plainly from now on, by the plain tail and, once none are `waiting`, on the first step of a
    period, the catch-up; return those newly marked."""
    if waiting:
        return []
    if len(decoding) < spec.plain_tail * most_decoding:
        chosen = decoding
    elif spec.finish_quantile < 1 and step % period == 0:
        chosen = catching_up(decoding, spec.finish_quantile, step, period)
    else:
        return []
    newly = [s for s in chosen if not s.decodes_plainly]
    for seq in newly:
        seq.decodes_plainly = True
    return newly


def catching_up(decoding: list[Sequence], quantile: float, step: int,
                period: int) -> list[Sequence]:
    """The requests of `decoding`, among those measured, that end after the `quantile` one's
    projected end even were they to decode plainly from now on."""
    measured = [seq for seq in decoding
                if step - seq.decoding_since >= MEASURED_PERIODS * period]
    if not measured:
        return []
    ends = sorted(steps_to_finish(seq, step) for seq in measured)
    deadline = ends[int(quantile * (len(ends) - 1))]           # the bulk ends by then
    return [seq for seq in measured if tokens_left(seq) >= deadline]


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
