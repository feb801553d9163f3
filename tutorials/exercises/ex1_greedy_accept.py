"""Exercise 1: the greedy acceptance rule.

A verification step runs the target model with full attention over the pending token and the k drafts, which gives
k+1 target distributions: row j is the target's distribution for the token that follows the first j drafts. With
greedy decoding the target would write its most likely token at every row. The drafts are accepted as long as they
are what the target would have written; the first draft the target disagrees with, and every draft after it, is
thrown away, and the target's own token at that row (the *correction*) is emitted instead. If the target agrees with
every draft, its last row gives one more token for free (the *bonus*). Either way a verification writes accepted + 1
tokens, and they are exactly the tokens plain greedy decoding would have written (tutorials 01 and 02).

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
      num_accepted[b]  how many of request b's real drafts greedy decoding would have written, counting from the
                       first (the target's choice on a tie: torch.argmax's)
      next_token[b]    the token the verification emits after them: the correction, or the bonus
    The checker runs it on a batch of a few hundred requests: aim for whole-batch tensor operations.
    """
    raise NotImplementedError("exercise 1: write accept_greedy")
