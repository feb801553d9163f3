"""nano-sparsespec: sparse self-speculative decoding (SparseSpec, arXiv 2512.01278) in PyTorch.

    from nano_sparsespec import LLM, SamplingParams
    llm = LLM()                # the embedded SmolLM2-135M-Instruct, or LLM("path/to/hf_dir")
    out = llm.generate(["Why is the sky blue?"], SamplingParams(max_new_tokens=64))
"""
from .llm import LLM, RequestOutput
from .config import SamplingParams, SpecConfig

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecConfig"]
