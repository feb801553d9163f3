"""Reference solution of exercise 5 (the offload victim policy)."""
from tutorials.exercises.ex5_offload_victim import Candidate


def pick_victim(running: list[Candidate]) -> int | None:
    if len(running) <= 1 or sum(c.scheduled for c in running) <= 1:
        return None
    movable = [c for c in running if c.scheduled and not c.awaiting_result]
    return max(movable, key=lambda c: c.admitted_at).seq_id if movable else None
