"""Routing helpers shared by the MoE methods (MoD, MoLE, RoleMerge diagnostics).

Everything here is a small pure function on tensors:

    probs, idx, gates = topk_gates(logits, k)            # fp32 softmax, top-k, renormalised gates
    aux = load_balance_loss(probs, idx, mask)            # Mixtral/top-k convention: = k at uniform routing
    aux = load_balance_loss(probs, idx, mask, rank_mean)  # the same over a data-parallel run's global batch
    zl = z_loss(logits, mask)                            # mean logsumexp^2
    x_route = window_mean(x, W, mask)                    # causal mean of the last W non-pad tokens
    x_route = region_mean(x, W, mask)                    # causal mean inside blocks of W non-pad tokens
    rate = switch_rate(top1, mask)                       # fraction of adjacent pairs whose top-1 differs

Masks are bool (or 0/1) tensors with True = real token, False = padding. Padding never
contributes to a mean, a count or a loss. Window and region positions are counted in
*non-pad* tokens, so a left-padded row gets exactly the routing inputs of the same row
without padding (what batched generation needs).
"""
import torch
import torch.distributed as dist


def topk_gates(logits, k, noise_std=0.0, training=False):
    """Top-k routing with renormalised gates (MoD eq. 3-4; the usual top-k MoE router).

    logits: [..., E] (any dtype; the softmax runs in fp32).
    k: experts kept per token (1 <= k <= E).
    noise_std: std of Gaussian noise added to the logits, only when `training` is True.
    Returns probs fp32 [..., E] (softmax over all experts), idx long [..., k] (ranked,
    largest first), gates fp32 [..., k] = probs[idx] / sum(probs[idx]) (sum to 1).
    Raises ValueError if k is out of range."""
    E = logits.shape[-1]
    if not 1 <= k <= E:
        raise ValueError(f"top-k needs 1 <= k <= E, got k={k}, E={E}")
    logits = logits.float()
    if training and noise_std > 0:
        logits = logits + noise_std * torch.randn_like(logits)
    probs = logits.softmax(-1)
    top, idx = probs.topk(k, dim=-1)  # softmax is monotone: same order as the logits
    gates = top / top.sum(-1, keepdim=True)
    return probs, idx, gates


def _flat_mask(mask, n, device):
    if mask is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    return mask.reshape(-1).to(device=device).bool()


def rank_mean(t):
    """Mean of a tensor over the data-parallel processes (all-reduce sum / world size), without
    gradient: the `reduce` of the aux losses below in a DDP / FSDP run (the trainers pass it
    when WORLD_SIZE > 1). The process group must be initialised."""
    t = t.detach().float().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _count(n, reduce):
    """A token count as the denominator of a mean: the global batch's (mean over ranks) when
    `reduce` is given, and 1 where the count is 0 (the sum over it is 0 too)."""
    n = n.float() if reduce is None else reduce(n.float())
    return torch.where(n > 0, n, torch.ones_like(n))


def load_balance_loss(probs, idx, mask=None, reduce=None):
    """Top-k load-balancing loss, Mixtral convention: E * sum_i f_i * P_i.

    f_i = fraction of (non-pad) tokens that have expert i among their top-k (so sum_i f_i = k),
    P_i = mean router probability of expert i over (non-pad) tokens. At uniform routing
    (P_i = 1/E, every expert chosen equally often) the value is exactly k; the Switch
    Transformer convention (divide by k) would give 1. f carries no gradient (argmax),
    the gradient flows through P.
    probs: [N, E] (or [..., E], flattened); idx: [N, k] long; mask: [N] bool or None.
    reduce: None, or `rank_mean` in a data-parallel run: f and the token count are then those
    of the global batch, and P_i = (this rank's probability sum) / (global tokens / world), so
    the mean over ranks of the value (and the gradient DDP averages) is the loss of the
    global batch, what one process computes on it.
    Returns a scalar fp32 tensor (0 if every token is padding)."""
    E = probs.shape[-1]
    probs, idx = probs.reshape(-1, E).float(), idx.reshape(-1, idx.shape[-1])
    m = _flat_mask(mask, probs.shape[0], probs.device)
    n = _count(m.sum(), reduce)
    chosen = torch.zeros_like(probs).scatter_(1, idx, 1.0)  # [N, E] one-hot of the top-k
    hits = (chosen * m[:, None]).sum(0)  # [E]
    f = (hits if reduce is None else reduce(hits)) / n  # [E], no gradient either way
    P = (probs * m[:, None]).sum(0) / n  # [E]
    return E * (f * P).sum()


