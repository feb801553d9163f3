"""Reference solution of exercise 1 (the greedy acceptance rule)."""
import torch


def accept_greedy(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    K = draft_tokens.shape[1]
    target = target_probs.argmax(-1)                                          # [B, K+1] the target's choices
    real = torch.arange(K, device=draft_tokens.device) < num_drafts[:, None]  # [B, K] False on padding
    match = (draft_tokens == target[:, :K]) & real                            # [B, K]
    num_accepted = match.long().cumprod(-1).sum(-1)                           # [B] leading run of True
    return num_accepted, target.gather(1, num_accepted[:, None]).squeeze(1)
