"""Exercise 4: the phase clock of the unified scheduler (balanced policy).

Every decoding request owns a *verify slot* s in [0, P): at global step t it verifies when (t - s) % P == 0 and drafts
otherwise, so it verifies once per cycle of P = k + 1 steps (k drafts, then the verification). With delayed
verification (tutorial 04) the step after a verification is a stall, so P = k + 2, and a request whose result is
still in flight sits the step out. The naive policy gives everyone slot 0: all verify on the same step. The balanced
policy gives a request that finishes its prefill the least-loaded slot, so each step carries about B / P
verifications (tutorial 03).

Check your answer: python -m tutorials.check 4
(reference: nano_sparsespec.scheduler.Scheduler: .period, .assign_slot, .action)
"""


def period(stride: int, async_verify: bool) -> int:
    """Steps per cycle for stride k: k drafts + 1 verification (+ 1 stall step with delayed verification)."""
    raise NotImplementedError("exercise 4: write period")


def choose_slot(live_slots: list[int], period: int) -> int:
    """The slot for a request that just finished its prefill.

    live_slots: the verify slots of the other requests that are decoding (one entry per request)
    returns the slot in [0, period) that the fewest of them hold; on a tie, the lowest such slot
    """
    raise NotImplementedError("exercise 4: write choose_slot")


def action(step: int, slot: int, period: int, awaiting_result: bool) -> str:
    """What a decoding request does at global step `step`: 'stall' while a result of its own is still in flight,
    else 'verify' when step - slot is a multiple of period, else 'draft'."""
    raise NotImplementedError("exercise 4: write action")