def z_loss(logits, mask=None, reduce=None):
    """Router z-loss (ST-MoE): mean over (non-pad) tokens of logsumexp(logits)^2, in fp32.

    logits: [..., E]; mask: [...] bool or None; reduce: as in `load_balance_loss` (the mean
    over the global batch's tokens). Returns a scalar (0 if all padding)."""
    lse = torch.logsumexp(logits.float(), dim=-1).reshape(-1)
    m = _flat_mask(mask, lse.shape[0], lse.device)
    return (lse.square() * m).sum() / _count(m.sum(), reduce)


def _rank_sums(x, mask):
    """Shared machinery of window/region means.

    Returns (rank [B,T] long = number of non-pad tokens up to and including t,
    S [B,T+1,D] with S[:, j] = sum of the first j non-pad inputs, in float64 (float32 on MPS,
    which has no float64)). A window mean is a difference of two prefix sums: summed in fp32, its
    rounding error would grow with the prefix (t eps sum|x|, not W eps), so a long context would
    route on noise that the W-token ring of cached decoding does not have."""
    B, T, D = x.shape
    acc = torch.float32 if x.device.type == "mps" else torch.float64
    m = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask.to(x.device).bool()
    xf = x.to(acc) * m[..., None]
    cs = xf.cumsum(1)  # [B,T,D] running sum over positions
    rank = m.long().cumsum(1)  # [B,T]
    # S[:, rank[t]] = cs[:, t] at non-pad t (the sum after that many real tokens); S[:, 0] = 0.
    # Pad positions write to the slot T (a dump slot) so they never overwrite a real entry.
    slot = torch.where(m, rank, torch.full_like(rank, T + 1))
    S = x.new_zeros(B, T + 2, D, dtype=acc)
    S.scatter_(1, slot[..., None].expand(B, T, D), cs)
    return rank, S[:, :T + 1]


def _ranged_mean(S, rank, lo, dtype):
    """Mean of the non-pad inputs with rank in (lo, rank]: (S[rank] - S[lo]) / (rank - lo)."""
    D = S.shape[-1]
    hi_sum = S.gather(1, rank[..., None].expand(*rank.shape, D))
    lo_sum = S.gather(1, lo[..., None].expand(*lo.shape, D))
    return ((hi_sum - lo_sum) / (rank - lo).clamp(min=1)[..., None]).to(dtype)


def window_mean(x, W, mask=None):
    """Causal sliding-window mean (MoD "momentum switching", x_route of eq. 2).

    x_route[b, t] = mean of the last W non-pad inputs x[b, s], s <= t (fewer at the start).
    Computed with cumulative sums in O(T): no loop over positions or window offsets.
    x: [B, T, D]; W: window size >= 1 (W = 1 returns x at non-pad positions);
    mask: [B, T] bool/0-1 or None. At a pad position the value is the mean of the window
    ending at the previous real token (zeros before the first one); it is never used.
    Returns [B, T, D] in x's dtype (sums in float64, see `_rank_sums`). Raises ValueError if W < 1."""
    if W < 1:
        raise ValueError(f"window size W must be >= 1, got {W}")
    rank, S = _rank_sums(x, mask)
    return _ranged_mean(S, rank, (rank - W).clamp(min=0), x.dtype)


def region_mean(x, W, mask=None, offset=None):
    """Causal mean inside fixed blocks of W non-pad tokens (MoD "region" granularity).

    Non-pad tokens are numbered 0, 1, 2, ... (plus `offset`); block j holds numbers
    [jW, (j+1)W). x_route at a token is the mean of the tokens of its block up to and
    including itself, so the mean resets at every block start.
    x: [B, T, D]; W >= 1; mask: [B, T] or None; offset: [B] long or int, the number of
    non-pad tokens that came before x[:, 0] (cached decoding; the earlier tokens of the
    current block must then be included in x, marked real). Returns [B, T, D]."""
    if W < 1:
        raise ValueError(f"region size W must be >= 1, got {W}")
    rank, S = _rank_sums(x, mask)
    off = torch.as_tensor(0 if offset is None else offset, device=x.device).long().reshape(-1, 1)
    absolute = rank - 1 + off  # number of the token (of the last real token at pad positions)
    start = absolute.clamp(min=0) - absolute.clamp(min=0) % W  # first number of its block
    lo = (start - off).clamp(min=0)  # as a local rank
    return _ranged_mean(S, rank, torch.minimum(lo, rank), x.dtype)


def switch_rate(top1, mask=None):
    """Fraction of adjacent token pairs (both non-pad) whose top-1 expert differs.

    top1: [B, T] long; mask: [B, T] or None. Returns a Python float (0.0 if no pair)."""
    same_valid = torch.ones_like(top1[:, 1:], dtype=torch.bool)
    if mask is not None:
        m = mask.bool()
        same_valid = m[:, 1:] & m[:, :-1]
    n = same_valid.sum().item()
    if n == 0:
        return 0.0
    return ((top1[:, 1:] != top1[:, :-1]) & same_valid).sum().item() / n
