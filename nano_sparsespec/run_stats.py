"""What one run did, step by step: `RunStats` (the engine loop fills it), the acceptance summary
of a run or a request, and the KV positions a step's attention reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .scheduler import Work


@dataclass
class RunStats:
    """What one `generate` call did, step by step."""
    seconds: float = 0.0
    output_tokens: int = 0
    steps: int = 0
    tokens_per_step: list[int] = field(default_factory=list)        # through the linear layers
    kv_positions_per_step: list[int] = field(default_factory=list)  # its attention reads
    verifications_per_step: list[int] = field(default_factory=list)
    drafts_per_step: list[int] = field(default_factory=list)
    # per verification with drafts: accepted drafts, drafts checked, verified context length
    accepted_counts: list[int] = field(default_factory=list)
    drafts_offered: list[int] = field(default_factory=list)
    verify_contexts: list[int] = field(default_factory=list)
    offloads: int = 0
    restores: int = 0
    graphs_recorded: int = 0                  # CUDA graphs recorded (cuda_graphs=True)
    graph_record_seconds: float = 0.0         # ... and the wall time that took (in `seconds`)
    graph_record_compile_seconds: float = 0.0  # ... of which torch.compile compiled
    # the host's share of `seconds`, by phase of the loop: choosing the works, launching their
    # step (graph recording included; of that, queuing its device work), processing a step's
    # results (of that, waiting for them, and the new selections and their draft buffers)
    schedule_seconds: float = 0.0
    launch_seconds: float = 0.0
    queue_seconds: float = 0.0
    process_seconds: float = 0.0
    result_wait_seconds: float = 0.0
    selection_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def summary(self, stride: int) -> dict:
        return {"output_tokens": self.output_tokens, "seconds": round(self.seconds, 3),
                "tokens_per_second": round(self.tokens_per_second, 2), "steps": self.steps,
                "offloads": self.offloads, "restores": self.restores,
                **acceptance_summary(self.accepted_counts, self.drafts_offered, stride)}


def acceptance_summary(accepted: list[int], offered: list[int], stride: int) -> dict:
    """Mean accepted drafts per verification, histogram of accepted counts, acceptance rate per
    draft position; empty when no verification checked a draft (plain decoding)."""
    if not offered:
        return {}
    histogram = [0] * (stride + 1)
    reached = [0] * stride          # verifications that offered a draft at position j
    taken = [0] * stride            # ... and accepted it
    for a, m in zip(accepted, offered):
        histogram[a] += 1
        for j in range(m):
            reached[j] += 1
            taken[j] += j < a
    return {"verifications": len(offered),
            "mean_accepted": round(sum(accepted) / len(offered), 3),
            "mean_offered": round(sum(offered) / len(offered), 3),
            "tokens_per_verification": round(1 + sum(accepted) / len(offered), 3),
            "accepted_histogram": histogram,
            "acceptance_by_position": [round(t / r, 3) if r else None
                                       for t, r in zip(taken, reached)]}


def kv_positions_read(works: list[Work], selection_len: list[int], method: str) -> int:
    """KV positions one step reads, summed over requests: a dense work (prefill chunk,
    verification, plain decode, `full` drafts) reads its context up to its last query token once
    for all its query tokens; a sparse draft reads its selected positions plus those written
    since the last verification (a draft ahead: as if none of the drafts in flight is accepted)."""
    sparse = method != "full"    # (below, len(tokens) - 1 is `Sequence.num_verified`, inlined)
    return sum(selection_len[w.seq.row] + w.start - len(w.seq.tokens) + 2
               if sparse and w.kind == "draft" else w.start + w.num_tokens for w in works)
