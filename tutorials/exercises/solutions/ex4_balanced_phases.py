"""Reference solution of exercise 4 (the balanced phase clock)."""


def period(stride: int, async_verify: bool) -> int:
    return stride + 1 + (1 if async_verify else 0)


def choose_slot(live_slots: list[int], period: int) -> int:
    load = [0] * period
    for s in live_slots:
        load[s] += 1
    return min(range(period), key=lambda s: (load[s], s))


def action(step: int, slot: int, period: int, awaiting_result: bool) -> str:
    if awaiting_result:
        return "stall"
    return "verify" if (step - slot) % period == 0 else "draft"
