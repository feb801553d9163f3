"""Which decoding requests decode plainly near a run's end: the plain tail and the catch-up."""
import pytest
import torch

from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.config import SpecConfig
from nano_sparsespec.plain_tail import mark_plain
from nano_sparsespec.scheduler import Sequence

PERIOD = 9                   # k = 8 drafting ahead: a verification every 9 steps


def decoding_request(seq_id: int, made: int, since: int = 0) -> Sequence:
    """A request of 10 prompt tokens and 600 new ones, decoding since step `since`, that has made `made` tokens
    after its prefill's."""
    seq = Sequence(seq_id, [1] * 10, SamplingParams(max_new_tokens=600), seed=0)
    seq.tokens += [2] * (made + 1)
    seq.decoding_since = since
    return seq


def batch() -> dict[str, Sequence]:
    """At step 450: ten requests made 400 tokens (224 steps left at their rate: the deadline), one made 380
    (219 tokens left: plainly it still finishes in time, so it speculates on), one 200 (399 left: it cannot), and
    one admitted at step 440 has not decoded long enough for its rate to count."""
    requests = {f"bulk {i}": decoding_request(i, 400) for i in range(10)}
    requests.update(behind=decoding_request(10, 380), slow=decoding_request(11, 200),
                    new=decoding_request(12, 5, since=440))
    return requests


def marked_names(requests: dict[str, Sequence]) -> set[str]:
    return {name for name, seq in requests.items() if seq.decodes_plainly}


def test_the_catch_up_marks_the_requests_that_would_finish_after_the_bulk_even_plainly():
    spec = SpecConfig(method="pillar-lookup", plain_tail=0.125, finish_quantile=0.9)
    requests = batch()
    mark_plain(list(requests.values()), [], 13, spec, 451, PERIOD)          # not a period's first step
    assert marked_names(requests) == set()
    mark_plain(list(requests.values()), [], 13, spec, 450, PERIOD)
    assert marked_names(requests) == {"slow"}
    never = batch()
    mark_plain(list(never.values()), [], 13, SpecConfig(method="pillar-lookup", finish_quantile=1.0), 450, PERIOD)
    assert marked_names(never) == set()


def waiting_requests(count: int, new_tokens: int) -> list[Sequence]:
    return [Sequence(100 + i, [1] * 10, SamplingParams(max_new_tokens=new_tokens), seed=0) for i in range(count)]


def test_the_catch_up_waits_while_requests_wait():
    """While requests wait, a slow row only takes fewer of them: the catch-up marks none, whatever the count."""
    spec = SpecConfig(method="pillar-lookup", plain_tail=0.125, finish_quantile=0.9)
    for waiting in (1, 14):
        requests = batch()
        mark_plain(list(requests.values()), waiting_requests(waiting, 600), 13, spec, 450, PERIOD)
        assert marked_names(requests) == set(), waiting
    mark_plain(list(requests.values()), [], 13, spec, 450, PERIOD)
    assert marked_names(requests) == {"slow"}


def test_the_plain_tail_marks_every_request_once_few_are_left_and_none_wait():
    spec = SpecConfig(method="pillar-lookup", finish_quantile=1.0)
    requests = batch()              # 13 decoding, under an eighth of the 200 that decoded together
    mark_plain(list(requests.values()), waiting_requests(1, 600), 200, spec, 451, PERIOD)
    assert marked_names(requests) == set()
    mark_plain(list(requests.values()), [], 200, spec, 451, PERIOD)
    assert marked_names(requests) == set(requests)


OPTIONS = dict(device="cpu", dtype="float32", block_size=16, max_batch=16, prefill_chunk=64)
DRAFTING = dict(method="pillar-lookup", stride=4, min_budget=8, budget_ratio=0.1, batch_policy="balanced",
                async_verify=True, **OPTIONS)


def three_long_requests(path) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    """16 requests of 10-40 new tokens but three (3, 8, 13) of 90-120: prompts, params, plain greedy output."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (16,), generator=g)]
    new_tokens = torch.randint(10, 40, (16,), generator=g).tolist()
    new_tokens[3], new_tokens[8], new_tokens[13] = 120, 100, 90
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new_tokens]
    plain = [o.token_ids for o in LLM(str(path), method="plain", **OPTIONS).generate(
        None, params, prompt_token_ids=prompts)]
    return prompts, params, plain


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_the_plain_tail_decodes_a_token_every_step_losslessly(tiny_qwen3, cuda_graphs):
    """Once the decoding requests fall below `plain_tail` of the most that decoded together, none waiting, the
    requests left verify their pending drafts and draft no more: with delayed verification each then has a one-token
    verification in every step until its last (it runs ahead on the token in flight instead of stalling). Greedy
    output equals plain decoding's, with and without the padded (CUDA-graph) steps; with plain_tail 0 no request
    decodes plainly and the last one drafts to its end, in more steps. (No catch-up here.)"""
    prompts, params, plain = three_long_requests(tiny_qwen3[0])
    step_counts = []
    for plain_tail in (0.25, 0.0):
        steps = []   # per step: {request: (kind, tokens)}, the requests decoding plainly

        def on_step(event):
            steps.append(({w.seq.seq_id: (w.kind, w.num_tokens) for w in event.works},
                          {s.seq_id for s in event.running if s.decodes_plainly}))
        llm = LLM(str(tiny_qwen3[0]), plain_tail=plain_tail, finish_quantile=1.0, cuda_graphs=cuda_graphs,
                  **DRAFTING)
        outs = llm.generate(None, params, prompt_token_ids=prompts, on_step=on_step)
        assert [o.token_ids for o in outs] == plain
        tail = set().union(*(plainly for _, plainly in steps))
        step_counts.append(len(steps))
        if plain_tail == 0:
            assert not tail and any(works.get(3, ("",))[0] == "draft" for works, _ in steps[-8:])
            continue
        assert tail == {3, 8, 13}        # 16 x 0.25: the last three
        for seq_id in tail:
            marked = next(i for i, (_, plainly) in enumerate(steps) if seq_id in plainly)
            own = [(i, works[seq_id]) for i, (works, _) in enumerate(steps) if seq_id in works]
            assert all(kind != "draft" for i, (kind, _) in own if i >= marked)
            first_plain = next(i for i, work in own if i >= marked and work == ("verify", 1))
            assert [i for i, _ in own if i >= first_plain] == list(range(first_plain, own[-1][0] + 1))
            assert own[-1][0] - first_plain >= 40
    assert step_counts[0] < step_counts[1], step_counts      # one token a step beats a cycle's tokens


def test_the_long_requests_catch_up_plainly_and_losslessly(tiny_qwen3):
    """Three requests far longer than the rest decode plainly once their rates are measured (with `finish_quantile`
    0.75 the deadline is the 12th of the 16 requests' finish, a short one's): greedy output equals plain
    decoding's, in fewer steps than when every request drafts to its end."""
    prompts, params, plain = three_long_requests(tiny_qwen3[0])
    step_counts = []
    for finish_quantile in (0.75, 1.0):
        plainly = set()
        llm = LLM(str(tiny_qwen3[0]), plain_tail=0.0, finish_quantile=finish_quantile, **DRAFTING)
        outs = llm.generate(None, params, prompt_token_ids=prompts,
                            on_step=lambda event: plainly.update(s.seq_id for s in event.running if s.decodes_plainly))
        assert [o.token_ids for o in outs] == plain
        assert plainly == ({3, 8, 13} if finish_quantile < 1 else set())
        step_counts.append(llm.last_stats.steps)
    assert step_counts[0] < step_counts[1], step_counts
