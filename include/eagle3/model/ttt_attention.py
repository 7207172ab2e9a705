"""The TTT attention kernel: what TTTAttention (eagle3/model/drafter.py) computes, in memory linear in the length T.

Training-time test, step i (0-based), one query q[t] per position t, one softmax (scale 1/sqrt(head_dim)) over
step 0's keys/values causally (k0[s], v0[s] for s <= t) and, at its own position only, steps 1..i's (kj[t], vj[t]).
`dense_ttt_attention` computes this densely, in O(T^2): the reference for tests and bench/ttt_memory.py.
`ttt_attention` equals it to rounding in O(T), forward and backward: a fused causal kernel over step 0, merged with
the per-position scores by log-sum-exp, and that kernel's own backward given the merged output and lse.

The causal part runs on one of three cores, chosen per call by `causal_core`:
  FusedCPU   torch's CPU flash-attention kernel (aten::_scaled_dot_product_flash_attention_for_cpu): on CPU, and in
             the tests
  FusedCUDA  torch's CUDA flash-attention kernel (aten::_scaled_dot_product_flash_attention) where torch says flash
             can run (bf16/fp16, head_dim <= 256, sm80+); RuntimeError on a torch whose lse is not [B, heads, T]
  Blocked    plain PyTorch by BLOCK queries at a time: anywhere else
tests/test_model.py checks FusedCPU and Blocked against the dense reference, and FusedCUDA's calls on meta tensors.

`ttt_attention_rows` is the same for queries at some positions of the batch only (Eagle3Draft.step_rows), the
causal core cropped to the rows and positions with a query.

Why: docs/decisions/2026-12-04-ttt-attention-linear-memory.md.
"""

from __future__ import annotations

import contextlib

import torch

BLOCK = 128  # queries per block in the Blocked core: its scores are [B, heads, BLOCK, T] at a time


# -- the reference: dense scores, O(T^2) -------------------------------------------------------


def dense_ttt_attention(q: torch.Tensor, keys, values, scale: float) -> torch.Tensor:
    """TTTAttention's math written densely, O(T^2) memory: q, keys[j], values[j] are [B, heads, T, d]."""
    t = q.shape[-2]
    k0, v0 = keys[0], values[0]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]  # [B, h, T, T]
    scores += [((q * kj).sum(-1, keepdim=True) * scale) for kj in keys[1:]]  # [B, h, T, 1] each
    weights = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
    out = weights[..., :t] @ v0
    for j, vj in enumerate(values[1:], start=t):
        out = out + weights[..., j : j + 1] * vj
    return out


# -- causal cores: (out, lse) forward, and the backward given any (out, lse) -------------------


class FusedCPU:
    name = "fused-cpu"

    @staticmethod
    def forward(q, k, v, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()

    @staticmethod
    def backward(dout, q, k, v, out, lse, scale, extra):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale
        )


class FusedCUDA:
    name = "fused-cuda"

    @staticmethod
    def forward(q, k, v, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )
        if lse.shape != q.shape[:-1]:  # the merge reads it as [B, heads, T]; a torch that pads it would misalign
            raise RuntimeError(
                f"torch {torch.__version__}: flash attention's logsumexp is {tuple(lse.shape)} for "
                f"queries {tuple(q.shape)}, not [B, heads, T] as this module merges it; "
                "set eagle3.model.ttt_attention.causal_core to return Blocked, or use a torch it was "
                "written for (2.13/2.14)"
            )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    @staticmethod
    def backward(dout, q, k, v, out, lse, scale, extra):
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
        )


