"""Exercise 5: the offload victim policy of the dynamic KV cache.

When the next step's new KV does not fit the device pool, one whole request moves to the host pool (tutorial 06): its
work in this step is dropped and it comes back once the pool has room. Which one should go? The scheduler's answer
follows from four concerns:

  * progress: offloading must leave the step something to do. Nobody leaves when only one request runs, or when at
    most one request has work in the step.
  * usefulness: only a request that has work in the step makes the step need more blocks; offloading one of those
    is what makes the step fit.
  * safety: a request whose result (of a verification, or of its final prefill chunk) is still in flight must stay
    on the device: processing that result touches its KV (rejected drafts are rolled back). With delayed
    verification such a request usually sits the step out, but plain decoding runs ahead and has work anyway.
    (The package's scheduler also counts a request that waits, with no work, for its verify slot: it holds KV the
    step cannot use. The cases here have none.)
  * fairness: of the requests that may go, the most recently admitted one leaves. It has made the least progress,
    and it would have waited had the pool been full when it arrived.

Check your answer: python -m tutorials.check 5
(reference: the victims nano_sparsespec.scheduler.Scheduler.schedule really offloads)
"""
from dataclasses import dataclass


@dataclass
class Candidate:
    seq_id: int
    admitted_at: int          # admission order: larger = admitted later
    awaiting_result: bool     # a verification (or final prefill chunk) of it is still in flight
    scheduled: bool           # it has work (prefill chunk, draft or verification) in the step being planned


def pick_victim(running: list[Candidate]) -> int | None:
    """The seq_id of the request to offload, or None when no request may leave.

    running: every request holding the device (prefilling or decoding), in no particular order.
    """
    raise NotImplementedError("exercise 5: write pick_victim")
