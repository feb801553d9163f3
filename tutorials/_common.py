"""What every tutorial shares: the command line, the model, a step recorder, and plain-text tables and plots.

  * `parser` / `start`  — the common flags (`--quick`, `--threads`, `--no-plot`, `--model`) and torch set-up.
  * `load_llm`          — the embedded SmolLM2-135M-Instruct by default; with `--quick`, a tiny *random* Qwen3
                          (2 layers, hidden 64) that shares SmolLM2's tokenizer, so every script runs in seconds.
                          Its numbers mean nothing: it only proves the code path works.
  * `with_spec`         — change the speculation settings of a loaded `LLM` without reloading its weights.
  * `StepLog`           — records what the real engine does at each step (who prefills, drafts, verifies, stalls or
                          sits offloaded; tokens; timings) from the `StepEvent`s it hands its `on_step` callback:
                          `log = StepLog(); llm.generate(..., on_step=log.record)`.
  * `table`, `timeline`, `save_plot` — text output, and PNGs when matplotlib is importable.
"""
from __future__ import annotations

import argparse
import atexit
import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nano_sparsespec import LLM, SpecConfig
from nano_sparsespec.async_loop import StepEvent
from nano_sparsespec.embedded import resolve_model_path

OUT_DIR = Path(__file__).resolve().parent / "out"

# A prompt whose answer needs facts from far back in the context: attention has to reach past the recent window.
PROMPT = """Read the notes, then answer the question.

Notes on the Harbor Street bakery:
- The bakery opens at 6 am and closes at 2 pm, every day except Monday.
- Each morning the baker, Lena, makes 120 croissants, 80 baguettes and 45 cinnamon rolls.
- A croissant costs 3 dollars, a baguette costs 4 dollars and a cinnamon roll costs 5 dollars.
- On Saturdays Lena makes twice as many cinnamon rolls, because the market next door is open.
- Lena's assistant, Tomas, arrives at 7 am and delivers 30 baguettes to the school on Elm Road.
- Whatever is not sold by closing time is given to the shelter on Pine Avenue.

Question: On a Saturday, if every item is sold except the baguettes delivered to the school (which are paid for at \
the normal price), how much money does the bakery take in? Think step by step."""

SHORT_PROMPTS = [
    "What is the sum of the first 10 odd numbers? Think step by step.",
    "Why is the sky blue? Explain in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paper clip.",
    "What is 17 times 23? Show your work.",
    "Explain what a hash table is to a child.",
    "Name the planets of the solar system in order.",
    "Give one tip for learning to play the guitar.",
]


# ----------------------------------------------------------------------------------------------------------------------
# command line

def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="seconds-long run on a tiny random model (what CI runs)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: steady timings on a shared machine; 0 = torch's default)")
    p.add_argument("--no-plot", action="store_true", help="text only, even when matplotlib is installed")
    p.add_argument("--model", default=None, help="HF directory of a Qwen3/Llama checkpoint (default: embedded)")
    return p


def start(args: argparse.Namespace, title: str) -> None:
    """Pin torch's thread count and print the run's header.

    One thread by default: on a small shared CPU, torch's worker threads spin while they wait for a core that another
    process holds, and a decode step can get several times slower and very noisy.
    """
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    mode = "quick: tiny random model, numbers are meaningless" if args.quick else "default"
    print(f"== {title}  [{mode}; {torch.get_num_threads()} CPU thread(s)]")


def section(title: str) -> None:
    print(f"\n-- {title}")


# ----------------------------------------------------------------------------------------------------------------------
# the model

