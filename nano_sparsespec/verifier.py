"""Sampling and verification: from logits to the tokens a request emits.

Owns
  * `uniform(seeds, positions, salt)` — counter-based randomness, a pure function of (seed,
    position, salt): results do not depend on the batch or on scheduling.
  * `SamplingTensors`, `distribution` (temperature, top-k, top-p; greedy rows one-hot; the blocks'
    masses from the same pass) and `sample` (greedy argmax or inverse-CDF sampling with one uniform
    per row).
  * `verify` — accepts a prefix of a request's drafts (greedy match or lossless rejection
    sampling), then a *recovered* token from max(0, p - q), or a *bonus* one if all are accepted.
  * `sample_drafts`, `verify_logits` — logits in, tokens out (`kernels.compile_sampling` fuses
    them; `use_eager_sampling` restores the reference).

Must not touch the KV cache or the model, nor sync with the host (.item(), .tolist(),
data-dependent branches): only shapes and host-side flags decide Python control flow.
Each salt's uniform influences the output at most once per position (a position is drafted again
only after its draft was rejected unseen), so reuse is sound.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .config import SamplingParams
from .device import to_device

SALT_TARGET = 0    # a target or bonus token
SALT_DRAFT = 1     # a draft token
SALT_ACCEPT = 2    # a draft's accept test
SALT_RESIDUAL = 3  # a recovered token

_M32 = 0xFFFFFFFF
CDF_BLOCK = 128    # tokens per block of the two-level inverse CDF (`_inverse_cdf`)


# ---- counter-based randomness --------------------------------------------------------------------

def _lowbias32(x):
    """Wellons' lowbias32 mixer, a bijection on [0, 2**32) (masks keep int64 products exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _salt_state(salt: int) -> int:
    """The hash's start state for one purpose (a Python int: costs no kernel)."""
    return _lowbias32((salt * 0x9E3779B9 + 0x632BE5AB) & _M32)


