"""tensor_parallel.py: the model split over ranks (gloo, spawned worker processes) gives the tokens of one rank, for
every drafter, with balanced batching and delayed verification; a size the ranks cannot share is a clear error."""
import pytest

from conftest import make_tiny_checkpoint
from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.config import SpecConfig

DRAFTERS = ("pillar", "pillar-lookup", "streaming", "ngram")


def outputs_per_drafter(llm, prompts, params, drafters=DRAFTERS):
    """Token ids of each drafter with balanced batching and delayed verification, from one LLM (its ranks stay up
    between calls). A budget of 16 positions: each rank's drafts attend to the positions its own heads' scores chose."""
    results = {}
    for method in drafters:
        llm.spec = SpecConfig(method=method, batch_policy="balanced", async_verify=True, min_budget=16)
        results[method] = [o.token_ids for o in llm.generate(None, params, prompt_token_ids=prompts)]
    return results


def test_three_ranks_decode_the_embedded_model_as_one():
    """9 query heads, 3 KV heads and 49,152 vocabulary rows split 3 ways: the same greedy tokens as one rank."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    one = LLM(None, device="cpu", dtype="float32")
    prompts = [one.encode(p) for p in ("What is 17 * 23? Think step by step.", "Name three prime numbers.")]
    expected = [o.token_ids for o in one.generate(None, params, prompt_token_ids=prompts)]
    three = LLM(None, device="cpu", dtype="float32", tensor_parallel=3)
    try:
        assert three.model.config.num_kv_heads == 1 and three.model.config.num_heads == 3
        for drafter, got in outputs_per_drafter(three, prompts, params).items():
            assert got == expected, drafter
    finally:
        three.close()


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_decode_a_qwen3_as_one(tmp_path, prompts, ranks):
    """A random Qwen3 of 4 query and 4 KV heads split 2 and 4 ways: the same greedy tokens as one rank."""
    path, _ = make_tiny_checkpoint(tmp_path, "qwen3", num_kv_heads=4)
    prompts, params = prompts[:3], SamplingParams(max_new_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(path), dtype="float32").generate(None, params, prompt_token_ids=prompts)]
    llm = LLM(str(path), dtype="float32", tensor_parallel=ranks)
    try:
        for drafter, got in outputs_per_drafter(llm, prompts, params, DRAFTERS[:2]).items():
            assert got == expected, drafter
    finally:
        llm.close()


def test_a_size_the_ranks_cannot_share_is_a_clear_error(tiny_qwen3):
    with pytest.raises(ValueError, match=r"tensor_parallel=3 does not divide the model's num_kv_heads \(2\)"):
        LLM(str(tiny_qwen3[0]), tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1, got 0"):
        LLM(str(tiny_qwen3[0]), tensor_parallel=0)
