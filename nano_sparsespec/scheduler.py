"""Request state and the per-step plan: who prefills, drafts, verifies, waits, or is offloaded.

Owns `Sequence` (one request's tokens, state and acceptance statistics) and
`Scheduler.schedule(step)`: the step's `Work` list under the batch policy, admission of waiting
requests, and the offload/restore policy of the bounded KV pool.

Phase clock: a decoding request owns a verify slot s in [0, P), P = drafts_per_cycle + 1 (+1 for
the stall step of delayed verification), and verifies only on the steps t with t % P == s. After
a verification it stalls one step when delayed (its result is in flight), then drafts until it
holds k drafts (fewer near max_new_tokens or the context end: `draft_limit`) and waits, with no
work, on any step left before its slot. With `SpecConfig.drafts_ahead` there is no stall: on the
step after its verification it drafts ahead of the result (`Work.ahead`), which the device knows.
`naive` gives every request slot 0 (lock-step).
`balanced` gives a request, when its prefill's result is processed on step t, the least-loaded
slot; its first cycle may have fewer than k drafts. With delayed verification it can act from
step t + 1 on, so slot t % P would take k + 1 drafts: a request given that slot waits one step,
and on a tie in load a slot without the wait is preferred. When a decoding request finishes and
leaves its slot two below the fullest, one request of the fullest moves into it. So the loads of
the slots never differ by more than one, and with B decoding requests (none offloaded: those
keep their slot and sit out) each step verifies floor(B / P) or ceil(B / P) of them. Plain and
n-gram verify every step; with delayed verification plain decoding runs ahead instead of stalling
(`SpecConfig.runs_ahead`): two results may be in flight. With `SpecConfig.refresh_every` n, the
verifications of period step // P re-select their critical positions (`Work.reselects`) when n
divides it, and keep their selections in the n - 1 periods between.

Plain tail: near a run's end, requests for which drafting no longer pays decode plainly, one token
every step (`plain_tail`).

Offload: when a step's KV does not fit, the latest-admitted request with no result in flight moves
wholly to the host pool, keeping its phase; offloaded requests return first-out first-in once they
fit with one step of headroom, and no waiting request is admitted while one is out.

Must not run the model: it only decides, and keeps the KV cache's block bookkeeping in step.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from . import plain_tail
from .config import SamplingParams, SpecConfig
from .kv_cache import KVCache


class Status(Enum):
    """Where a request is in its life."""
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    OFFLOADED = "offloaded"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request: its tokens, its place in the phase clock and its speculation statistics.
    Compared by identity: two requests with the same tokens are two requests."""
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + output; the last is not cached
    num_prefilled: int = 0              # prompt tokens whose KV is cached
    verify_slot: int = 0
    num_drafts: int = 0                 # model drafts made since the last verification
    drafted_ahead: bool = False         # drafted while its verification's result was in flight
    decodes_plainly: bool = False       # near the run's end it drafts no more (plain_tail.py)
    decoding_since: int = 0             # the first step it could decode in (after its prefill)
    ngram_drafts: list[int] = field(default_factory=list)
    row: int = -1                       # row in the engine's per-request device buffers
    token_limit: int = 0                # tokens it may hold: final_length, which
                                        #   `Scheduler.add` caps at the model's context
    admitted_at: int = 0
    results_in_flight: int = 0          # verifications / final prefill chunk awaiting results
    finish_reason: str | None = None
    error: str | None = None
    # statistics of speculation
    accepted_counts: list[int] = field(default_factory=list)    # accepted drafts per verification
    drafts_per_verify: list[int] = field(default_factory=list)  # drafts offered per verification
    commit_log: list[tuple[int, int]] = field(default_factory=list)  # (accepted, 1) per commit
    # (greedy, filtered): all `SamplingTensors.host_flags` reads of its params, so that a step
    # finds its flags from one request of each kind (`StepLists.shape`)
    sampling_kind: tuple[bool, bool] = field(init=False, default=(False, False))

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)
        self.token_limit = self.final_length
        self.sampling_kind = (self.params.greedy, self.params.filtered)

    @property
    def num_prompt(self) -> int:
        """Prompt tokens."""
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        """Committed output tokens (a copy)."""
        return self.tokens[self.num_prompt:]

    @property
    def final_length(self) -> int:
        """Tokens it holds after all of max_new_tokens (the context end may stop it first)."""
        return self.num_prompt + self.params.max_new_tokens

    @property
    def num_output(self) -> int:
        """len(output_ids) without copying them (the per-token stop checks ask for it)."""
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def awaiting_result(self) -> bool:
        """True while a verification or final prefill chunk of it has its result in flight."""
        return self.results_in_flight > 0

    @property
    def num_verified(self) -> int:
        """Positions whose KV is exact (full attention): all tokens but the pending last one."""
        return len(self.tokens) - 1


