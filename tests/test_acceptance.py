"""tools/acceptance.py: the repetitiveness measures, and `--no-repeat-ngram` (the same N-gram ban on the drafter's and the
verifier's logits, so that speculation stays lossless with respect to the banned target)."""
from conftest import generate
from nano_sparsespec.tools.acceptance import (build_configs, build_parser, no_repeat_ngram_runner, parse_method,
                                              repeated_ngram_share, repeated_run_share)


def test_repetitiveness_measures():
    # 3-grams 123 231 312 123 231: the last two already occurred
    assert repeated_ngram_share([1, 2, 3, 1, 2, 3, 1], 3) == (2, 5)
    # 2-token windows: [1, 2] recurs at 2 and 4, [2, 1] at 3: tokens 2..5 sit in a repeated window
    assert repeated_run_share([1, 2, 1, 2, 1, 2], run=2) == (4, 6)


def test_the_sweep_measures_whole_texts_with_no_plain_tail():
    """Acceptance over whole texts: even with many prompts, no request stops drafting near the end of the sweep."""
    args = build_parser().parse_args(["--methods", "pillar,pillar-lookup,streaming", "--temperatures", "0,0.6"])
    configs = build_configs(args, [parse_method(m) for m in args.methods.split(",")], batch=512)
    assert len(configs) == 6 and all(spec.plain_tail == 0 and spec.finish_quantile == 1 and spec.max_batch == 512
                                     for _, spec, _ in configs)


def test_no_repeat_ngram_bans_repeats_in_drafts_and_verification(tiny_qwen3, prompts):
    """A tiny random model loops; with repeated 3-grams banned its greedy output has none, greedy speculation equals
    plain decoding under the ban (naive lock-step too, whose draft steps have no verification rows), and the `full`
    drafter (the target model itself) still has every draft accepted: drafts and verification rows, read out in the
    same steps, see the same ban."""
    _, looping = generate(tiny_qwen3[0], prompts, method="plain")
    assert sum(repeated_ngram_share(t, 3)[0] for t in looping) > 0          # the ban has something to do
    ban = no_repeat_ngram_runner(3)
    _, plain = generate(tiny_qwen3[0], prompts, method="plain", runner_class=ban)
    _, pillar = generate(tiny_qwen3[0], prompts, method="pillar", stride=4, min_budget=8, budget_ratio=0.1,
                         batch_policy="balanced", runner_class=ban)
    _, lockstep = generate(tiny_qwen3[0], prompts, method="pillar", stride=4, min_budget=8, budget_ratio=0.1,
                           batch_policy="naive", runner_class=ban)
    full, _ = generate(tiny_qwen3[0], prompts, method="full", stride=4, batch_policy="balanced", runner_class=ban)
    assert all(repeated_ngram_share(t, 3)[0] == 0 for t in plain)
    assert pillar == plain and lockstep == plain
    stats = full.last_stats
    assert stats.accepted_counts and stats.accepted_counts == stats.drafts_offered