def _uniform_from_state(state, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Float uniforms in (0, 1) from a salt state (int or per-row Long) and seeds, positions."""
    h = _lowbias32(state ^ (seeds & _M32))      # low 32 bits of the seed
    h = _lowbias32(h ^ ((seeds >> 32) & _M32))  # high 32 bits of the seed
    h = _lowbias32(h ^ (positions & _M32))      # in [0, 2**32)
    # 23 bits: (i + 0.5) / 2**23, exact in float32
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def uniform(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """seeds, positions Long[N] (broadcastable) -> Float[N] uniforms in the open interval (0, 1)."""
    return _uniform_from_state(_salt_state(salt), seeds, positions)


# ---- per-row sampling parameters -----------------------------------------------------------------

@dataclass
class SamplingTensors:
    """Sampling parameters of N logit rows; host flags let hot paths skip work without a sync."""
    temperature: torch.Tensor  # Float[N], 0 for greedy rows
    top_k: torch.Tensor        # Long[N], 0 = no top-k
    top_p: torch.Tensor        # Float[N], 1 = no top-p
    seed: torch.Tensor         # Long[N]
    greedy: torch.Tensor       # Bool[N]
    use_filter: bool = True    # host flag: some row may use top-k or top-p (False: skip the sort)
    all_greedy: bool = False   # host flag: every row is greedy (skip rejection sampling)
    any_greedy: bool = True    # host flag: some row may be greedy (False: skip one-hot / argmax)

    @classmethod
    def from_params(cls, params_list: list[SamplingParams], seeds: list[int],
                    device=None) -> "SamplingTensors":
        """One row per request; `seeds`: the resolved seeds (any ints, reduced mod 2**64)."""
        if len(seeds) != len(params_list):
            raise ValueError(f"got {len(seeds)} seeds for {len(params_list)} sampling params")
        if any(not isinstance(s, int) for s in seeds):
            raise ValueError(f"seeds must be ints (resolve seed=None before sampling), "
                             f"got {seeds!r}")
        temperature = [0.0 if p.greedy else float(p.temperature) for p in params_list]
        return cls(
            temperature=to_device(temperature, torch.float32, device),
            top_k=to_device([p.top_k for p in params_list], torch.long, device),
            top_p=to_device([float(p.top_p) for p in params_list], torch.float32, device),
            seed=to_device([(s + 2**63) % 2**64 - 2**63 for s in seeds], torch.long, device),
            greedy=to_device([p.greedy for p in params_list], torch.bool, device),
            **cls.host_flags(params_list),
        )

    @staticmethod
    def host_flags(params_list: list[SamplingParams]) -> dict:
        """use_filter / all_greedy / any_greedy of rows holding these params."""
        greedy = [p.greedy for p in params_list]
        return dict(use_filter=any(p.filtered for p in params_list if not p.greedy),
                    all_greedy=all(greedy), any_greedy=any(greedy))

    def _map(self, f) -> "SamplingTensors":
        """`f` applied to every tensor, the host flags kept."""
        return SamplingTensors(f(self.temperature), f(self.top_k), f(self.top_p), f(self.seed),
                               f(self.greedy), self.use_filter, self.all_greedy, self.any_greedy)

    def per_position(self) -> "SamplingTensors":
        """The same rows viewed [N, 1], to broadcast over each request's logits [N, K + 1, V]."""
        return self._map(lambda t: t[:, None])

    def rows(self, index: torch.Tensor) -> "SamplingTensors":
        """Select / repeat rows: index Long[M] -> SamplingTensors of M rows."""
        return self._map(lambda t: t[index])

    def select(self, index: torch.Tensor, flags: dict) -> "SamplingTensors":
        """Rows `index` Long[M] of a table, with `flags` = `host_flags` of just those requests."""
        return replace(self.rows(index), **flags)

    def __len__(self) -> int:
        return self.seed.shape[0]


# ---- logits -> probabilities -> tokens -----------------------------------------------------------

def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set filtered-out logits to -inf: logits Float[..., V], top_k Long[...], top_p Float[...].

    top-k keeps exactly k tokens (ties towards the lower index, like argmax); top-p then keeps the
    smallest sorted prefix whose mass is >= top_p (the top token always survives)."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [..., V]
    rank = torch.arange(V, device=logits.device)                              # [V]
    k = torch.where(top_k > 0, top_k, V)                                      # [...]
    sorted_logits = sorted_logits.masked_fill(rank >= k[..., None], float("-inf"))
    probs = sorted_logits.softmax(-1)  # [..., V]
    mass_before = _cdf(probs) - probs  # [..., V] exclusive prefix mass
    drop = (mass_before >= top_p[..., None]) & (top_p[..., None] < 1.0)  # 1: keep all (rounding)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _blocks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """[..., V] -> [..., nb, CDF_BLOCK]: the vocabulary in blocks, the last padded with `fill`."""
    V = x.shape[-1]
    if V % CDF_BLOCK:
        x = F.pad(x, (0, -V % CDF_BLOCK), value=fill)
    return x.unflatten(-1, (-1, CDF_BLOCK))


def distribution(logits: torch.Tensor,
                 st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits Float[..., V] (any float dtype) -> (probs Float[..., V] (float32), block_mass
    Float[..., nb] or None): temperature, top-k, top-p, greedy rows one-hot at argmax; block_mass
    sums probs over each block of CDF_BLOCK tokens (what `sample` reads first; None when every row
    is greedy). `st` fields have shape [...] (or broadcast: `per_position`).

    One pass over the vocabulary makes both: each block's largest scaled logit and its sum of
    exp(scaled - that largest) give the softmax's normalizer and the blocks' masses; probs =
    exp(scaled - largest) / normalizer is then an expression that compiled code computes where it
    is read (a sampled block, a draft's token, a store), not a tensor written and read back."""
    logits = logits.float()  # [..., V]
    if st.all_greedy:        # cheap path: no softmax
        return _one_hot_argmax(logits), None
    temperature = torch.where(st.greedy, 1.0, st.temperature)  # [...], no 0-division on greedy
    scaled = logits / temperature[..., None]  # [..., V]
    if st.use_filter:
        scaled = _top_k_top_p(scaled, st.top_k, st.top_p)
    blocks = _blocks(scaled, float("-inf"))                              # [..., nb, C]
    top = blocks.amax(-1)                                                # [..., nb]
    # each block's sum of exp(scaled - its largest), in the pass that finds its largest (a block
    # filtered away, largest -inf, subtracts 0 instead: it sums to 0, not NaN)
    within = (blocks - torch.where(top > float("-inf"), top, 0.0)[..., None]).exp().sum(-1)
    peak = top.amax(-1, keepdim=True)                                    # [..., 1] finite
    block_sum = within * (top - peak).exp()                      # [..., nb] of exp(scaled - peak)
    total = block_sum.sum(-1, keepdim=True)                              # [..., 1] >= 1
    probs = (scaled - peak).exp() / total                                # [..., V] softmax
    if not st.any_greedy:       # every row samples: no one-hot pass
        return probs, block_sum / total
    probs = torch.where(st.greedy[..., None], _one_hot_argmax(logits), probs)
    return probs, _blocks(probs, 0.0).sum(-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Float[..., V] -> Float[..., V]: 1 at each row's torch.argmax, 0 elsewhere (greedy rows)."""
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


@torch.library.custom_op("nano_sparsespec::cdf", mutates_args=())
def _cdf(probs: torch.Tensor) -> torch.Tensor:
    """probs.cumsum(-1): [..., V] -> [..., V], opaque: compiled graphs fuse nothing into it."""
    return probs.cumsum(-1)


@_cdf.register_fake
def _(probs: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(probs)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor,
                 block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row: probs Float[N, V] (>= 0, any sum), u Float[N] in (0, 1) -> Long[N]:
    the first token whose cumulative mass exceeds u x the row's total. block_mass Float[N, nb]:
    probs summed over each block of CDF_BLOCK tokens, if known (`distribution`).

    In two levels, so that no cumulative sum runs over the whole vocabulary: the blocks' running
    masses find the block, then the running mass within it the token."""
    blocks = _blocks(probs, 0.0)                                         # [N, nb, C]
    if block_mass is None:
        block_mass = blocks.sum(-1)                                      # [N, nb]
    block_cdf = _cdf(block_mass)                                         # [N, nb]
    # [N, 1]; u <= 1 - 2**-24 makes u x total < total in float32, so some block's running mass
    # exceeds the target, and the first that does has mass
    target = (u * block_cdf[:, -1])[:, None]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_max(blocks.shape[1] - 1)
    before = F.pad(block_cdf, (1, 0)).gather(1, block)          # [N, 1] the blocks' mass before it
    within = blocks.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK))[:, 0]      # [N, C]
    cdf = before + _cdf(within)                                          # [N, C]
    column = torch.searchsorted(cdf, target, right=True).clamp_max(CDF_BLOCK - 1)     # [N, 1]
    # guard: rounding (two sums of the block's mass) could pass its last token with mass; then
    # the block's likeliest token, read within the block (a vocabulary-wide argmax is a pass more)
    ok = within.gather(1, column) > 0
    column = torch.where(ok, column, within.argmax(-1, keepdim=True))
    return (block * CDF_BLOCK + column).squeeze(-1)                      # [N]


def sample(probs: torch.Tensor, st: SamplingTensors, positions: torch.Tensor, salt: int,
           block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """probs Float[N, V], positions Long[N] (of the tokens being sampled) -> tokens Long[N];
    block_mass Float[N, nb] as `distribution` gives it, if known."""
    if st.all_greedy:
        return probs.argmax(-1)
    u = uniform(st.seed, positions, salt)  # [N]
    if not st.any_greedy:
        return _inverse_cdf(probs, u, block_mass)
    return torch.where(st.greedy, probs.argmax(-1), _inverse_cdf(probs, u, block_mass))


# ---- verification --------------------------------------------------------------------------------

@dataclass
class VerifyResult:
    """Per request b: it emits draft_tokens[b, :num_accepted[b]], then next_token[b]."""
    num_accepted: torch.Tensor  # Long[B], 0..num_drafts
    next_token: torch.Tensor    # Long[B], recovered (after a rejection) or bonus (all accepted)
    is_bonus: torch.Tensor      # Bool[B], every draft accepted (vacuously when num_drafts == 0)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """accept Bool[B, K] -> Long[B]: length of the leading run of True."""
    return accept.long().cumprod(-1).sum(-1)


def verify_greedy(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor):
    """Accept the longest prefix where draft == target argmax, then emit the argmax that follows.

    target_probs Float[B, K+1, V], draft_tokens Long[B, K], num_drafts Long[B]
    -> (num_accepted Long[B], token Long[B])"""
    K = draft_tokens.shape[1]
    target = target_probs.argmax(-1)                               # [B, K+1]
    valid = torch.arange(K, device=draft_tokens.device) < num_drafts[:, None]  # [B, K]
    n = _accepted_prefix((draft_tokens == target[:, :K]) & valid)  # [B]
    return n, target.gather(1, n[:, None]).squeeze(1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)), or p where that is all zero: p, q Float[B, V] -> Float[B, V]."""
    r = (p - q).clamp_min(0.0)                                                # [B, V]
    mass = r.sum(-1, keepdim=True)                                            # [B, 1]
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def verify_rejection(target_probs, draft_tokens, draft_probs, num_drafts, seed, first_position):
    """Lossless rejection sampling (Leviathan et al.): emits tokens distributed as the target.

    target_probs Float[B, K+1, V] (p), draft_tokens Long[B, K] (x), draft_probs Float[B, K, V]
    (q) or None (q one-hot at x), num_drafts Long[B], seed Long[B], first_position Long[B]
    -> (num_accepted Long[B], token Long[B])"""
    B, K1, V = target_probs.shape
    K = K1 - 1
    j = torch.arange(K, device=draft_tokens.device)  # [K]
    valid = j < num_drafts[:, None]                  # [B, K]
    x = torch.where(valid, draft_tokens, 0)          # [B, K], padding -> a safe index
    p_x = target_probs[:, :K].gather(-1, x[..., None]).squeeze(-1)   # [B, K]
    q_x = (torch.ones_like(p_x) if draft_probs is None
           else draft_probs.gather(-1, x[..., None]).squeeze(-1))
    u = uniform(seed[:, None], first_position[:, None] + j, SALT_ACCEPT)   # [B, K]
    accept = (u * q_x < p_x) & valid  # P(accept) = min(1, p(x) / q(x))
    n = _accepted_prefix(accept)      # [B]
    is_bonus = n == num_drafts        # [B]
    p_n = target_probs.gather(1, n[:, None, None].expand(B, 1, V)).squeeze(1)  # [B, V] row n
    if K > 0:
        i = n.clamp_max(K - 1)[:, None]  # [B, 1] rejected row (junk if bonus)
        if draft_probs is None:
            q_n = torch.zeros_like(p_n).scatter_(1, x.gather(1, i), 1.0)      # [B, V] one-hot draft
        else:
            q_n = draft_probs.gather(1, i[..., None].expand(B, 1, V)).squeeze(1)
        dist = torch.where(is_bonus[:, None], p_n, residual_distribution(p_n, q_n))
    else:
        dist = p_n
    pos = first_position + n                        # [B] position of the next token
    state = torch.where(is_bonus, _salt_state(SALT_TARGET), _salt_state(SALT_RESIDUAL))  # [B]
    u_next = _uniform_from_state(state, seed, pos)  # [B]
    return n, _inverse_cdf(dist, u_next)


def verify(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
           draft_probs: torch.Tensor | None, num_drafts: torch.Tensor, st: SamplingTensors,
           first_position: torch.Tensor, target_block_mass: torch.Tensor | None = None
           ) -> VerifyResult:
    """Verify a batch of requests with a variable number of (right-padded) drafts each.

    target_probs   Float[B, K+1, V]  row j: target distribution of the token at first_position + j
    draft_tokens   Long[B, K]        draft for first_position + j; ignored beyond num_drafts[b]
    draft_probs    Float[B, K, V]    the distribution each draft was sampled from, or None for
                                     deterministic drafts (greedy or n-gram: q one-hot at the draft)
    num_drafts     Long[B]           0..K (0: a plain decode step, sampling the target at row 0)
    st             one row per request; first_position Long[B]
    target_block_mass  Float[B, K+1, nb]  target_probs' block sums (`distribution`), if known
    """
    # no drafts in the batch (plain decoding, first tokens): rejection sampling reduces to this
    if draft_tokens.shape[1] == 0:
        token = sample(target_probs[:, 0], st, first_position, SALT_TARGET,
                       None if target_block_mass is None else target_block_mass[:, 0])
        return VerifyResult(num_accepted=torch.zeros_like(token), next_token=token,
                            is_bonus=torch.ones_like(token, dtype=torch.bool))
    if st.all_greedy:
        n, token = verify_greedy(target_probs, draft_tokens, num_drafts)
    else:
        n, token = verify_rejection(target_probs, draft_tokens, draft_probs, num_drafts, st.seed,
                                    first_position)
        if st.any_greedy:
            n_g, token_g = verify_greedy(target_probs, draft_tokens, num_drafts)
            n, token = torch.where(st.greedy, n_g, n), torch.where(st.greedy, token_g, token)
    return VerifyResult(num_accepted=n, next_token=token, is_bonus=n == num_drafts)


# ---- logits in, tokens out: what the engine calls ------------------------------------------------

def _sample_drafts(logits, st, positions, store, rows, columns):
    probs, block_mass = distribution(logits, st)
    if store is not None:
        store[rows, columns] = probs
    # the salt is a constant: as an argument torch.compile would make it a symbolic int
    return sample(probs, st, positions, SALT_DRAFT, block_mass)


def _verify_logits(logits, draft_tokens, draft_probs, num_drafts, st, first_position, draft_rows):
    if draft_rows is not None:
        draft_probs = draft_probs[draft_rows, :draft_tokens.shape[1]]
    probs, block_mass = distribution(logits, st.per_position())
    out = verify(probs, draft_tokens, draft_probs, num_drafts, st, first_position, block_mass)
    return out.num_accepted, out.next_token, out.is_bonus


# kernels.compile_sampling() fuses a step's dozens of small kernels into a few (the hash stays
# exact).
_fused = {"drafts": _sample_drafts, "verify": _verify_logits}


def use_eager_sampling() -> None:
    """Restore the eager reference draft sampling and verification."""
    _fused.update(drafts=_sample_drafts, verify=_verify_logits)


def sample_drafts(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor,
                  store: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                  columns: torch.Tensor | None = None) -> torch.Tensor:
    """Draft tokens: logits Float[N, V], positions Long[N] (where each draft goes) -> tokens
    Long[N]; with `store` Float[R, C, V], each draft's distribution q goes to store[rows[i],
    columns[i]] (rows, columns Long[N]), written where it is computed (no [N, V] tensor between)."""
    return _fused["drafts"](logits, st, positions, store, rows, columns)


def verify_logits(logits: torch.Tensor, draft_tokens: torch.Tensor,
                  draft_probs: torch.Tensor | None, num_drafts: torch.Tensor, st: SamplingTensors,
                  first_position: torch.Tensor,
                  draft_rows: torch.Tensor | None = None) -> VerifyResult:
    """`verify` from the target's logits Float[B, K+1, V] (st: one row per request). With
    `draft_rows` Long[B], draft_probs is a store Float[R, >= K, V] whose rows draft_rows hold the
    requests' draft distributions, read where they are used (no [B, K, V] copy)."""
    return VerifyResult(*_fused["verify"](logits, draft_tokens, draft_probs, num_drafts, st,
                                          first_position, draft_rows))
