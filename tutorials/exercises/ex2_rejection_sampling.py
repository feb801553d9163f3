"""Exercise 2: lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for one request.

When sampling with temperature > 0, each draft x_j was sampled from the drafter's distribution q_j, and the target's
distribution at the same position is p_j. Accept x_j with probability min(1, p_j(x_j) / q_j(x_j)). At the first
rejection, sample a replacement from the *residual* max(0, p_j - q_j), renormalised; if all k drafts are accepted,
sample a bonus token from p_k. Whatever q is, every emitted token is then distributed exactly as if sampled from the
target: the drafter changes the speed, never the output distribution.

To make the answer checkable token for token, randomness comes in as arguments: one uniform per accept test and one
for the final token, used through the inverse CDF.

Check your answer: python -m tutorials.check 2          (reference: nano_sparsespec.verifier.verify_rejection)
"""
import torch


def verify_one(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u_accept: torch.Tensor,
               u_next: float) -> tuple[int, int]:
    """Rejection-sample one request's k drafts.

    p         Float[K+1, V]  target distributions; row j is for draft j's position, row K for the bonus position
    q         Float[K, V]    the distributions the drafts were sampled from
    draft     Long[K]        the drafts x_0 .. x_{K-1}
    u_accept  Float[K]       uniforms in (0, 1), one per accept test
    u_next    float          a uniform in (0, 1) for the token that follows the accepted drafts
    returns (num_accepted, token) as Python ints:
      1. accept draft j while  u_accept[j] * q[j, x_j] < p[j, x_j]   (that is: with probability min(1, p/q));
         stop at the first rejection
      2. after a rejection at j, dist = max(0, p[j] - q[j]) (the residual); if all K were accepted, dist = p[K]
      3. token = the smallest i with cumsum(dist)[i] > u_next * sum(dist)   (inverse-CDF sampling)
    """
    raise NotImplementedError("exercise 2: write verify_one")
