"""The benchmark's outputs: markdown tables of the rows and of the step profile, and a bar chart."""
from __future__ import annotations

import sys
from pathlib import Path

from .rows import warm_up_tokens
from .trace import HOST_WAIT_US


def _fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def _batch_label(settings: dict) -> str:
    """'128', or '128 (512 requests)' when more requests than slots ran through the batch."""
    requests = settings.get("num_requests", settings["batch_size"])
    return f"{settings['batch_size']}" + (
        f" ({requests} requests)" if requests != settings["batch_size"] else "")


def _kernel_list(kernels: dict) -> str:
    """`trace.kernel_table`'s largest kernels as 'name ms (calls); ...', names cut to 70 chars."""
    return "; ".join(f"{x['name'][:70]} {x['ms']:.3f} ({x['calls']:g})" for x in kernels["top"])


def rows_markdown(result: dict) -> str:
    s = result["settings"]
    # On a CPU, also the speedup in CPU time of this process (robust to other jobs).
    cpu = s["device"] == "cpu"
    graphs = s.get("cuda_graphs", False)
    lines = [f"Rows: {result['model']['name']}, {s['device']} {s['dtype']}, "
             f"batch {_batch_label(s)}, "
             f"{s['max_new_tokens']} new tokens{' (ignore EOS)' if s['ignore_eos'] else ''}, "
             f"temperature "
             f"{s['temperature']:g}, k = {s['stride']}; "
             f"peak bandwidth {result['peak_bandwidth_gbs']:.1f} GB/s "
             f"({result['peak_bandwidth_source']}). `= plain`: requests whose tokens equal "
             f"plain decoding's (and the "
             f"mean number of leading tokens they share). Each row of ours is timed after "
             + ("its graphs' recording, the first run of each step shape" if s.get("cuda_graphs")
                else f"warm-up runs of its own requests and settings, all of them and then the "
                     f"first alone (up to {warm_up_tokens(s['stride'])} tokens)") + ".", "",
             "| row | tok/s | vs plain |" + (" vs plain (CPU time) |" if cpu else "") +
             " accepted / k | GB/s | % of peak BW | peak mem (MiB) | steps | batch used "
             "| offloads / restores |"
             " = plain |" + (" graphs (record s) | start-up (s) |" if graphs else ""),
             "|---|---:|---:|" + ("---:|" if cpu else "")
             + "---:|---:|---:|---:|---:|---:|---:|---:|" +
             ("---:|---:|" if graphs else "")]
    for r in result["rows"]:
        acc = None if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f} / {s['stride']}"
        off = f"{r['offloads']} / {r['restores']}" if r["kv_blocks"] else "–"
        share = None if r["roofline_share"] is None else 100 * r["roofline_share"]
        used = "–" if r.get("batch_occupancy") is None else f"{100 * r['batch_occupancy']:.0f}%"
        cpu_speedup = f" {_fmt(r['speedup_vs_plain_cpu_time'], '.2f')}x |" if cpu else ""
        lines.append(f"| {r['name']} | {r['tokens_per_second']:.1f} "
                     f"| {_fmt(r['speedup_vs_plain'], '.2f')}x |"
                     f"{cpu_speedup} {acc or '–'} | {r['bandwidth_gbs']:.2f} | {_fmt(share)} "
                     f"| {r['peak_memory_bytes'] / 2**20:.1f} | {r['steps']} | {used} | {off} "
                     f"| {same_as_plain(r)} |" +
                     (f" {r.get('graphs_recorded', '–')} "
                      f"({r.get('graph_record_seconds', 0):.1f}) "
                      f"| {_fmt(r.get('startup_seconds'), '.1f')} |" if graphs else ""))
    if graphs:
        lines += ["", "With CUDA graphs, tok/s leaves out the one-time recording of each "
                      "bucket's graph (graphs recorded and seconds spent, as a server spends them "
                      "once at start). Start-up: the row's wall time but for its decoding."]
    compiled = [f"{r['name']} {r['compile_seconds']:.1f} s "
                f"({r.get('compile_seconds_recording', 0):.1f} s of it "
                f"while recording graphs)"
                for r in result["rows"] if r.get("compile_seconds", 0) > 0.05]
    if compiled:
        lines += ["", "torch.compile compiled during timed runs (left out of tok/s, in start-up, "
                      "as graph recording is): " + ", ".join(compiled) + "."]
    for r in result["rows"]:
        frames = sorted(r.get("compiled_frames", {}).items(), key=lambda kv: -kv[1][1])
        if frames:
            lines += ["", f"{r['name']}: compilations per function (seconds): " + ", ".join(
                f"{name} {count} ({seconds:.1f})" for name, (count, seconds) in frames) + "."]
    for r, w in ((r, w) for r in result["rows"] for w in r.get("step_windows") or [] if w):
        k = w["kernels"]
        top = _kernel_list(k)
        lines += ["", f"{r['name']}, steps {w['first']}-{w['first'] + w['steps'] - 1} under "
                      f"torch.profiler: {w['ms_per_step']:.2f} ms per step (wall), "
                      f"{w['works']:.0f} requests per step ({w['verifications']:.1f} verifying, "
                      f"{w['drafts']:.1f} drafting); {k['total_ms']:.2f} ms of kernels per step"
                      + (f" (past the window's opening, the device busy "
                         f"{w['device_busy_ms']:.2f} of the {w['device_span_ms']:.2f} ms its work "
                         f"spans a step, waiting for work {w['device_waiting_ms']:.2f} in gaps of "
                         f"{HOST_WAIT_US:.0f} us or more)"
                         if w.get("device_span_ms") else "")
                      + f", the most (ms per step, calls per step): {top}"
                      + (f"; {w['graphs_recorded']} CUDA graphs recorded in the window"
                         if w.get("graphs_recorded") else "")
                      + (f"; the host's operators and CUDA calls, the most: "
                         f"{_kernel_list(w['host'])}" if w.get("host") else "")]
    return "\n".join(lines)


