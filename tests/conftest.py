"""Shared fixtures: tiny random Qwen3 / Llama checkpoints written by transformers, the embedded model, and the
prompts + plain greedy outputs that the losslessness tests compare every drafter against, and `run` / `generate`, which
run an LLM on them."""
import pytest
import torch

from nano_sparsespec import LLM, SamplingParams

PROMPT_LENGTHS = (5, 17, 40, 3, 64, 9, 33, 21)
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def run(path, prompts, params=GREEDY, **options):
    """An LLM on the checkpoint at `path` (options: LLM's) and its outputs for `prompts` (token ids) -> (llm, outputs)."""
    llm = LLM(str(path), **options)
    return llm, llm.generate(None, params, prompt_token_ids=prompts)


def generate(path, prompts, params=GREEDY, device="cpu", **options):
    """`run` in float32 (greedy equality is exact arithmetic, not a bf16 near-tie lottery) -> (llm, token ids)."""
    llm, outs = run(path, prompts, params, device=device, dtype="float32", **options)
    return llm, [o.token_ids for o in outs]


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


@pytest.fixture(scope="session")
def prompts():
    """Eight random prompts of different lengths (token ids below the tiny vocabulary's EOS)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="session")
def plain_greedy(tiny_qwen3, prompts):
    """Plain greedy decoding of `prompts` on the tiny Qwen3 (eager path): what every drafter must reproduce."""
    llm = LLM(str(tiny_qwen3[0]), method="plain")
    return [o.token_ids for o in llm.generate(None, GREEDY, prompt_token_ids=prompts)]