class Blocked:
    """Causal attention by blocks of BLOCK queries, each against the keys up to its last query."""

    name = "blocked"

    @staticmethod
    def _scores(q, k, start, end, scale):
        s = q[..., start:end, :].float() @ k[..., :end, :].float().transpose(-1, -2) * scale
        future = torch.arange(end, device=q.device)[None, :] > torch.arange(start, end, device=q.device)[:, None]
        return s.masked_fill(future, float("-inf"))

    @classmethod
    def forward(cls, q, k, v, scale):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for start in range(0, q.shape[-2], BLOCK):
            end = min(start + BLOCK, q.shape[-2])
            s = cls._scores(q, k, start, end, scale)
            lse[..., start:end] = s.logsumexp(-1)
            out[..., start:end, :] = (torch.exp(s - lse[..., start:end, None]) @ v[..., :end, :].float()).to(q.dtype)
        return out, lse, ()

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, scale, extra):
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
        delta = (dout.float() * out.float()).sum(-1)  # D = rowsum(dout * out)
        for start in range(0, q.shape[-2], BLOCK):
            end = min(start + BLOCK, q.shape[-2])
            p = torch.exp(cls._scores(q, k, start, end, scale) - lse[..., start:end, None])
            g = dout[..., start:end, :].float()
            dv[..., :end, :] += p.transpose(-1, -2) @ g
            ds = p * (g @ v[..., :end, :].float().transpose(-1, -2) - delta[..., start:end, None]) * scale
            dq[..., start:end, :] = ds @ k[..., :end, :].float()
            dk[..., :end, :] += ds.transpose(-1, -2) @ q[..., start:end, :].float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The fused core where torch has one for these tensors, else Blocked."""
    if q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return FusedCPU
    if q.device.type == "cuda" and torch.backends.cuda.can_use_flash_attention(
        torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, False)
    ):
        return FusedCUDA
    return Blocked


# -- TTT attention: the causal part merged with the per-position part --------------------------


def _no_autocast(device_type: str):
    """The dtypes are the inputs' (bf16 under GPU autocast), in forward as in backward (which runs without it)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core, scale, q, k0, v0, *later):
        with _no_autocast(q.device.type):
            out0, lse0, extra = core.forward(q, k0, v0, scale)
            n = len(later) // 2
            if n:
                qf = q.float()
                s = [(qf * kj.float()).sum(-1) * scale for kj in later[:n]]  # [B, h, T] each
                lse = torch.logsumexp(torch.stack([lse0, *(sj.to(lse0.dtype) for sj in s)], -1), -1)
                merged = torch.exp(lse0 - lse)[..., None] * out0.float()
                for sj, vj in zip(s, later[n:]):
                    merged = merged + torch.exp(sj - lse)[..., None] * vj.float()
                out = merged.to(q.dtype)
            else:
                out, lse = out0, lse0
            lse = lse.contiguous()
        ctx.core, ctx.scale, ctx.extra = core, scale, extra
        ctx.save_for_backward(q, k0, v0, out, lse, *later)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k0, v0, out, lse, *later = ctx.saved_tensors
        n, scale = len(later) // 2, ctx.scale
        dout = dout.contiguous()
        dq, dk0, dv0 = ctx.core.backward(dout, q, k0, v0, out, lse, scale, ctx.extra)
        dks, dvs = [], []
        if n:
            qf, g = q.float(), dout.float()
            delta = (g * out.float()).sum(-1)
            dqf = dq.float()
            for kj, vj in zip(later[:n], later[n:]):
                kf = kj.float()
                p = torch.exp((qf * kf).sum(-1) * scale - lse)  # the weight of kj[t] for query t
                ds = p * ((g * vj.float()).sum(-1) - delta) * scale
                dqf = dqf + ds[..., None] * kf
                dks.append((ds[..., None] * qf).to(kj.dtype))
                dvs.append((p[..., None] * g).to(vj.dtype))
            dq = dqf.to(q.dtype)
        return None, None, dq, dk0, dv0, *dks, *dvs


def ttt_attention(q: torch.Tensor, keys, values, scale: float, core=None) -> torch.Tensor:
    """Step len(keys)-1's attention output [B, heads, T, d] for queries q [B, heads, T, d]; keys[j], values[j]
    are step j's, shaped like q (KV heads already repeated). Equal to dense_ttt_attention to rounding, in O(T)
    memory for forward and backward. `core`: the causal core (default: causal_core's choice)."""
    core = core or causal_core(q, keys[0], values[0])
    return _TTTAttention.apply(core, scale, q, keys[0], values[0], *keys[1:], *values[1:])


# -- the same at some positions of the batch only ----------------------------------------------


