"""The CLI (`python -m nano_sparsespec.generate`) as a user meets it, on a tiny random Qwen3 with a
byte-level tokenizer and a chat template: every bad input gets a non-zero exit and one line naming
the bad value, never a traceback, and the other requests of a batch still print their output;
`--help` states every option's default; progress, notes and stats go to stderr."""
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import make_tiny_checkpoint
from nano_sparsespec import generate

VOCAB = 260                      # 256 bytes + 3 special tokens; config EOS is 259


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint with a byte-level BPE tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("cli"), vocab=VOCAB)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|end|>",
                             "additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    fast.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
                          "<|assistant|>")
    fast.save_pretrained(path)
    return path


def cli(capsys, *argv):
    """generate.main(argv) in-process -> (exit status, stdout, stderr)."""
    try:
        rc = generate.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def one_error(err, *names):
    """stderr holds exactly one error line, and it names every one of `names`."""
    lines = error_lines(err)
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def run_args(model_dir, *extra):
    return ["--model", model_dir, "--device", "cpu", "--max-new-tokens", 8, *extra]


# --- bad values refused before the model loads: exit 2, one line naming the value -------------

BAD_ARGUMENTS = {
    "temperature": (["--temperature", "-1"], ["temperature", "-1"]),
    "top_p_sampling": (["--temperature", "1", "--top-p", "1.5"], ["top_p", "1.5"]),
    "top_p_greedy": (["--top-p", "0"], ["top_p", "0.0", "--temperature 0"]),
    "top_k": (["--temperature", "1", "--top-k", "-2"], ["top_k", "-2"]),
    "max_new_tokens": (["--max-new-tokens", "0"], ["max_new_tokens", "0"]),
    "max_new_tokens_text": (["--max-new-tokens", "many"], ["--max-new-tokens", "'many'"]),
    "stride_plain": (["--stride", "0"], ["stride", "0", "--method plain does not draft"]),
    "stride_pillar": (["--method", "pillar", "--stride", "-3"], ["stride", "-3"]),
    "budget_ratio": (["--method", "pillar", "--budget-ratio", "0"], ["budget_ratio", "0"]),
    "min_budget": (["--method", "pillar", "--min-budget", "0"], ["min_budget", "0"]),
    "refresh_every": (["--method", "pillar", "--refresh-every", "0"], ["refresh_every", "0"]),
    "refresh_every_streaming": (["--method", "streaming", "--refresh-every", "-1"],
                                ["refresh_every", "-1", "only pillar and pillar-lookup use it"]),
    "kv_blocks": (["--kv-blocks", "0"], ["kv_blocks", "0"]),
    "stop": (["--stop", ""], ["stop", "''"]),
    "method": (["--method", "medusa"], ["--method", "'medusa'"]),
    "dtype": (["--dtype", "int8"], ["--dtype", "'int8'"]),
    "device_unknown": (["--device", "gpu"], ["device", "'gpu'"]),
    "tensor_parallel": (["--tensor-parallel", "0"], ["tensor_parallel", "0"]),
    "tensor_parallel_heads": (["--tensor-parallel", "3"], ["tensor_parallel=3", "num_kv_heads (2)"]),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_argument_is_one_line_naming_it(capsys, model_dir, case):
    extra, names = BAD_ARGUMENTS[case]
    rc, out, err = cli(capsys, "--prompt", "hi", *run_args(model_dir), *extra)
    assert rc == 2 and out == ""
    one_error(err, *names)


def test_device_cuda_without_cuda(capsys, model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, err = cli(capsys, "--prompt", "hi", *run_args(model_dir, "--device", "cuda"))
    assert rc == 2 and out == ""
    one_error(err, "'cuda'", "not available")


def test_no_prompt(capsys, model_dir):
    rc, _, err = cli(capsys, *run_args(model_dir))
    assert rc == 2
    one_error(err, "--prompt", "--prompts-file")


PROMPTS_FILES = {
    "broken_json": ('{"prompt": "a"}\n{"prompt": "b",\n', ["p.jsonl:2", "not valid JSON"]),
    "no_field": ('{"prompt": "a"}\n{"question": "b"}\n', ["p.jsonl:2", "'prompt'"]),
    "not_a_string": ('{"prompt": 42}\n', ["p.jsonl:1", "42"]),
    "no_prompts": ("\n  \n", ["--prompts-file"]),
}


@pytest.mark.parametrize("case", sorted(PROMPTS_FILES))
def test_bad_prompts_file(capsys, model_dir, tmp_path, case):
    content, names = PROMPTS_FILES[case]
    (tmp_path / "p.jsonl").write_text(content)
    rc, out, err = cli(capsys, *run_args(model_dir, "--prompts-file", tmp_path / "p.jsonl"))
    assert rc == 2 and out == ""
    one_error(err, *names)


def test_missing_prompts_file(capsys, model_dir, tmp_path):
    rc, _, err = cli(capsys, *run_args(model_dir, "--prompts-file", tmp_path / "nope.jsonl"))
    assert rc == 2
    one_error(err, "nope.jsonl", "not found")


def test_missing_model(capsys, tmp_path):
    rc, _, err = cli(capsys, "--prompt", "hi", "--model", tmp_path / "nowhere", "--device", "cpu")
    assert rc == 2
    one_error(err, str(tmp_path / "nowhere"))


def test_model_dir_without_config(capsys, tmp_path):
    rc, _, err = cli(capsys, "--prompt", "hi", "--model", tmp_path, "--device", "cpu")
    assert rc == 2
    one_error(err, "config.json", str(tmp_path))


def test_corrupt_safetensors(capsys, model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    rc, _, err = cli(capsys, "--prompt", "hi", *run_args(bad))
    assert rc == 2
    one_error(err, "model.safetensors")


# --- bad requests in a batch: exit 1, the error inline in the request's block, others intact ---

def blocks(out):
    """stdout of a text batch -> {index: (header, body)}."""
    parts = re.split(r"^--- \[(\d+)\] ?(.*)\n", out, flags=re.M)
    return {int(i): (head, body[:-2]) for i, head, body in zip(*[iter(parts[1:])] * 3)}


@pytest.mark.parametrize("bad", ["", "   \n "])
def test_empty_prompt_fails_alone(capsys, model_dir, bad):
    rc, out, err = cli(capsys, "--prompt", "hello", "--prompt", bad, "--prompt", "world",
                       *run_args(model_dir, "--ignore-eos"))
    assert rc == 1
    got = blocks(out)
    assert got[1][1] == f"error: request 1: empty prompt {bad!r}: a prompt needs some text"
    assert got[0][1] and got[2][1] and not got[0][1].startswith("error")
    one_error(err, "1 of 3 requests failed")


def test_empty_prompt_alone(capsys, model_dir):
    rc, out, err = cli(capsys, "--prompt", "", *run_args(model_dir))
    assert rc == 1 and out == ""
    one_error(err, "empty prompt ''")


def test_prompt_longer_than_context_fails_alone(capsys, model_dir):
    long_prompt = " ".join(["word"] * 9000)
    rc, out, err = cli(capsys, "--prompt", long_prompt, "--prompt", "short",
                       *run_args(model_dir, "--ignore-eos"))
    assert rc == 1
    head, body = blocks(out)[0]
    assert len(head) <= 80 and head.endswith("...")          # the header shows the prompt's start
    assert body.startswith("error: request 0: prompt of") and "512 tokens" in body
    assert blocks(out)[1][1] and len(out.splitlines()) < 10


# --- output --------------------------------------------------------------------------------------

def test_help_states_every_default(capsys):
    rc, out, _ = cli(capsys, "--help")
    assert rc == 0 and "embedded" in out
    for action in generate.build_parser()._actions:
        if action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings


def test_single_prompt_streams(capsys, model_dir):
    rc, out, err = cli(capsys, "--prompt", "hi", *run_args(model_dir, "--show-drafts",
                                                            "--method", "pillar", "--stride", 2))
    assert rc == 0 and out.endswith("\n")
    lines = err.splitlines()
    assert lines[0].startswith("loading ") and lines[1].startswith("ready in ")
    assert "accepted drafts" in lines[2]                     # the legend comes before the text
    assert "within the minimum budget" in err and "run slower than plain" in err
    assert re.match(r"\d+ tokens in [\d.]+ s: [\d.]+ tok/s; ", lines[-1])


def test_show_drafts_where_it_does_nothing(capsys, model_dir):
    rc, out, err = cli(capsys, "--prompt", "hi", *run_args(model_dir, "--show-drafts"))
    assert rc == 0 and "\033[" not in out + err and "--method plain drafts none" in err
    rc, out, err = cli(capsys, "--prompt", "a", "--prompt", "b",
                       *run_args(model_dir, "--show-drafts", "--method", "pillar"))
    assert rc == 0 and "\033[" not in out + err and "single streamed prompt" in err


def test_refresh_every_reaches_the_engine_and_keeps_greedy_output(capsys, model_dir, monkeypatch):
    """`--refresh-every 2` is the engine's `refresh_every`, and greedy text stays plain decoding's."""
    seen = []

    class Recording(generate.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.spec.refresh_every)

    monkeypatch.setattr(generate, "LLM", Recording)
    prompts = ("--prompt", "one", "--prompt", "two two")
    long = ("--ignore-eos", "--max-new-tokens", 40)
    rc, plain, _ = cli(capsys, *prompts, *run_args(model_dir, *long))
    assert rc == 0
    rc, out, _ = cli(capsys, *prompts, *run_args(model_dir, *long, "--method", "pillar-lookup",
                                                 "--stride", 3, "--min-budget", 8,
                                                 "--refresh-every", 2))
    assert rc == 0 and seen == [1, 2] and out == plain


def test_batch_offloads_in_stats_line(capsys, model_dir):
    rc, _, err = cli(capsys, "--prompt", "one", "--prompt", "two", "--prompt", "three",
                     *run_args(model_dir, "--ignore-eos", "--max-new-tokens", 100,
                               "--kv-blocks", 3))
    assert rc == 0
    stats = err.splitlines()[-1]
    assert re.search(r"; [1-9]\d* offloads, [1-9]\d* restores to host memory$", stats), stats


def test_json_progress_ends_at_100(capsys, model_dir, tmp_path):
    """Requests that end early (EOS) still take the bar to 100%, with one rate, on stderr."""
    _, out, _ = cli(capsys, "--prompt", "a", "--json", *run_args(model_dir, "--ignore-eos"))
    first = json.loads(out)["requests"][0]["token_ids"]
    early = tmp_path / "early"                               # its EOS: the 3rd greedy token
    shutil.copytree(model_dir, early)
    config = json.loads((early / "config.json").read_text())
    (early / "config.json").write_text(json.dumps({**config, "eos_token_id": first[2]}))
    rc, out, err = cli(capsys, "--prompt", "a", "--prompt", "bb", "--json",
                       *run_args(early, "--max-new-tokens", 40))
    assert rc == 0
    result = json.loads(out)
    assert len(out.splitlines()) == 5                        # a request per line, not a token
    assert len(result["requests"][0]["token_ids"]) == 3
    assert result["requests"][0]["stats"] == {"output_tokens": 3}
    bar = err.replace("\r", "\n").splitlines()
    final = [line for line in bar if "100%" in line]
    assert final and final[-1].count("tok/s") == 1, err
    assert result["stats"]["output_tokens"] == sum(len(r["token_ids"])
                                                   for r in result["requests"])


def test_piped_stats_line_starts_a_line(model_dir):
    """Through one pipe, stdout's text ends its line before stderr's stats line."""
    done = subprocess.run([sys.executable, "-m", "nano_sparsespec.generate", "--prompt", "hi",
                           *map(str, run_args(model_dir, "--ignore-eos"))],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stdout
    assert re.search(r"^\d+ tokens in [\d.]+ s: [\d.]+ tok/s$", done.stdout, flags=re.M), \
        done.stdout
