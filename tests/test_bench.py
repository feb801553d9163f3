"""The benchmark CLI on a tiny random Qwen3 (no tokenizer: prompts become code points): every row runs and reports
sane values, greedy rows of ours equal plain decoding, the byte model matches hand-computed cases, and the step
profile runs on tiny shapes (including a random-weight model built from a config)."""
import gzip
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from nano_sparsespec.run_stats import kv_positions_read
from nano_sparsespec.cuda_graphs import compile_seconds
from nano_sparsespec.device import common_prefix
from nano_sparsespec.tools import bench, measure, model_shapes, profile, report, rows as bench_rows
from nano_sparsespec.config import SamplingParams, SpecConfig
from nano_sparsespec.scheduler import Sequence, Work
from nano_sparsespec.tools.measure import StepClock, tenths
from nano_sparsespec.tools.trace import STEP_MARK

BATCH, TOKENS, K = 2, 16, 4


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "w.jsonl"
    path.write_text("\n".join(json.dumps({"question": "x" * n, "prompt": "unused"}) for n in (10, 23)) + "\n")
    return path


@pytest.fixture(scope="module")
def rows_result(tiny_qwen3, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--model", str(tiny_qwen3[0]), "--prompts-file", str(prompts_file), "--prompt-field", "question",
            "--batch-size", str(BATCH), "--max-new-tokens", str(TOKENS), "--ignore-eos", "--stride", str(K),
            "--min-budget", "8", "--device", "cpu", "--threads", "1", "--block-size", "16",   # small: offload
            "--json-out", str(out / "b.json"), "--md-out", str(out / "b.md"), "--plot-out", str(out / "b.png")]
    assert bench.main(argv) == 0
    return json.loads((out / "b.json").read_text()), out


def test_every_row_is_measured_with_sane_values(rows_result, tiny_qwen3):
    result, _ = rows_result
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == list(bench_rows.ROWS)
    # the tiny model by hand (test_byte_model_by_hand): 4 bytes per parameter but the embedding table's 256 x 64,
    # and per KV position 2 (K, V) x 2 layers x 2 KV heads x 16 x 4 bytes
    params = sum(p.numel() for p in tiny_qwen3[1].parameters())
    weight_bytes, step_weight_bytes, kv_bytes = 4 * params, 4 * (params - 256 * 64), 2 * 2 * 2 * 16 * 4
    for name, r in rows.items():
        assert r["tokens"] == BATCH * TOKENS, name
        assert r["seconds"] > 0 and r["tokens_per_second"] > 0, name
        assert r["cpu_seconds"] > 0 and r["speedup_vs_plain_cpu_time"] > 0, name
        assert r["bandwidth_gbs"] > 0 and 0 < r["roofline_share"], name
        assert r["bytes_read"] == r["steps"] * step_weight_bytes + r["kv_positions"] * kv_bytes, name
        assert r["steps"] >= 1 and r["kv_positions"] > 0, name
        if name != "hf":
            assert r["peak_memory_bytes"] >= weight_bytes, name       # the model's weights at least
            assert r["seconds"] >= r["engine_seconds"] > 0, name       # the timed run covers the engine's loop
            # prefill-only steps decode nothing, so no row of ours fills every slot in every step
            assert 0 < r["batch_occupancy"] < 1, name
            busy = r["occupancy_by_tenth"]              # the run's steps in ten parts, each part's mean
            assert len(busy) == min(10, r["steps"]) and all(0 <= x <= 1 for x in busy), name
            assert min(busy) <= r["batch_occupancy"] <= max(busy), name
            shares = r["time_by_tenth"]                 # ... and the share of the run's time each part took
            assert len(shares) == len(busy) and all(x > 0 for x in shares), name
            assert sum(shares) == pytest.approx(1, abs=1e-3), name
            waits = r["wait_by_tenth"]                  # ... and the share of it the host waited for results
            assert len(waits) == len(busy) and all(0 <= x <= 1 for x in waits), name
        assert "token_ids" not in r                       # the JSON keeps figures, not outputs
        if name != "hf":
            assert r["compile_seconds"] == 0, name       # nothing compiles without --compile
    assert rows["plain"]["speedup_vs_plain"] == pytest.approx(1.0)
    assert rows["plain"]["speedup_vs_plain_cpu_time"] == pytest.approx(1.0)
    for name in ("hf", "plain"):
        assert rows[name]["mean_accepted"] is None and rows[name]["accepted_by_request"] is None
    for name in ("ngram", "streaming", "pillar-naive", "+balanced", "+offload", "+async"):
        r = rows[name]
        assert 0 < r["mean_accepted"] <= r["mean_offered"] <= K, name
        spread = list(r["accepted_by_request"].values())   # min, p10, median, p90, max of the requests' means
        assert spread == sorted(spread) and spread[0] <= r["mean_accepted"] <= spread[-1], name
        # each request's first token comes from its prefill, then each verification writes its accepted drafts and
        # one token of its own (those that checked no draft, not counted in `verifications`, one token each)
        assert BATCH + r["verifications"] * (r["mean_accepted"] + 1) <= r["tokens"] + 0.01, name
    for name in ("streaming", "pillar-naive", "+balanced", "+offload", "+async"):
        assert rows[name]["steps"] > rows[name]["verifications"] > 0, name   # drafts cost model steps
    # Greedy speculation is lossless: every row of ours writes plain decoding's tokens.
    for name in bench_rows.ROWS:
        if name != "hf":
            assert rows[name]["identical_to_plain"] == f"{BATCH}/{BATCH}", name
            assert rows[name]["mean_common_prefix"] == TOKENS, name
    # The bounded pool really spills requests to the host and brings them back.
    pool = result["settings"]["kv_blocks_offload"]
    for name in ("+offload", "+async"):
        assert rows[name]["kv_blocks"] == pool
        assert rows[name]["offloads"] > 0 and rows[name]["restores"] == rows[name]["offloads"], name
    assert rows["+balanced"]["kv_blocks"] is None and rows["+balanced"]["offloads"] == 0


