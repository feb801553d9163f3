"""Exercise 5: the offload victim policy of the dynamic KV cache.

When the next step's new KV does not fit the device pool, one whole request moves to the host pool (tutorial 05).
Which one? The scheduler picks the most recently admitted request (the one that has made the least progress, and
that would have waited had the pool been full when it arrived) among those that have work in this step and no result
in flight: a request whose verification result has not been processed yet must stay, because processing it will
touch its KV (roll back rejected drafts). It never offloads the last running request (the step must make progress).

Check your answer: python -m tutorials.check 5
(reference: the victims nano_sparsespec.scheduler.Scheduler.schedule really offloads)
"""
from dataclasses import dataclass


@dataclass
class Candidate:
    seq_id: int
    admitted_at: int          # admission order: larger = admitted later
    awaiting_result: bool     # a verification (or last prefill chunk) of it is still in flight
    scheduled: bool           # it has work (prefill chunk, draft or verification) in the step being planned


def pick_victim(running: list[Candidate]) -> int | None:
    """The seq_id of the request to offload, or None when no request may leave.

    running: every request holding the device (prefilling or decoding), in no particular order.
    None when at most one request is running or at most one is scheduled; otherwise the most recently admitted
    request that is scheduled and has no result in flight (None if there is no such request).
    """
    raise NotImplementedError("exercise 5: write pick_victim")