def _spread(x: torch.Tensor, index: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """Rows [N, heads, ...] at flat positions `index` (b * T + t) -> [B, heads, T, ...], zeros elsewhere."""
    full = x.new_zeros(b * t, *x.shape[1:]).index_copy_(0, index, x)
    return full.view(b, t, *x.shape[1:]).transpose(1, 2)


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B, heads, T, ...] -> its rows [N, heads, ...] at flat positions `index`."""
    return x.transpose(1, 2).flatten(0, 1)[index]


def _crop(index: torch.Tensor, k0: torch.Tensor):
    """The part of the batch the causal core needs for queries at flat positions `index`: the batch rows that hold
    one, and the positions up to the last one (the keys after it are never attended). Returns (those rows, that
    width, the queries' flat positions in the cropped batch); (None, T, index) when that is the whole batch."""
    b, t = k0.shape[0], k0.shape[2]
    row = index // t
    used = torch.unique_consecutive(row)
    width = int((index % t).max()) + 1 if len(index) else 1
    if len(used) == b and width == t:
        return None, t, index
    return used, width, torch.searchsorted(used, row) * width + index % t


def _merge_rows(q, out0, lse0, later_k, later_v, scale):
    """_TTTAttention's merge at rows, the later steps' keys and values stacked [N, steps, heads, d]: the same
    arithmetic in a few operations for all of them rather than a few per step (a TTT step is many small operations
    on CPU). Returns (out, lse)."""
    if later_k is None:
        return out0, lse0
    s = (q.float()[:, None] * later_k.float()).sum(-1) * scale  # [N, steps, heads]
    lse = torch.logsumexp(torch.cat([lse0[:, None], s.to(lse0.dtype)], 1), 1)
    merged = torch.exp(lse0 - lse)[..., None] * out0.float() + (
        torch.exp(s - lse[:, None])[..., None] * later_v.float()
    ).sum(1)
    return merged.to(q.dtype), lse


def _later_backward_rows(dout, q, out, lse, dq, later_k, later_v, scale):
    """_TTTAttention's backward of that merge, stacked likewise: (dq with their part added, dk, dv)."""
    if later_k is None:
        return dq, None, None
    qf, g, kf, vf = q.float()[:, None], dout.float(), later_k.float(), later_v.float()
    delta = (g * out.float()).sum(-1)
    p = torch.exp((qf * kf).sum(-1) * scale - lse[:, None])  # the weight of each later key for its query
    ds = p * ((g[:, None] * vf).sum(-1) - delta[:, None]) * scale
    dq = (dq.float() + (ds[..., None] * kf).sum(1)).to(q.dtype)
    return dq, (ds[..., None] * qf).to(later_k.dtype), (p[..., None] * g[:, None]).to(later_v.dtype)


class _TTTAttentionRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core, scale, index, q, k0, v0, later_k, later_v):
        used, width, local = _crop(index, k0)
        k, v = (k0, v0) if used is None else (k0[used, :, :width], v0[used, :, :width])
        with _no_autocast(q.device.type):
            out0, lse0, extra = core.forward(_spread(q, local, k.shape[0], width), k, v, scale)
            out, lse = _merge_rows(q, _gather(out0, local), _gather(lse0, local), later_k, later_v, scale)
        ctx.core, ctx.scale, ctx.extra, ctx.crop = core, scale, extra, (used, width, local)
        ctx.save_for_backward(q, k0, v0, out, lse, later_k, later_v)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k0, v0, out, lse, later_k, later_v = ctx.saved_tensors
        used, width, local = ctx.crop
        k, v = (k0, v0) if used is None else (k0[used, :, :width], v0[used, :, :width])
        b = k.shape[0]
        # The causal core's backward over the (cropped) batch, given the merged out and lse at the query rows.
        # Elsewhere q, dout and out are 0, so those rows add nothing to dk0 and dv0 (P * (dP - delta) = 0 there).
        dq, dk, dv = ctx.core.backward(
            _spread(dout.contiguous(), local, b, width),
            _spread(q, local, b, width),
            k,
            v,
            _spread(out, local, b, width),
            _spread(lse, local, b, width).contiguous(),
            ctx.scale,
            ctx.extra,
        )
        if used is not None:
            dk0, dv0 = torch.zeros_like(k0), torch.zeros_like(v0)
            dk0[used, :, :width], dv0[used, :, :width] = dk, dv
            dk, dv = dk0, dv0
        dq, dlater_k, dlater_v = _later_backward_rows(
            dout, q, out, lse, _gather(dq, local), later_k, later_v, ctx.scale
        )
        return None, None, None, dq, dk, dv, dlater_k, dlater_v


def ttt_attention_rows(
    q: torch.Tensor,
    index: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    later_k: torch.Tensor | None,
    later_v: torch.Tensor | None,
    scale: float,
    core=None,
) -> torch.Tensor:
    """ttt_attention for queries at some positions of the batch only: q [N, heads, d] at flat positions `index`
    (b * T + t); k0, v0 step 0's keys/values over the whole batch [B, heads, T, d]; later_k, later_v steps 1..i's at
    the queries' own positions, stacked [N, i, heads, d] (None at step 0). Returns [N, heads, d]: ttt_attention's
    output at those positions. The fused causal core still runs in the batch's layout (the queries spread, zeros
    elsewhere), cropped to the batch rows with a query and the positions up to the last one; the per-position part,
    forward and backward, only at the N rows."""
    core = core or causal_core(k0, k0, v0)
    return _TTTAttentionRows.apply(core, scale, index, q, k0, v0, later_k, later_v)