@pytest.mark.skipif(not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported(),
                    reason="torch.compile unavailable")
def test_compilation_inside_a_timed_run_is_reported(rows_result):
    """compile_seconds counts torch.compile's own compile time and its kernels' autotuning at their first launch (a
    GPU's, noted here by hand); the rows table names a row that compiled."""
    from torch._dynamo.utils import compilation_time_metrics
    before = compile_seconds()
    torch.compile(lambda x: x * 2 + 1, dynamic=True)(torch.ones(3))
    assert compile_seconds() > before
    compiled = compile_seconds()
    tuning = compilation_time_metrics.setdefault("CachingAutotuner.benchmark_all_configs", [])
    tuning.append(1.5)
    try:
        assert compile_seconds() == pytest.approx(compiled + 1.5)
    finally:
        tuning.pop()
    result, _ = rows_result
    assert "compiled during timed runs" not in report.rows_markdown(result)
    result = {**result, "rows": [{**result["rows"][1], "compile_seconds": 2.5, "compile_seconds_recording": 2.0},
                                 *result["rows"][2:]]}
    assert f"compiled during timed runs (left out of tok/s, in start-up, as graph recording is): " \
           f"{result['rows'][0]['name']} 2.5 s (2.0 s of it while recording graphs)." in report.rows_markdown(result)


def test_compilation_inside_a_timed_run_counts_as_start_up(tiny_qwen3, prompts_file, tmp_path, monkeypatch):
    """Kernels compiled during a row's timed run are a start-up cost, as graph recording is: left out of its
    seconds (a cold compile cache measures what a warm one does), in its start-up, and no CPU-time figure."""
    tally = [1.0, 1.0 + 1e-4]                  # torch's compile time before and after the timed run
    monkeypatch.setattr(bench_rows, "compile_seconds", lambda: tally.pop(0) if len(tally) > 1 else tally[0])
    argv = ["--model", str(tiny_qwen3[0]), "--prompts-file", str(prompts_file), "--prompt-field", "question",
            "--batch-size", str(BATCH), "--max-new-tokens", "4", "--device", "cpu", "--threads", "1",
            "--rows", "plain", "--json-out", str(tmp_path / "b.json")]
    assert bench.main(argv) == 0
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert row["compile_seconds"] == pytest.approx(1e-4)
    assert row["seconds"] == pytest.approx(row["wall_seconds"] - 1e-4, abs=1e-9)
    assert row["cpu_seconds"] is None and row["startup_seconds"] > 1e-4


@pytest.mark.skipif(not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported(),
                    reason="torch.compile unavailable")
def test_compilations_are_counted_per_function(rows_result):
    """`CompiledFrames` counts each compiled function's compilations inside its block (a new static shape compiles
    anew, a shape met before does not); the rows report lists a row's, the costliest first."""
    def doubled(x):
        return x * 2 + 1
    compiled = torch.compile(doubled, dynamic=False, backend="eager")
    compiled(torch.ones(2))                                            # before the block: not counted
    with measure.CompiledFrames() as census:
        for n in (3, 3, 5):
            compiled(torch.ones(n))
    assert list(census.frames) == ["doubled"] and census.frames["doubled"][0] == 2
    assert census.frames["doubled"][1] > 0
    result, _ = rows_result
    assert all(not r.get("compiled_frames") for r in result["rows"])   # nothing compiles without --compile
    row = {**result["rows"][1], "compiled_frames": {"rope": [1, 0.5], "attend": [3, 4.5]}}
    assert f"{row['name']}: compilations per function (seconds): attend 3 (4.5), rope 1 (0.5)." \
        in report.rows_markdown({**result, "rows": [row]})


