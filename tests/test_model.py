"""model.py: logits parity with transformers' own Qwen3/Llama on tiny random checkpoints, loading, and clear errors.

Tolerance: fp32 everywhere; our logits have magnitude ~5 on these checkpoints (asserted), and must agree with
transformers' to max |diff| <= 1e-4, with the same argmax at every position.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_checkpoint
from nano_sparsespec.config import ModelConfig
from nano_sparsespec.model import load_model
from nano_sparsespec.tools.measure import CompiledFrames

ATOL = 1e-4


def _ids(n, vocab=256, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _hf_logits(hf_model, ids):
    return hf_model(ids[None]).logits[0].float()


def _assert_parity(ours, ref):
    assert ours.shape == ref.shape
    assert ref.abs().max() > 1.0, "reference logits are flat: the comparison would prove nothing"
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max |logits diff| = {diff:.3g} > {ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    json.dump(cfg, open(cfg_path, "w"))
    return cfg


# --------------------------------------------------------------------------------------------------------------------
# Parity with transformers

@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("num_kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path, arch, num_kv_heads, tie):
    path, hf_model = make_tiny_checkpoint(tmp_path, arch, tie=tie, num_kv_heads=num_kv_heads)
    model = load_model(path)
    cfg = model.config
    assert cfg.architecture == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    assert cfg.qk_norm == (arch == "qwen3")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (4, num_kv_heads, tie)
    assert (model.lm_head is None) == tie
    ids = _ids(40)
    _assert_parity(model.full_logits(ids), _hf_logits(hf_model, ids))


def test_sharded_checkpoint_loads_the_same(tmp_path):
    path, hf_model = make_tiny_checkpoint(tmp_path / "sharded", "qwen3", sharded=True)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    assert not (path / "model.safetensors").exists()
    single, _ = make_tiny_checkpoint(tmp_path / "single", "qwen3")
    ids = _ids(24)
    sharded_logits = load_model(path).full_logits(ids)
    _assert_parity(sharded_logits, _hf_logits(hf_model, ids))
    assert torch.equal(sharded_logits, load_model(single).full_logits(ids))


def test_bfloat16_loading_is_close(tmp_path):
    path, hf_model = make_tiny_checkpoint(tmp_path, "qwen3")
    model = load_model(path, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    ids = _ids(16)
    ours, ref = model.full_logits(ids), _hf_logits(hf_model, ids)
    assert ours.dtype == torch.float32                    # logits always come back in fp32
    # bf16 weights and activations against the fp32 reference: measured max |diff| 1.9% of the largest logit
    # (transformers' own model cast to bf16 is 2.0% off); 5% leaves margin, and a wrong layer is off by far more.
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


# --------------------------------------------------------------------------------------------------------------------
# Rope scaling

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
LINEAR_SCALING = {"rope_type": "linear", "factor": 2.0}


def _llama_with_rope_scaling(path, rope_scaling, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, rope_scaling=dict(rope_scaling), rms_norm_eps=1e-6,
                         eos_token_id=255, bos_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model = model.float().eval()
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("scaling", [LLAMA3_SCALING, LINEAR_SCALING], ids=["llama3", "linear"])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    path, hf_model = _llama_with_rope_scaling(tmp_path, scaling)
    saved = json.load(open(path / "config.json"))
    # transformers 5 writes the scaling as rope_parameters (transformers 4: rope_scaling); either must be read.
    rope = saved.get("rope_parameters") or saved.get("rope_scaling")
    assert rope["rope_type"] == scaling["rope_type"]
    cfg = ModelConfig.from_dir(path)
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == scaling["rope_type"]
    for key, value in scaling.items():
        assert cfg.rope_scaling[key] == value
    assert cfg.rope_theta == 10000.0

    ids = _ids(100)                                       # longer than original_max_position_embeddings = 64
    ours = load_model(path).full_logits(ids)
    _assert_parity(ours, _hf_logits(hf_model, ids))

    # The scaling must matter: the same weights without it give different logits.
    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_scaling=None)
    assert ModelConfig.from_dir(path).rope_scaling is None
    unscaled = load_model(path).full_logits(ids)
    assert (unscaled - ours).abs().max() > 10 * ATOL


@pytest.mark.parametrize("scaling", [LLAMA3_SCALING, LINEAR_SCALING], ids=["llama3", "linear"])
def test_rope_scaling_legacy_rope_scaling_key(tmp_path, scaling):
    """A transformers-4 style config.json (top-level rope_theta + rope_scaling) loads the same model."""
    path, hf_model = _llama_with_rope_scaling(tmp_path, scaling)
    _edit_config(path, rope_parameters=None, rope_theta=10000.0, rope_scaling=dict(scaling))
    cfg = ModelConfig.from_dir(path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == scaling["rope_type"]
    ids = _ids(90)
    _assert_parity(load_model(path).full_logits(ids), _hf_logits(hf_model, ids))


def test_rope_theta_is_read(tmp_path):
    path, hf_model = make_tiny_checkpoint(tmp_path, "llama")
    cfg = json.load(open(path / "config.json"))
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    assert ModelConfig.from_dir(path).rope_theta == theta
    ids = _ids(60)
    base = load_model(path).full_logits(ids)
    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert ModelConfig.from_dir(path).rope_theta == 500.0
    assert (load_model(path).full_logits(ids) - base).abs().max() > 10 * ATOL


# --------------------------------------------------------------------------------------------------------------------
# Clear errors

def test_missing_model_directory(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model.*does not exist"):
        load_model(missing)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_config_without_safetensors(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(path)


def test_truncated_safetensors(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        load_model(path)


def test_truncated_shard(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3", sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(ValueError, match=rf"{shard.name}.*truncated or corrupt"):
        load_model(path)


def test_shard_listed_in_index_but_missing(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3", sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard.name}.*missing"):
        load_model(path)


def test_missing_tensor(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*not found"):
        load_model(path)


def test_wrong_tensor_shape(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    _edit_config(path, intermediate_size=96)              # weights say 128
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj\.weight.*shape"):
        load_model(path)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "dynamic", "factor": 2.0}], ids=["yarn", "dynamic"])
@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unknown_rope_type(tmp_path, rope, key):
    path, _ = make_tiny_checkpoint(tmp_path, "llama")
    if key == "rope_scaling":
        _edit_config(path, rope_parameters=None, rope_theta=10000.0, rope_scaling=rope)
    else:
        _edit_config(path, rope_parameters={**rope, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=rf"rope_scaling type '{rope['rope_type']}'"):
        load_model(path)


def test_legacy_type_key_for_rope_scaling(tmp_path):
    """transformers 4 configs may spell it {"type": "yarn"}: still rejected by name."""
    path, _ = make_tiny_checkpoint(tmp_path, "llama")
    _edit_config(path, rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        load_model(path)


def test_moe_rejected(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    _edit_config(path, num_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts=8.*mixture-of-experts"):
        load_model(path)


def test_sliding_window_rejected(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    _edit_config(path, use_sliding_window=True, sliding_window=32, max_window_layers=0,
                 layer_types=["sliding_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="sliding_window=32"):
        load_model(path)


def test_sliding_window_flag_alone_rejected(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    _edit_config(path, use_sliding_window=True, sliding_window=32)
    with pytest.raises(ValueError, match="sliding_window"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "llama")
    _edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(path)


def test_listed_architecture_wins_over_model_type(tmp_path):
    """A config that names only an unsupported architecture is refused, even if model_type looks familiar
    (e.g. a Qwen3ForSequenceClassification checkpoint has model_type "qwen3" but no LM head)."""
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(path)


def test_model_type_used_when_architectures_absent(tmp_path):
    path, hf_model = make_tiny_checkpoint(tmp_path, "llama")
    _edit_config(path, architectures=None)
    model = load_model(path)
    assert model.config.architecture == "LlamaForCausalLM" and not model.config.qk_norm
    ids = _ids(12)
    _assert_parity(model.full_logits(ids), _hf_logits(hf_model, ids))


def test_bias_rejected(tmp_path):
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    _edit_config(path, attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        load_model(path)


# --------------------------------------------------------------------------------------------------------------------
# Size accounting

@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_weight_bytes(tmp_path, tie):
    path, hf_model = make_tiny_checkpoint(tmp_path, "qwen3", tie=tie)
    model = load_model(path)
    assert model.weight_bytes() == sum(p.numel() * p.element_size() for p in model.parameters())
    # Same parameters as transformers' model (which shares the tied embedding/head), fp32, and as the checkpoint
    # (which stores a tied head once); the rotary tables (buffers) are not counted.
    assert model.weight_bytes() == sum(p.numel() * 4 for p in hf_model.parameters())
    assert model.weight_bytes() == sum(v.numel() * v.element_size()
                                       for v in load_file(path / "model.safetensors").values())
    cfg = model.config
    head = 0 if tie else cfg.vocab_size * cfg.hidden_size * 4
    embed = cfg.vocab_size * cfg.hidden_size * 4
    assert model.weight_bytes() - head - embed == sum(
        p.numel() * 4 for n, p in model.named_parameters() if not n.startswith(("lm_head", "embed_tokens")))


def test_weight_bytes_follows_load_dtype(tmp_path):
    """load_model(dtype=bfloat16) must hold bf16 parameters: half the bytes a forward step reads."""
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    fp32 = load_model(path).weight_bytes()
    bf16 = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.weight_bytes() * 2 == fp32


@pytest.mark.skipif(not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported(),
                    reason="torch.compile unavailable")
def test_compiled_elementwise_ops_match_eager(tmp_path):
    """kernels.compile_elementwise() (the fast path's fused norms, RoPE and SiLU) computes what the eager ones do."""
    from nano_sparsespec import kernels, model as model_module

    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    model = load_model(path)
    ids = torch.tensor(_ids(12))
    eager = model.full_logits(ids)
    kernels.compile_elementwise()
    try:
        assert all(model_module._ops[n] is not f for n, f in model_module._eager_ops.items())
        compiled = model.full_logits(ids)
        with CompiledFrames() as compiled_again:
            fewer_rows = model.full_logits(ids[:7])          # token rows are dynamic: nothing compiles again
    finally:
        model_module.use_eager_elementwise()
    assert all(model_module._ops[n] is f for n, f in model_module._eager_ops.items())
    assert torch.allclose(compiled, eager, atol=1e-4)
    assert torch.allclose(fewer_rows, model.full_logits(ids[:7]), atol=1e-4)
    assert compiled_again.frames == {}
