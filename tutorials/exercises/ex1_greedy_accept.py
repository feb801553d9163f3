"""Exercise 1: the greedy acceptance rule.

A verification step runs the target model with full attention over the pending token and the k drafts, which gives
k+1 target distributions: row j is the target's distribution for the token that follows the first j drafts. With
greedy decoding the target's choice at row j is its argmax. Accept drafts from the left while each equals the target's
choice at its row; at the first mismatch, emit the target's choice there instead (the *correction*). If every draft
matches, the last row gives one more token for free (the *bonus*). Either way a verification writes accepted + 1
tokens, and they are exactly the tokens plain greedy decoding would have written (tutorial 01).

Check your answer: python -m tutorials.check 1          (reference: nano_sparsespec.verifier.verify_greedy)
"""
import torch


def accept_greedy(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a batch of requests.

    target_probs  Float[B, K+1, V]  row j: the target's distribution for the token after the first j drafts
    draft_tokens  Long[B, K]        request b's drafts, right-padded: only the first num_drafts[b] are real
    num_drafts    Long[B]           0..K
    returns (num_accepted Long[B], next_token Long[B]):
      num_accepted[b]  length of the longest prefix of request b's real drafts in which every draft equals the
                       argmax of its row (ties: torch.argmax's choice)
      next_token[b]    argmax of row num_accepted[b]: the correction after a mismatch, or the bonus token
    No Python loop over the batch is needed (hint: cumprod of a boolean mask).
    """
    raise NotImplementedError("exercise 1: write accept_greedy")
