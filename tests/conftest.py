"""Shared fixtures: tiny random Qwen3 / Llama checkpoints written by transformers, and the embedded model."""
import pytest
import torch


def make_tiny_checkpoint(path, arch="qwen3", tie=False, num_kv_heads=2, vocab=256, max_pos=512, sharded=False,
                         seed=0):
    """Write a tiny random HF checkpoint with transformers' own save_pretrained; returns (path, hf_model)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=max_pos,
                  tie_word_embeddings=tie, eos_token_id=vocab - 1, bos_token_id=0, rms_norm_eps=1e-6)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Random init is small; widen the weights so attention is not uniform and logits are not flat.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model = model.float().eval()
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
    return path, model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