TINY_CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def tiny_model_dir() -> Path:
    """Write a tiny random Qwen3 checkpoint (HF layout) with the embedded model's tokenizer into a temporary directory.

    The vocabulary is SmolLM2's (49152), so prompts tokenize exactly as they do for the real model.
    """
    from safetensors.torch import save_file

    out = Path(tempfile.mkdtemp(prefix="nano-sparsespec-tiny-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    tokenizer_dir = resolve_model_path(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    c = TINY_CONFIG
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2, **c}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(0)
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({pre + "self_attn.q_proj.weight": (q_out, h), pre + "self_attn.k_proj.weight": (kv_out, h),
                       pre + "self_attn.v_proj.weight": (kv_out, h), pre + "self_attn.o_proj.weight": (h, q_out),
                       pre + "self_attn.q_norm.weight": (d,), pre + "self_attn.k_norm.weight": (d,),
                       pre + "mlp.gate_proj.weight": (inter, h), pre + "mlp.up_proj.weight": (inter, h),
                       pre + "mlp.down_proj.weight": (h, inter),
                       pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,)})
    # matrices ~ N(0, 0.2): wide enough that attention is not uniform; norms start at 1, as in a fresh model
    tensors = {name: torch.randn(shape, generator=g) * 0.2 if len(shape) == 2 else torch.ones(shape)
               for name, shape in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def load_llm(args: argparse.Namespace, **spec) -> LLM:
    """The model a tutorial runs on: --model, else the embedded SmolLM2-135M, or the tiny random model with --quick."""
    path = str(tiny_model_dir()) if args.quick else args.model
    t0 = time.perf_counter()
    llm = LLM(path, **spec)
    cfg = llm.model.config
    print(f"model: {llm.model_path.name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads / "
          f"{cfg.num_kv_heads} KV heads, {llm.model.weight_bytes() / 1e6:.0f} MB of {llm.dtype}) on {llm.device}, "
          f"loaded in {time.perf_counter() - t0:.1f} s")
    return llm


def with_spec(llm: LLM, **changes) -> LLM:
    """Replace the speculation settings the next `generate` uses (validated again; the weights stay loaded)."""
    llm.spec = SpecConfig(**{**vars(llm.spec), **changes})
    return llm


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n random token ids: for timing runs, where the content of the prompt does not matter."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------------------------------------------------
# watching the engine

# one letter per request per step
LETTERS = {"prefill": "P", "draft": "D", "verify": "V", "stall": "s", "offloaded": "o", "idle": "."}


@dataclass
class Step:
    index: int
    actions: dict[int, str]       # seq_id -> letter (see LETTERS); requests not yet admitted or finished are absent
    tokens: int                   # tokens through the model this step
    start: float                  # perf_counter when scheduling began (nan: a step that launched nothing)
    launch_seconds: float = 0.0   # host seconds of the launch: the step's tensors, the forward, sampling and
                                  # verification (queued on a GPU; on the CPU the forward runs inside it)
    running: int = 0              # requests on the device (prefilling or decoding) after scheduling
    offloaded: int = 0            # requests whose KV sits in the host pool


@dataclass
class StepLog:
    """What the engine did at each step of a run, filled by its `on_step` callback (`record`)."""
    steps: list[Step] = field(default_factory=list)
    _in_flight: set[int] = field(default_factory=set)    # requests whose result the last launched step awaits

    def durations(self) -> list[float]:
        """Seconds from each step's scheduling to the next one's (the last step has no successor and is left out;
        a step that launched nothing has no timing: nan, and so has the step before it)."""
        return [b.start - a.start for a, b in zip(self.steps, self.steps[1:])]

    def record(self, event: StepEvent) -> None:
        """The `on_step` callback: `llm.generate(..., on_step=log.record)` appends one Step per step.

        The engine reports the steps it launches. With delayed verification a step can launch nothing: every request
        waits for a result in flight. Such a step shows up as a gap in the step numbers; it is filled in here with a
        Step of no tokens and no timing, in which the requests that verified (or ended their prompt) at the step
        before stall and the others sit as they did."""
        actions = {w.seq.seq_id: LETTERS[w.kind] for w in event.works}
        for seq in event.running:                 # not scheduled: its result is in flight (stall), or nothing to do
            if seq.seq_id not in actions:
                actions[seq.seq_id] = LETTERS["stall" if seq.awaiting_result else "idle"]
        for seq in event.offloaded:
            actions[seq.seq_id] = LETTERS["offloaded"]
        if self.steps and event.step > self.steps[-1].index + 1:
            self._fill_gap(event.step, actions)
        self.steps.append(Step(event.step, actions, sum(w.num_tokens for w in event.works), event.started,
                               event.launch_seconds, len(event.running), len(event.offloaded)))
        self._in_flight = {w.seq.seq_id for w in event.works if w.kind == "verify" or w.final_prefill}

    def _fill_gap(self, step: int, actions: dict[int, str]) -> None:
        """Steps before `step` that launched nothing: who stalled there, who waited (see `record`)."""
        before = self.steps[-1]
        for index in range(before.index + 1, step):
            idle = {i: "o" if a == "o" else "." for i, a in before.actions.items()
                    if i in actions and i not in self._in_flight}
            self.steps.append(Step(index, {**idle, **dict.fromkeys(self._in_flight, "s")}, 0, float("nan"),
                                   running=sum(a != "o" for a in idle.values()) + len(self._in_flight),
                                   offloaded=sum(a == "o" for a in idle.values())))
            self._in_flight = set()


# ----------------------------------------------------------------------------------------------------------------------
# text output and plots

def table(headers: list[str], rows: list[list]) -> None:
    """Print a text table: numbers right-aligned, columns of words left-aligned."""
    def text(c) -> str:
        return c if isinstance(c, str) else f"{c:,}" if isinstance(c, int) else f"{c:.3g}"

    def is_word(c) -> bool:
        return isinstance(c, str) and not re.fullmatch(r"[-+]?[\d.,]+[%x]?", c)

    cells = [[str(h) for h in headers]] + [[text(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    left = [all(is_word(row[i]) for row in rows) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) if lft else c.rjust(w) for c, w, lft in zip(row, widths, left)).rstrip())
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def timeline(log: StepLog, first: int = 0, count: int = 60, label: str = "") -> None:
    """Print one row per request, one column per step: P prefill, D draft, V verify, s stall, o offloaded, . idle."""
    steps = log.steps[first:first + count]
    ids = sorted({i for s in steps for i in s.actions})
    ruler = "".join(str(s.index // 10 % 10) if s.index % 10 == 0 else " " for s in steps)
    print(f"  {label:<10} step {ruler}")
    for i in ids:
        print(f"  {'':<10} r{i:<3} {''.join(s.actions.get(i, ' ') for s in steps)}")


def bar(value: float, scale: float, width: int = 40) -> str:
    return "#" * round(width * value / scale) if scale else ""


def save_plot(args: argparse.Namespace, name: str, draw) -> None:
    """If matplotlib is importable (and --no-plot was not given), call draw(plt) and save tutorials/out/<name>.png."""
    if args.no_plot:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: skipped (matplotlib is not installed: `pip install matplotlib` for PNGs)")
        return
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / f"{name}.png"
    draw(plt)
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close("all")
    print(f"plot: {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