def same_as_plain(r: dict) -> str:
    if r["identical_to_plain"] is None:
        return "–"
    return f"{r['identical_to_plain']} ({r['mean_common_prefix']:.0f})"



def profile_markdown(profile: list[dict], stride: int) -> str:
    accepted = next((list(e["speedup_at_accepted"])
                     for e in profile if "speedup_at_accepted" in e), [])
    floor = next((e["plain_floor"]["context"] for e in profile if "plain_floor" in e), None)
    head = ("| model | batch x ctx | dtype | plain ms (GB/s) | draft ms (GB/s) "
            "| verify ms (GB/s) | draft / plain "
            "| verify / plain | " + " | ".join(f"speedup @ {a} acc." for a in accepted) +
            " | mixed ms | mixed / lock-step mean | "
            + " | ".join(f"balanced @ {a} acc." for a in accepted) +
            f" | plain ms at ctx {floor} (host ms) | "
            + " | ".join(f"ceiling @ {a} acc." for a in accepted) + " |")
    lines = [f"Step profile (k = {stride}; ms per step of a run of identical steps, each launched "
             f"before the previous one's results are read, as the engine runs them; verify "
             f"includes picking the next critical positions; "
             f"speedup: lock-step, "
             f"k drafts then a verification; mixed: the balanced step, 1 request in {stride + 1} "
             f"verifying, the others "
             f"drafting; balanced: (accepted + 1) / (k + 1) x plain ms / mixed ms, every slot "
             f"busy; ceiling: the same "
             f"with plain ms at ctx {floor} for the step, the most a drafter that runs the "
             f"model's layers could gain "
             f"at the shape, as no such step costs less than a plain step with next to nothing "
             f"to attend to; host ms: launching a step (lists built, device work queued), "
             f"which on a GPU overlaps the device work of the step before):", "",
             head,
             "|" + "---|" * (11 + 3 * len(accepted))]
    for e in profile:
        shape = f"{e['batch']} x {e['context']}"
        if "skipped" in e:
            lines.append(f"| {e['model']} | {shape} | {e['dtype']} | skipped: {e['skipped']} |")
            continue
        cells = [f"{e[k]['ms']:.2f} ({e[k]['gbs']:.1f})" for k in ("plain", "draft", "verify")]
        speed = [f"{e['speedup_at_accepted'][a]:.2f}x" for a in accepted]
        balanced = [f"{e['balanced_at_accepted'][a]:.2f}x" for a in accepted]
        ceiling = [f"{e['ceiling_at_accepted'][a]:.2f}x" for a in accepted]
        lines.append(f"| {e['model']} | {shape} | {e['dtype']} | " + " | ".join(cells) +
                     f" | {e['draft_over_plain']:.2f} | {e['verify_over_plain']:.2f} | "
                     + " | ".join(speed) +
                     f" | {e['mixed']['ms']:.2f} | {e['mixed_over_lockstep_mean']:.2f} | "
                     + " | ".join(balanced) +
                     f" | {e['plain_floor']['ms']:.2f} ({e['plain_floor']['host_ms']:.2f}) | "
                     + " | ".join(ceiling) + " |")
    refreshed = [e for e in profile if "mixed_refreshed_ms" in e]
    if refreshed:
        n = refreshed[0]["refresh_every"]
        lines += ["", f"Verifications that keep their selections (`--refresh-every {n}`: the "
                      f"engine re-selects in one period in {n}); mean mixed: (mixed + {n - 1} x "
                      f"kept mixed) / {n}, the balanced step it runs on average:", "",
                  "| model | batch x ctx | verify kept ms | mixed kept ms | mean mixed ms | "
                  + " | ".join(f"balanced @ {a} acc." for a in accepted) + " |",
                  "|" + "---|" * (5 + len(accepted))]
        for e in refreshed:
            balanced = [f"{e['balanced_refreshed_at_accepted'][a]:.2f}x" for a in accepted]
            lines.append(f"| {e['model']} | {e['batch']} x {e['context']} | "
                         f"{e['verify_kept']['ms']:.2f} | {e['mixed_kept']['ms']:.2f} | "
                         f"{e['mixed_refreshed_ms']:.2f} | " + " | ".join(balanced) + " |")
    grown = [e for e in profile if "over_generation" in e]
    if grown:
        lines += ["", "Over a generation whose context grows from the shorter shape's to the "
                      "longer's (a batch's two profiled shapes; each step's cost linear in context "
                      "between them): the mean plain step against the mean balanced step:", "",
                  "| model | batch | ctx from | ctx to | "
                  + " | ".join(f"balanced @ {a} acc." for a in accepted) + " |",
                  "|" + "---|" * (4 + len(accepted))]
        for e in grown:
            g = e["over_generation"]
            lines.append(f"| {e['model']} | {e['batch']} | {g['from']} | {e['context']} | "
                         + " | ".join(f"{g['balanced_at_accepted'][a]:.2f}x" for a in accepted)
                         + " |")
    for e in (e for e in profile if "kernels" in e):
        lines += ["", f"Where the device time of a step goes, {e['model']} {e['batch']} x "
                      f"{e['context']} (ms per step; the kernels that take the most, calls per "
                      f"step):", ""]
        for kind, k in e["kernels"].items():
            top = _kernel_list(k)
            lines.append(f"- {kind}: {k['total_ms']:.2f} in all; {top}")
    done = [e for e in profile if "plain_breakdown_ms" in e]
    if done:
        lines += ["", "Where one plain step's time goes "
                      "(ms; each part timed between synchronisations):", "",
                  "| model | batch x ctx | total | linear layers | attention | other layer ops "
                  "| LM head, sampling, host |", "|---|---|---:|---:|---:|---:|---:|"]
        for e in done:
            b = e["plain_breakdown_ms"]
            lines.append(f"| {e['model']} | {e['batch']} x {e['context']} | {b['total']:.2f} | "
                         f"{b['linear_layers']:.2f} | {b['attention']:.2f} | "
                         f"{b['other_layer_ops']:.2f} | {b['lm_head_sampling_and_host']:.2f} |")
    return "\n".join(lines)


def plot_rows(result: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no plot (pip install matplotlib)",
              file=sys.stderr)
        return False
    rows = result["rows"]
    names = [r["name"] for r in rows]
    tps = [r["tokens_per_second"] for r in rows]
    colors = ["#999999" if n == "hf"
              else "#4c72b0" if n in ("plain", "ngram", "streaming") else "#dd8452"
              for n in names]
    fig, ax = plt.subplots(figsize=(1.1 * len(rows) + 2, 4))
    bars = ax.bar(names, tps, color=colors)
    for bar, r in zip(bars, rows):
        label = f"{r['tokens_per_second']:.0f}"
        if r["speedup_vs_plain"] is not None:
            label += f"\n{r['speedup_vs_plain']:.2f}x"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    s = result["settings"]
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['model']['name']} · {s['device']} {s['dtype']} "
                 f"· batch {_batch_label(s)} · "
                 f"{s['max_new_tokens']} tokens · T={s['temperature']:g}", fontsize=9)
    ax.set_ylim(0, max(tps) * 1.25 if tps else 1)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


