"""Exercise 4: the phase clock of the unified scheduler (balanced policy).

Every decoding request repeats a cycle: k steps that each write one draft, then one step that verifies them. With
delayed verification (tutorial 05) the verification's result is only known one step later, and the request, having
nothing to draft from, spends that step waiting for it (a *stall*): the cycle has one step more. All requests share one
global step counter, and every request owns a *verify slot* s, a position in the cycle: it verifies on global step s
and then on every step a whole number of cycles away from it (before and after), and drafts on the others. The
naive policy gives everyone slot 0: all verify on the same step. The balanced policy gives a request that finishes its
prefill the least-loaded slot, so each step carries about B / P verifications for B requests and P steps per cycle
(tutorial 04).

Check your answer: python -m tutorials.check 4
The package's scheduler adds two refinements left out here: on a tie it prefers a slot the request reaches without
waiting, and a request that holds its k drafts before its slot comes round waits for it (action 'wait'). By default
it also removes the stall (SpecConfig.draft_ahead): the request drafts ahead of the result, at the position and on
the token the device holds; the checker compares against the scheduler with the stall.
(reference: nano_sparsespec.scheduler.Scheduler: .period, .assign_slot, .action)
"""


def period(stride: int, async_verify: bool) -> int:
    """Steps per cycle (P) for stride k, with or without delayed verification."""
    raise NotImplementedError("exercise 4: write period")


def choose_slot(live_slots: list[int], period: int) -> int:
    """The slot for a request that just finished its prefill.

    live_slots: the verify slots of the other requests that are decoding (one entry per request)
    returns the slot in [0, period) held by the fewest of them; on a tie, the lowest such slot
    """
    raise NotImplementedError("exercise 4: write choose_slot")


def action(step: int, slot: int, period: int, awaiting_result: bool) -> str:
    """What a decoding request with this slot does at global step `step`: 'verify', 'draft' or 'stall'.
    awaiting_result: a verification of this request is still in flight (delayed verification)."""
    raise NotImplementedError("exercise 4: write action")