@dataclass(eq=False, slots=True)
class Work:
    """One request's share of a step."""
    seq: Sequence
    kind: str               # "prefill" | "draft" | "verify"
    start: int              # position of the first input token
    num_tokens: int         # input tokens: prefill chunk, 1 for a draft, drafts + 1 for a verify
    # a draft made while its request's verification is in flight: it sits after the accepted
    # drafts, which only the device knows; `start` is its position if none is accepted
    ahead: bool = False
    # a verification whose scores choose its request's next selection (`SpecConfig.refresh_every`)
    reselects: bool = True

    @property
    def end(self) -> int:
        """One past the last position its K/V may take (a draft ahead: if all its request's
        checked drafts are accepted; asked while they are in flight)."""
        return self.start + self.num_tokens + (self.seq.num_drafts if self.ahead else 0)

    @property
    def final_prefill(self) -> bool:
        """True for the prefill chunk that ends the prompt."""
        return self.kind == "prefill" and self.start + self.num_tokens == self.seq.num_prompt


class Scheduler:
    """Plans each step under the batch policy and keeps the KV pool's bookkeeping in step."""

    def __init__(self, spec: SpecConfig, cache: KVCache, max_len: int):
        self.spec, self.cache, self.max_len = spec, cache, max_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []      # prefilling and decoding, in admission order
        self.offloaded: list[Sequence] = []    # in offload order
        self.free_rows = list(range(spec.max_batch))
        stalls = spec.async_verify and not (spec.runs_ahead or spec.drafts_ahead)
        self.drafts_per_cycle = spec.drafts_per_cycle          # k (0: plain and n-gram)
        self.period = self.drafts_per_cycle + 1 + stalls
        self._admissions = itertools.count()
        self.most_decoding = 0                 # the most requests that decoded in one step
        self.step = -1                         # the step last scheduled
        self.offload_events = self.restore_events = 0

    # --- requests ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq`; ValueError if even the whole pool could not hold it."""
        worst_case = min(self.max_len, seq.final_length + self.spec.stride + 1)
        need = -(-worst_case // self.cache.block_size)
        if need > self.cache.pool.num_blocks:
            raise ValueError(f"KV pool too small: request {seq.seq_id} may need {need} blocks of "
                             f"{self.cache.block_size} tokens, "
                             f"the pool has {self.cache.pool.num_blocks} (raise kv_blocks)")
        seq.token_limit = min(seq.final_length, self.max_len)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """True while any request is waiting, running or offloaded."""
        return bool(self.waiting or self.running or self.offloaded)

    def batch_growth(self) -> float:
        """How many times as many requests will decode once the prefilling and waiting ones are
        in (a run's start), 1 for a batch that is full or shrinking."""
        decoding = len(self.running) - [s.status for s in self.running].count(Status.PREFILL)
        ahead = min(self.spec.max_batch, len(self.running) + len(self.waiting))
        return ahead / decoding if decoding else 1.0

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished with `reason` and release its KV, its row and its verify slot."""
        held_slot = seq.status == Status.RUNNING and not seq.decodes_plainly
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.cache.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        self.free_rows.append(seq.row)
        if held_slot:
            self._fill_gap(seq.verify_slot)

    # --- the phase clock --------------------------------------------------------------------------
    def assign_slot(self, seq: Sequence) -> None:
        """Give `seq`, whose prefill's result is being processed, its verify slot: 0 when naive;
        when balanced the least-loaded slot, on a tie one it reaches without waiting, then the
        lowest."""
        first = seq.decoding_since = self.step + 1          # the first step it can act in
        if self.spec.batch_policy == "naive" or self.period == 1:
            seq.verify_slot = 0
            return
        load = Counter(s.verify_slot for s in self._slot_holders() if s is not seq)

        def waits(slot: int) -> bool:
            return (slot - first) % self.period > self.drafts_per_cycle

        seq.verify_slot = min(range(self.period), key=lambda s: (load[s], waits(s), s))

    def _fill_gap(self, slot: int) -> None:
        """Balanced: a request has left `slot`; if the fullest slot now holds two more, move its
        latest-admitted request into `slot`, which it reaches by drafting fewer or waiting."""
        if self.spec.batch_policy == "naive" or self.period == 1:
            return
        holders = self._slot_holders()
        load = Counter(s.verify_slot for s in holders)
        fullest = max(range(self.period), key=lambda s: (load[s], -s))
        if load[fullest] >= load[slot] + 2:
            mover = max((s for s in holders if s.verify_slot == fullest),
                        key=lambda s: s.admitted_at)
            mover.verify_slot = slot

    def _slot_holders(self) -> list[Sequence]:
        """The requests that hold a verify slot: drafting ones, also while offloaded."""
        return [s for s in self.running + self.offloaded
                if s.status != Status.PREFILL and not s.decodes_plainly]

    def action(self, seq: Sequence, step: int) -> str:
        """What a prefilled request does at global step `step`: verify, draft, wait, stall,
        ahead (decode on the token in flight) or draft ahead (of the verification in flight)."""
        if seq.results_in_flight:      # (`awaiting_result`, without a property call per request)
            # ahead of one token in flight (not of a verification's drafts), and only if that
            # token is not the request's last
            runs_ahead = self.spec.runs_ahead or (seq.decodes_plainly and seq.num_drafts == 0)
            if runs_ahead:
                return "ahead" if self.draft_limit(seq) > 0 else "stall"
            # a draft is worth making even if every checked draft is accepted
            if (self.spec.drafts_ahead and not seq.decodes_plainly
                    and self.draft_limit(seq, committing=seq.num_drafts + 1) > 0):
                return "draft ahead"
            return "stall"
        if seq.decodes_plainly or (step - seq.verify_slot) % self.period == 0:
            return "verify"
        # (k drafts made: no need to ask draft_limit, which most requests never reach)
        drafts = seq.num_drafts
        if drafts >= self.drafts_per_cycle:
            return "wait"
        return "draft" if drafts < self.draft_limit(seq) else "wait"

    def draft_limit(self, seq: Sequence, committing: int = 0) -> int:
        """Drafts worth making this cycle: at most k, no more than the tokens and context left
        (once `committing` more tokens are committed)."""
        # tokens it may still take, less the one its verification adds (most requests: k or more)
        left = seq.token_limit - 1 - len(seq.tokens) - committing
        return self.spec.stride if left >= self.spec.stride else max(left, 0)

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self, step: int) -> list[Work]:
        """This step's work, one `Work` per scheduled request, its KV slots reserved."""
        self.step = step
        self._restore_offloaded()
        self._admit()
        self._enter_plain_tail()
        works = self._plan(step)
        while not self._fits(works):
            victim = self._pick_victim(works)
            if victim is not None:
                if self.cache.length(victim.seq_id) > 0:
                    self._offload(victim)
                works = [w for w in works if w.seq is not victim]  # holding no KV: it waits
            elif any(s.awaiting_result for s in self.running):
                # the others' results (and rollbacks) are in flight: the latest admitted waits
                works.remove(max(works, key=lambda w: w.seq.admitted_at))
            else:
                raise RuntimeError(f"KV pool of {self.cache.pool.num_blocks} blocks cannot hold "
                                   f"the step even after offloading every other request")
        self.cache.reserve_each([(w.seq.seq_id, w.end) for w in works])
        for w in works:  # bookkeeping that does not depend on this step's results
            seq = w.seq
            if w.kind == "draft":
                if w.ahead:              # counted once its verification's result is in
                    seq.drafted_ahead = True
                else:
                    seq.num_drafts += 1
            elif w.kind == "verify":
                seq.results_in_flight += 1
            else:
                seq.num_prefilled += w.num_tokens
                if w.final_prefill:
                    seq.results_in_flight += 1
        return works

    def _enter_plain_tail(self) -> None:
        """Mark the decoding requests that decode plainly from now on (drafting methods only)."""
        if self.drafts_per_cycle == 0:
            return
        running = Status.RUNNING
        decoding = [s for s in self.running if s.status is running]
        self.most_decoding = max(self.most_decoding, len(decoding))
        if self.offloaded:
            return
        for seq in plain_tail.mark_plain(decoding, self.waiting, self.most_decoding, self.spec,
                                         self.step, self.period):
            self._fill_gap(seq.verify_slot)        # it verifies every step from now on

    def _plan(self, step: int) -> list[Work]:
        works, prefill_budget = [], self.spec.prefill_chunk
        ngram, prefill = self.spec.method == "ngram", Status.PREFILL   # (a local: read per request)
        reselects = step // self.period % self.spec.refresh_every == 0
        for seq in self.running:
            if seq.status is prefill:
                if prefill_budget == 0 or seq.num_prefilled == seq.num_prompt:
                    continue
                n = min(prefill_budget, seq.num_prompt - seq.num_prefilled)
                prefill_budget -= n
                works.append(Work(seq, "prefill", seq.num_prefilled, n))
                continue
            action, num_verified = self.action(seq, step), len(seq.tokens) - 1
            if action == "draft":        # most works: first
                works.append(Work(seq, "draft", num_verified + seq.num_drafts, 1))
            elif action == "verify":
                n_drafts = len(seq.ngram_drafts) if ngram else seq.num_drafts
                works.append(Work(seq, "verify", num_verified, n_drafts + 1, reselects=reselects))
            elif action == "ahead":      # the position after the one whose token is in flight
                works.append(Work(seq, "verify", num_verified + 1, 1))
            elif action == "draft ahead":
                works.append(Work(seq, "draft", num_verified + 1, 1, ahead=True))
        return works

    def _fits(self, works: list[Work]) -> bool:
        # a work of n tokens takes at most ceil(n / block) + 1 new blocks: with that many free,
        # the step fits without counting
        per_work = -(-max((w.num_tokens for w in works), default=0) // self.cache.block_size) + 1
        if len(works) * per_work <= self.cache.free_blocks():
            return True
        need = sum(self.cache.blocks_to_cover(w.seq.seq_id, w.end) for w in works)
        return need <= self.cache.free_blocks()

    def _pick_victim(self, works: list[Work]) -> Sequence | None:
        """Latest-admitted request with no result in flight that has work or waits for its slot
        (both hold KV), or None (never the last one with work)."""
        waiting = [s for s in self.running if s.status == Status.RUNNING
                   and not s.awaiting_result and all(w.seq is not s for w in works)]
        settled = [s for s in [w.seq for w in works] + waiting if not s.awaiting_result]
        if len(self.running) <= 1 or len(works) + len(waiting) <= 1 or not settled:
            return None
        return max(settled, key=lambda s: s.admitted_at)

    def _offload(self, seq: Sequence) -> None:
        self.cache.offload(seq.seq_id)
        self.running.remove(seq)
        self.offloaded.append(seq)
        seq.status = Status.OFFLOADED
        self.offload_events += 1

    def _restore_offloaded(self) -> None:
        while self.offloaded:
            seq = self.offloaded[0]
            length = self.cache.host_pool.lengths[seq.seq_id]
            need = self.cache.blocks_needed(seq.seq_id, length + self.spec.stride + 1)
            if need > self.cache.free_blocks() - self._headroom():
                return
            self.cache.restore(seq.seq_id)
            self.offloaded.pop(0)
            seq.status = Status.PREFILL if seq.num_prefilled < seq.num_prompt else Status.RUNNING
            self.running.append(seq)
            self.restore_events += 1

    def _headroom(self) -> int:
        """Blocks kept free for one step of growth of the running requests."""
        per_request = -(-(self.spec.stride + 1) // self.cache.block_size) + 1
        return per_request * sum(1 for s in self.running if s.status == Status.RUNNING)

    def _admit(self) -> None:
        while self.waiting and not self.offloaded and self.free_rows:
            seq = self.waiting[0]
            first_chunk = min(seq.num_prompt, self.spec.prefill_chunk)
            room = self.cache.free_blocks() - self._headroom()
            if self.running and self.cache.blocks_needed(seq.seq_id, first_chunk) > room:
                return                       # wait for running requests to finish or be offloaded
            self.waiting.pop(0)
            seq.status, seq.row, seq.admitted_at = (Status.PREFILL, self.free_rows.pop(0),
                                                    next(self._admissions))
            self.running.append(seq)
