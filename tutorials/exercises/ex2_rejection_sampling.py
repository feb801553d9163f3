"""Exercise 2: lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for one request.

When sampling with temperature > 0, each draft x_j was sampled from the drafter's distribution q_j, while the target's
distribution at the same position is p_j. Speculative sampling keeps the drafts from the left, each with its own
*acceptance probability*: a draft the target likes at least as much as the drafter did is always kept, and one the
drafter over-proposed is kept only as often as the target would still have picked it. At the first rejection the
request emits a replacement drawn from the *residual* distribution: the target's probability mass that the drafter
under-proposed (where the target wants a token more than the drafter offered it), renormalised. If every draft is
kept, the target's distribution after the last draft gives one more, *bonus*, token.

Whatever q is, every emitted token is then distributed exactly as if sampled from the target: the drafter changes the
speed, never the output distribution. The checker tests this too, statistically.

To make the answer checkable token for token, randomness comes in as arguments.

Check your answer: python -m tutorials.check 2          (reference: nano_sparsespec.verifier.verify_rejection)
"""
import torch


def verify_one(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u_accept: torch.Tensor,
               u_next: float) -> tuple[int, int]:
    """Rejection-sample one request's k drafts.

    p         Float[K+1, V]  target distributions; row j is for draft j's position, row K for the bonus position
    q         Float[K, V]    the distributions the drafts were sampled from
    draft     Long[K]        the drafts x_0 .. x_{K-1}
    u_accept  Float[K]       uniforms in (0, 1), one per accept test: draft j is kept when u_accept[j] falls below
                             its acceptance probability
    u_next    float          a uniform in (0, 1) for the token that follows the kept drafts
    returns (num_accepted, token) as Python ints: the drafts kept before the first rejection, then the replacement
      (after a rejection) or the bonus (all kept), sampled from its distribution with u_next by inverse transform
      sampling: the token whose share of the cumulative distribution contains u_next.
    """
    raise NotImplementedError("exercise 2: write verify_one")