def test_prompt_field_and_outputs(rows_result):
    result, out = rows_result
    assert result["settings"]["prompt_tokens"] == [10, 23]         # "question" field, code points (no tokenizer)
    assert result["settings"]["kv_blocks_offload"] == bench_rows.default_kv_blocks([10, 23], TOKENS, K, 16, 0.6)
    md = (out / "b.md").read_text()
    assert "| +async |" in md and "| hf |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_and_hf_read_the_same_kv(rows_result):
    # Both do one prefill step then one decode step per token: the same (request, position) pairs.
    rows = {r["name"]: r for r in rows_result[0]["rows"]}
    assert rows["plain"]["kv_positions"] == rows["hf"]["kv_positions"] == measure.hf_kv_positions([10, 23],
                                                                                                [TOKENS, TOKENS])
    assert rows["plain"]["steps"] == rows["hf"]["steps"] == TOKENS


def test_byte_model_by_hand(tiny_qwen3):
    from nano_sparsespec.model import load_model

    model = load_model(tiny_qwen3[0])        # untied: hidden 64, 2 layers, 2 KV heads of 16, vocab 256, float32
    params = sum(p.numel() for p in model.parameters())
    bm = measure.byte_model(model, torch.float32)
    assert bm.weight_bytes == 4 * (params - 256 * 64)                 # the embedding table is only looked up
    assert bm.kv_bytes_per_position == 2 * 2 * 2 * 16 * 4             # K and V x layers x KV heads x dim x fp32
    assert measure.byte_model(model, torch.bfloat16).kv_bytes_per_position == 256

    seq = Sequence(0, list(range(10)), SamplingParams(), seed=0)
    seq.tokens += [1, 2, 3]                                           # num_verified = 12
    seq.row = 3
    selection_len = [0, 0, 0, 8]
    works = [Work(seq, "prefill", 0, 10),                             # context 10
             Work(seq, "verify", 12, 5),                              # context 12 + 5 = 17
             Work(seq, "draft", 14, 1)]                               # 8 selected + window 12..14 = 11
    assert kv_positions_read(works, selection_len, "pillar") == 10 + 17 + 11
    assert kv_positions_read(works[2:], selection_len, "full") == 15   # dense drafts read the context
    assert measure.hf_kv_positions([3, 5], [4, 1]) == (3 + 4 + 5 + 6) + 5
    assert bm.run_bytes(steps=3, kv_positions=38) == 3 * bm.weight_bytes + 38 * 512
    assert common_prefix([1, 2, 3, 4], [1, 2, 5, 4]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    assert profile.speedup_model(plain=1.0, draft=0.5, verify=2.0, k=4, accepted=3.0) == pytest.approx(1.0)
    assert profile.speedup_model(plain=1.0, draft=0.25, verify=1.0, k=4, accepted=3.0) == pytest.approx(2.0)



def test_a_generation_speedup_averages_the_steps_as_the_context_grows():
    """`over_generation`: with step costs linear in context between a batch's two profiled shapes, a generation's
    balanced speedup is the mean plain step against the mean balanced one (the kept selections' mean where
    measured); a shape with no shorter one of its model and batch gets none."""
    def entry(batch, context, plain, mixed, refreshed=None):
        e = {"model": "m", "batch": batch, "context": context, "plain": {"ms": plain}, "mixed": {"ms": mixed},
             "balanced_at_accepted": {"3": 0.0}}
        if refreshed is not None:
            e["mixed_refreshed_ms"] = refreshed
        return e
    entries = [entry(8, 64, 2.0, 4.0, 3.0), entry(8, 4096, 10.0, 9.0, 5.0), entry(16, 4096, 20.0, 8.0),
               {"model": "m", "batch": 8, "context": 8000, "skipped": "too big"}]
    profile.over_generation(entries, k=4)
    # (3 + 1) / (4 + 1) x (2 + 10) / (3 + 5): the plain and mean balanced steps at both ends
    assert entries[1]["over_generation"] == {"from": 64, "balanced_at_accepted": {"3": pytest.approx(1.2)}}
    assert "over_generation" not in entries[0] and "over_generation" not in entries[2]

def test_profile_steps_on_tiny_shapes(tiny_qwen3, tmp_path, monkeypatch, capsys):
    # A random-weight model built from a config (as for the Qwen3-1.7B / 8B shapes), shrunk to test size.
    monkeypatch.setitem(model_shapes.MODEL_SHAPES, "qwen3-tiny", dict(hidden_size=64, num_layers=2, num_heads=4,
                                                                    num_kv_heads=2, head_dim=16, intermediate_size=128,
                                                                    vocab_size=300, tie_word_embeddings=True))
    out = tmp_path / "p.json"
    argv = ["--model", str(tiny_qwen3[0]), "--profile-steps", "--profile-shapes", "2x48,2x600",
            "--profile-models", "model,qwen3-tiny", "--stride", str(K), "--min-budget", "8", "--profile-reps", "1",
            "--profile-accepted", "1,3", "--device", "cpu", "--threads", "1", "--json-out", str(out),
            "--profile-kernels", "3"]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["rows"] == []                                       # --profile-steps alone: no rows
    entries = {(e["model"].split(" ")[0], e["context"]): e for e in result["profile"]}
    assert "exceeds" in entries[("model", 600)]["skipped"]            # tiny checkpoint: 512 positions
    assert set(entries) == {("model", 48), ("model", 600), ("qwen3-tiny", 48), ("qwen3-tiny", 600)}
    for name in ("model", "qwen3-tiny"):
        e = entries[(name, 48)]
        assert e["budget"] == 8
        for kind in ("plain", "draft", "verify", "mixed"):
            # the host's share: until the step's work is queued (on the CPU, that is the work itself)
            assert e[kind]["ms"] > 0 and e[kind]["gbs"] > 0 and 0 < e[kind]["host_ms"] <= e[kind]["ms"]
        bm_kv = e["plain"]["bytes"] - e["draft"]["bytes"]
        assert bm_kv == 2 * (48 - 8) * 2 * 2 * 2 * 16 * 4             # batch x (context - budget) x KV bytes
        assert e["verify"]["bytes"] > e["plain"]["bytes"] > e["mixed"]["bytes"] > e["draft"]["bytes"]
        assert e["mixed"]["ms"] > 0 and e["mixed_over_lockstep_mean"] > 0
        assert set(e["speedup_at_accepted"]) == {"1", "3"}
        assert e["speedup_at_accepted"]["3"] > e["speedup_at_accepted"]["1"] > 0
        # the ceiling: (accepted + 1) / (k + 1) tokens per step at best, each step at least a plain step over one
        # block of context (or the shortest context profiled: 48 < 64), timed once per batch
        assert e["plain_floor"]["context"] == 48 and 0 < e["plain_floor"]["host_ms"] <= e["plain_floor"]["ms"]
        for a in ("1", "3"):
            assert e["ceiling_at_accepted"][a] == pytest.approx(
                (int(a) + 1) / (K + 1) * e["plain"]["ms"] / e["plain_floor"]["ms"], rel=1e-2)
            assert e["balanced_at_accepted"][a] == pytest.approx(
                (int(a) + 1) / (K + 1) * e["plain"]["ms"] / e["mixed"]["ms"], rel=1e-2)   # values rounded to 1e-3
        assert e["plain_breakdown_ms"]["total"] > 0
        for kind in ("plain", "draft", "verify", "mixed"):        # on the CPU: operators by their own time
            top = e["kernels"][kind]["top"]
            assert len(top) == 3 and top[0]["ms"] >= top[1]["ms"] >= top[2]["ms"] > 0
            assert e["kernels"][kind]["total_ms"] >= sum(x["ms"] for x in top) and top[0]["calls"] > 0
        assert "aten::" in e["kernels"]["verify"]["top"][0]["name"]
    # a generation growing from the shorter context to the longer, at one batch (`over_generation`)
    short, long = entries[("qwen3-tiny", 48)], entries[("qwen3-tiny", 600)]
    mean = {k: short[k]["ms"] + long[k]["ms"] for k in ("plain", "mixed")}
    assert long["over_generation"]["from"] == 48 and "over_generation" not in short
    assert long["over_generation"]["balanced_at_accepted"]["3"] == pytest.approx(
        4 / (K + 1) * mean["plain"] / mean["mixed"], rel=1e-2)
    printed = capsys.readouterr().out
    assert "Step profile" in printed and "Where the device time of a step goes" in printed
    assert f"| qwen3-tiny | 2 | 48 | 600 | {long['over_generation']['balanced_at_accepted']['1']:.2f}x |" in printed


def test_the_profile_drafts_with_the_rows_drafter(tiny_qwen3, tmp_path):
    """--pillar-method sets the step profile's drafter too: pillar-lookup drafts look their input token up in the
    context (a top-k over it, on the CPU an operator of its own), PillarAttn drafts do not."""
    ops = {}
    for method in ("pillar", "pillar-lookup"):
        out = tmp_path / f"{method}.json"
        argv = ["--model", str(tiny_qwen3[0]), "--profile-steps", "--profile-shapes", "2x48", "--profile-models",
                "model", "--stride", str(K), "--min-budget", "8", "--profile-reps", "1", "--profile-accepted", "3",
                "--device", "cpu", "--threads", "1", "--profile-kernels", "500", "--pillar-method", method,
                "--json-out", str(out)]
        assert bench.main(argv) == 0
        entry = json.loads(out.read_text())["profile"][0]
        assert entry["drafter"] == method
        ops[method] = {x["name"] for x in entry["kernels"]["draft"]["top"]}
    assert "aten::topk" in ops["pillar-lookup"] and "aten::topk" not in ops["pillar"]


def test_score_every_and_refresh_every_reach_the_rows_and_the_profile(tiny_qwen3, tmp_path):
    """--score-every and --refresh-every set the drafting rows' `SpecConfig` fields and the step profile's, which
    records them in each entry and with --refresh-every also times verification and mixed steps that keep their
    selections, and lists their kernels beside the others'."""
    args = bench.build_parser().parse_args(["--score-every", "2", "--refresh-every", "3"])
    specs = [bench_rows.spec_for(name, args, 10) for name in ("pillar-naive", "+async")]
    assert {(spec.score_every, spec.refresh_every) for spec in specs} == {(2, 3)}
    default = bench_rows.spec_for("+async", bench.build_parser().parse_args([]), 10)
    assert (default.score_every, default.refresh_every) == (1, 1)
    out = tmp_path / "profile.json"
    argv = ["--model", str(tiny_qwen3[0]), "--profile-steps", "--profile-shapes", "2x48", "--profile-models", "model",
            "--stride", str(K), "--min-budget", "8", "--profile-reps", "1", "--profile-accepted", "3", "--device",
            "cpu", "--threads", "1", "--score-every", "2", "--refresh-every", "2", "--json-out", str(out),
            "--profile-kernels", "2"]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    entry = result["profile"][0]
    assert (entry["score_every"], entry["refresh_every"]) == (2, 2)
    assert entry["verify_kept"]["ms"] > 0 and entry["mixed_kept"]["ms"] > 0
    assert set(entry["kernels"]) == {"plain", "draft", "verify", "mixed", "verify_kept", "mixed_kept"}
    assert len(entry["kernels"]["mixed_kept"]["top"]) == 2
    # the balanced step the engine runs on average: one re-selecting period in 2
    mean = (entry["mixed"]["ms"] + entry["mixed_kept"]["ms"]) / 2
    assert entry["mixed_refreshed_ms"] == pytest.approx(mean, abs=2e-3)
    assert entry["balanced_refreshed_at_accepted"]["3"] == pytest.approx(4 / (K + 1) * entry["plain"]["ms"] / mean,
                                                                         rel=1e-2)
    table = report.profile_markdown(result["profile"], K)
    assert f"| {entry['mixed_refreshed_ms']:.2f} | {entry['balanced_refreshed_at_accepted']['3']:.2f}x |" in table


def test_a_profile_of_shapes_alone_compiles_when_asked(tmp_path, monkeypatch):
    """`--compile` profiles the fast path whether or not a model is loaded: with Qwen3 shapes alone (no LLM built)
    the compiled kernels are switched on all the same (else such a profile would time the eager kernels)."""
    monkeypatch.setitem(model_shapes.MODEL_SHAPES, "qwen3-tiny", dict(hidden_size=64, num_layers=2, num_heads=4,
                                                                    num_kv_heads=2, head_dim=16, intermediate_size=128,
                                                                    vocab_size=300, tie_word_embeddings=True))
    switched = []
    monkeypatch.setattr(bench.kernels, "compile_fast_path",
                        lambda device, graphs, exact: switched.append((device, graphs)))
    argv = ["--profile-steps", "--profile-shapes", "1x32", "--profile-models", "qwen3-tiny", "--stride", str(K),
            "--min-budget", "8", "--profile-reps", "1", "--device", "cpu", "--threads", "1",
            "--json-out", str(tmp_path / "p.json")]
    assert bench.main(argv) == 0 and switched == []
    assert bench.main(argv + ["--compile"]) == 0 and switched == [(torch.device("cpu"), False)]


def test_bad_arguments(tiny_qwen3, capsys):
    assert bench.main(["--model", str(tiny_qwen3[0]), "--rows", "plain,nonsense"]) == 2
    assert "unknown row 'nonsense'" in capsys.readouterr().err
    assert bench.main(["--model", str(tiny_qwen3[0]), "--profile-steps", "--profile-shapes", "8by1024"]) == 2
    assert "bad profile shape '8by1024'" in capsys.readouterr().err
    assert bench.main(["--model", str(tiny_qwen3[0]), "--profile-steps", "--tensor-parallel", "2"]) == 2
    assert "--tensor-parallel 2 with --profile-steps: the step profile runs on one rank" in capsys.readouterr().err
    assert bench.main(["--model", str(tiny_qwen3[0]), "--plain-tail", "1.5"]) == 2
    assert "plain_tail must be in [0, 1), got 1.5" in capsys.readouterr().err
    assert bench.main(["--model", str(tiny_qwen3[0]), "--score-every", "0"]) == 2
    assert "score_every must be an integer >= 1, got 0" in capsys.readouterr().err
    assert bench.main(["--model", str(tiny_qwen3[0]), "--refresh-every", "-1"]) == 2
    assert "refresh_every must be an integer >= 1, got -1" in capsys.readouterr().err


def test_the_drafting_rows_take_the_plain_tail():
    args = bench.build_parser().parse_args(["--plain-tail", "0.5", "--finish-quantile", "0.8"])
    assert {bench_rows.spec_for(name, args, 10).plain_tail for name in ("pillar-naive", "+async")} == {0.5}
    assert {bench_rows.spec_for(name, args, 10).finish_quantile for name in ("pillar-naive", "+async")} == {0.8}
    default = bench.build_parser().parse_args([])
    assert bench_rows.spec_for("+async", default, 10).plain_tail == SpecConfig.plain_tail > 0


def test_the_async_rows_draft_ahead_unless_told_not_to():
    default = bench.build_parser().parse_args(["--pillar-method", "pillar-lookup"])
    assert bench_rows.spec_for("+async", default, 10).drafts_ahead
    stall = bench.build_parser().parse_args(["--pillar-method", "pillar-lookup", "--no-draft-ahead"])
    assert not bench_rows.spec_for("+async", stall, 10).drafts_ahead


def test_more_requests_than_slots(tiny_qwen3, prompts_file, tmp_path):
    """--num-requests > --batch-size: every request runs to the end through the slots (continuous batching for ours,
    consecutive batches for transformers), and greedy speculation still writes plain decoding's tokens."""
    argv = ["--model", str(tiny_qwen3[0]), "--prompts-file", str(prompts_file), "--prompt-field", "question",
            "--batch-size", "2", "--num-requests", "5", "--max-new-tokens", str(TOKENS), "--ignore-eos",
            "--stride", str(K), "--min-budget", "8", "--device", "cpu", "--threads", "1",
            "--rows", "hf,plain,pillar-naive,+async", "--json-out", str(tmp_path / "b.json"),
            "--md-out", str(tmp_path / "b.md")]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["settings"]["num_requests"] == 5 and len(result["settings"]["prompt_tokens"]) == 5
    rows = {r["name"]: r for r in result["rows"]}
    for name, r in rows.items():
        assert r["tokens"] == 5 * TOKENS, name
    assert rows["hf"]["steps"] == 3 * TOKENS                       # three batches of at most two, one after another
    assert rows["plain"]["kv_positions"] == rows["hf"]["kv_positions"]
    for name in ("pillar-naive", "+async"):
        assert rows[name]["identical_to_plain"] == "5/5", name
    # the slots of plain decoding stay full until the last request: more than half of each step's slots decode
    assert rows["plain"]["batch_occupancy"] > 0.5
    assert "batch 2 (5 requests)" in (tmp_path / "b.md").read_text()


def test_device_timeline_counts_overlaps_once_and_gaps_as_idle():
    """A traced window's device timeline: the span from the first activity's start to the last's end, busy the
    length of the activities' union (overlapping kernels count once, gaps between them are idle), and waiting the
    idle gaps of at least the given length (the device's queue ran dry), not the short ones between kernels."""
    from nano_sparsespec.tools.trace import device_timeline
    assert device_timeline([]) == (0.0, 0.0, 0.0)
    assert device_timeline([(5.0, 7.0)]) == (2.0, 2.0, 0.0)
    # [0, 4] and [2, 3] overlap, [1, 5] extends them, idle 5-8, [8, 9], idle 9-10, [10, 12] inside [10, 13]
    steps = [(10.0, 12.0), (0.0, 4.0), (2.0, 3.0), (8.0, 9.0), (1.0, 5.0), (10.0, 13.0)]
    assert device_timeline(steps, waited_gap=3.0) == (13.0, 9.0, 3.0)        # the gap of 3 only
    assert device_timeline(steps, waited_gap=1.0) == (13.0, 9.0, 4.0)        # both gaps
    assert device_timeline(steps, waited_gap=3.5) == (13.0, 9.0, 0.0)
    # in microseconds by default: kernels 2 us apart are a graph's, a 50 us gap a wait
    assert device_timeline([(0.0, 10.0), (12.0, 20.0), (70.0, 80.0)]) == (80.0, 28.0, 50.0)


def test_device_timeline_of_a_trace_leaves_out_the_waits_before_the_first_launch():
    """A step window's device figures start where the device's last wait that began before the first step's
    launch (its mark) ends: the window opens at a synchronisation, so the device sits idle while the host
    prepares and launches that step, a wait the run itself does not have."""
    from nano_sparsespec.tools.trace import profiled_device_timeline
    events = [{"cat": "kernel", "ts": 0.0, "dur": 10.0}, {"cat": "cpu_op", "ts": 15.0, "dur": 500.0},
              {"cat": "kernel", "ts": 3000.0, "dur": 1000.0}, {"cat": "gpu_memcpy", "ts": 4001.0, "dur": 999.0},
              {"cat": "kernel", "ts": 5100.0, "dur": 900.0}]
    # ms; the gaps of 2,990 and 100 us are waits, that of 1 us a graph's
    assert profiled_device_timeline(events) == pytest.approx((6.0, 2.909, 3.09))
    assert profiled_device_timeline(events, launched=-1.0) == pytest.approx((6.0, 2.909, 3.09))
    # launched during the work from 3,000 us, or before it began (the wait from 10 us began before)
    for launched in (3500.0, 50.0):
        assert profiled_device_timeline(events, launched) == pytest.approx((3.0, 2.899, 0.1))
    assert profiled_device_timeline(events, launched=5050.0) == pytest.approx((0.9, 0.9, 0.0))


def test_windows_of_a_rows_steps_under_the_profiler(tiny_qwen3, prompts_file, tmp_path, capsys):
    """--trace-steps FIRST:COUNT[,FIRST:COUNT]: each row of ours reports, per window, the kernels (on the CPU:
    operators) of COUNT of its steps from step FIRST, what those steps held and their wall time; a window past a
    row's end is None; windows must not overlap. --trace-dir keeps each window's Chrome trace."""
    argv = ["--model", str(tiny_qwen3[0]), "--prompts-file", str(prompts_file), "--prompt-field", "question",
            "--batch-size", "2", "--max-new-tokens", "12", "--ignore-eos", "--stride", "2", "--min-budget", "8",
            "--device", "cpu", "--threads", "1", "--rows", "plain,+async", "--profile-kernels", "4",
            "--json-out", str(tmp_path / "b.json")]
    assert bench.main(argv + ["--trace-steps", "2:2,5:3", "--trace-dir", str(tmp_path / "traces")]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "b.json").read_text())["rows"]}
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert len(traces) == 4 and "async_step5.json.gz" in traces and "plain_step5.json.gz" in traces, traces
    with gzip.open(tmp_path / "traces" / "async_step5.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert sum(e.get("name") == STEP_MARK for e in events) == 3       # a mark per step seen
    for name, r in rows.items():
        first, second = r["step_windows"]     # (a window opens at the first step launched from FIRST on)
        assert (first["steps"], second["steps"]) == (2, 3) and 2 <= first["first"] <= 3 and second["first"] == 5, name
        for w in r["step_windows"]:
            assert w["ms_per_step"] > 0, name
            assert 0 < w["works"] <= 2 and w["verifications"] + w["drafts"] <= w["works"], name   # (+async: stall)
            top = w["kernels"]["top"]
            assert len(top) == 4 and top[0]["ms"] >= top[-1]["ms"] > 0 and w["kernels"]["total_ms"] >= top[0]["ms"]
            assert w["device_span_ms"] is w["device_busy_ms"] is w["device_waiting_ms"] is None, name   # (a CPU)
            assert w["graphs_recorded"] == 0 and "host" not in w, name    # (no graphs; the kernels are the host's)
    assert rows["plain"]["step_windows"][1]["works"] == 2
    assert rows["plain"]["step_windows"][1]["verifications"] == 0 < rows["+async"]["step_windows"][1]["verifications"]
    out = capsys.readouterr().out
    assert "+async, steps 2-3 under torch.profiler" in out or "+async, steps 3-4 under" in out
    assert "+async, steps 5-7 under torch.profiler" in out
    assert bench.main(argv + ["--trace-steps", "5:3,500:3"]) == 0
    windows = [r["step_windows"] for r in json.loads((tmp_path / "b.json").read_text())["rows"]]
    assert all(w[0] is not None and w[1] is None for w in windows)
    assert bench.main(argv + ["--trace-steps", "5"]) == 2
    assert "bad --trace-steps '5': expected FIRST:COUNT" in capsys.readouterr().err
    assert bench.main(argv + ["--trace-steps", "5:3,6:2"]) == 2
    assert "bad --trace-steps '6:2': it starts inside or before the window before it" in capsys.readouterr().err


def test_fewer_requests_than_slots_is_an_error(tiny_qwen3, capsys):
    assert bench.main(["--model", str(tiny_qwen3[0]), "--batch-size", "4", "--num-requests", "3"]) == 2
    assert "--num-requests must be >= --batch-size (4), got 3" in capsys.readouterr().err


def test_rows_with_cuda_graphs_run_no_warm_up(tiny_qwen3, prompts_file, monkeypatch):
    """With CUDA graphs a row's timed run is its only run: each step shape's first run is its graph's recording,
    which is left out of tok/s. Without them each row first runs its warm-ups (all requests, then the first)."""
    from nano_sparsespec.llm import LLM
    runs = []
    generate = LLM.generate

    def counted(self, *args, **kwargs):
        runs.append(self.cuda_graphs)
        return generate(self, *args, **kwargs)
    monkeypatch.setattr(LLM, "generate", counted)
    argv = ["--model", str(tiny_qwen3[0]), "--prompts-file", str(prompts_file), "--prompt-field", "question",
            "--batch-size", "2", "--max-new-tokens", "6", "--ignore-eos", "--stride", "2", "--device", "cpu",
            "--rows", "plain"]
    assert bench.main(argv + ["--cuda-graphs"]) == 0 and runs == [True]
    runs.clear()
    assert bench.main(argv) == 0 and runs == [False] * 3


def test_the_step_clock_leaves_out_graph_recording_and_compiling(monkeypatch):
    """StepClock: a step lasts from its start to the next one's, less the CUDA-graph recording its launch did (the
    events' cumulative graph_record_seconds) and the compiling outside any recording (torch's tally, less the
    events' graph_record_compile_seconds); the run's time in tenths of its steps sums to 1. wait_by_tenth: the
    share of each tenth's time the host waited for results (the events' cumulative result_wait_seconds)."""
    from nano_sparsespec.tools import measure
    compiled = iter([10.0, 10.0, 10.2, 10.5, 10.5])          # torch's tally: at the clock's start, then each step
    monkeypatch.setattr(measure, "compile_seconds", lambda: next(compiled))
    clock = StepClock()
    # (started, recording so far, of which compiling): step 1's launch records for 0.5 s (compiling 0.2 of it),
    # step 2's compiles 0.3 s outside a recording
    for started, recorded, record_compiled, waited in [(0.0, 0.0, 0.0, 0.0), (1.0, 0.5, 0.2, 0.25),
                                                       (1.6, 0.5, 0.2, 0.25), (2.3, 0.5, 0.2, 0.35)]:
        clock.on_step(SimpleNamespace(started=started, graph_record_seconds=recorded,
                                      graph_record_compile_seconds=record_compiled, result_wait_seconds=waited))
    # steps of 1.0, 0.1, 0.4 and 1.0 s (the last until the run's end at 3.3)
    assert clock.time_by_tenth(3.3) == pytest.approx([0.4, 0.04, 0.16, 0.4])
    # waits of 0.25, 0, 0.1 and (to the run's total of 0.85) 0.5 s in them
    assert clock.wait_by_tenth(3.3, 0.85) == pytest.approx([0.25, 0.0, 0.25, 0.5])
    assert tenths(25)[:3] == [(0, 2), (2, 5), (5, 7)] and len(tenths(25)) == 10 and tenths(0) == []


def test_the_host_sampler_says_where_a_rows_host_time_goes(tiny_qwen3, prompts_file, tmp_path, capsys):
    """--sample-host MS: each row of ours reports the package functions its host was in over the timed run, by share
    of the samples (innermost with its line, and anywhere on the stack); a negative interval is refused."""
    argv = ["--model", str(tiny_qwen3[0]), "--prompts-file", str(prompts_file), "--prompt-field", "question",
            "--batch-size", "2", "--max-new-tokens", "24", "--ignore-eos", "--stride", "2", "--min-budget", "8",
            "--device", "cpu", "--threads", "1", "--rows", "plain,+async", "--json-out", str(tmp_path / "b.json")]
    switch_interval = sys.getswitchinterval()
    assert bench.main(argv + ["--sample-host", "0.5"]) == 0
    assert sys.getswitchinterval() == switch_interval        # (shortened while sampling, then restored)
    for row in json.loads((tmp_path / "b.json").read_text())["rows"]:
        samples = row["host_samples"]
        assert samples["interval_ms"] == 0.5 and samples["samples"] > 20 and samples["recording"] == 0, row["name"]
        within, own = dict(samples["within"]), samples["own"]
        assert within["tools/rows.py:run_ours"] == 1.0 and 0.5 < within["async_loop.py:run"] <= 1.0, within
        assert 0 < within["runner.py:launch"] <= within["async_loop.py:run"], within
        assert all(0 < share <= 1 for _, share in own) and sum(share for _, share in own) <= 1.0001, own
        assert all(name.count(":") == 2 and name.split(":")[2].isdigit() for name, _ in own), own
    assert bench.main(argv + ["--sample-host", "-1"]) == 2
    assert "--sample-host must be >= 0 ms (0: off), got -1.0" in capsys.readouterr().err


def test_a_result_names_its_code_by_commit_changes_and_digest(tmp_path):
    """`git_state` of a package folder in a checkout: its commit, whether the package has uncommitted changes, and a
    digest of its Python files that changes with their contents (it names the code where a copy's git is stale)."""
    import subprocess

    package = tmp_path / "pkg"
    (package / "tools").mkdir(parents=True)
    (package / "tools" / "a.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("outside the package\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "first"]):
        subprocess.run(git + args, check=True)
    clean = measure.git_state(package)
    assert clean["package_dirty"] is False and len(clean["commit"]) >= 7
    (tmp_path / "README.md").write_text("changed outside the package\n")
    assert measure.git_state(package)["package_dirty"] is False
    (package / "tools" / "a.py").write_text("x = 2\n")
    changed = measure.git_state(package)
    assert changed["package_dirty"] is True and changed["commit"] == clean["commit"]
    assert changed["source_digest"] != clean["source_digest"]
    (package / "tools" / "a.py").write_text("x = 1\n")
    assert measure.source_digest(package) == clean["source_digest"]
