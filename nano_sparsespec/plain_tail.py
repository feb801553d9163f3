"""When drafting stops paying: the decoding requests that decode plainly near a run's end.

A speculating request makes at most accepted + 1 tokens a cycle of k + 1 steps (k + 2 delayed),
fewer than one a step; plain decoding makes one. So near a run's end, with no request waiting or
offloaded, two rules mark requests to decode plainly (`Sequence.decodes_plainly`): each then
verifies its pending drafts and decodes one token every step, running ahead on the token in flight
like plain decoding (`Scheduler.action`).

- Plain tail: once the decoding requests fall below `SpecConfig.plain_tail` of the most that decoded
  together, all of them. A step over so few requests costs about its floor, which drafts cannot
  undercut.
- Catch-up: before that, once a period, each request that, even decoding plainly from now on,
  would finish after the batch's `SpecConfig.finish_quantile` request (each projected at the rate
  it has made tokens). The least accepting requests would otherwise finish far behind the bulk,
  alone in steps that cost about the floor; plainly they finish with it, at a higher cost a token.

The tokens a request has left are counted to its `token_limit` (max_new_tokens or the context end):
a request that ends early on EOS may switch early. Output is the same either way.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import SpecConfig

if TYPE_CHECKING:                      # (the scheduler imports this module)
    from .scheduler import Sequence

MEASURED_PERIODS = 4      # periods a request decodes before its rate counts for the catch-up


def mark_plain(decoding: list[Sequence], most_decoding: int, spec: SpecConfig, step: int,
               period: int) -> list[Sequence]:
    """Mark the requests of `decoding` (those decoding at `step`, none waiting or offloaded) that
    decode plainly from now on, by the plain tail and, on the first step of a period, the
    catch-up; return those newly marked."""
    if len(decoding) < spec.plain_tail * most_decoding:
        chosen = decoding
    elif spec.finish_quantile < 1 and step % period == 0:
        measured = [s for s in decoding if step - s.decoding_since >= MEASURED_PERIODS * period]
        steps = sorted(steps_to_finish(s, step) for s in measured)
        if not steps:
            return []
        deadline = steps[int(spec.finish_quantile * (len(steps) - 1))]    # the bulk's end
        chosen = [s for s in measured if tokens_left(s) >= deadline]
    else:
        return []
    newly = [s for s in chosen if not s.decodes_plainly]
    for seq in newly:
        seq.decodes_plainly = True
    return newly


def tokens_left(seq: Sequence) -> int:
    """Tokens `seq` may still take."""
    return seq.token_limit - len(seq.tokens)


def steps_to_finish(seq: Sequence, step: int) -> float:
    """Steps `seq` needs for its tokens left at the rate it has made tokens since its prefill
    (one a step once it decodes plainly)."""
    if seq.decodes_plainly:
        return tokens_left(seq)
    made = seq.num_output - 1                       # (its first token came from its prefill)
    return tokens_left(seq) * (step - seq.decoding_since) / max(made, 0.5)
