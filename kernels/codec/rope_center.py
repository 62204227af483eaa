"""RoPE removal fused with centering (encode) and mean-add fused with RoPE application (decode).

Cache layout (L, H, T, D) per sequence; feature layout (T, p) with p = L * H * D in layer, head,
dim order. cos/sin are (T, R) float32 tables for the tokens' positions (R = rotary dims <= D,
attention scaling folded in, as RopeSpec.cos_sin gives them). Layout "half" pairs dim d with
d +- R/2 (HF rotate_half); "interleaved" pairs 2i with 2i+1. Removal divides by c^2 + s^2 so it
inverts the scaled rotation exactly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_center_kernel(x_ptr, cos_ptr, sin_ptr, mean_ptr, out_ptr, T, H, p,
                        sxl, sxh, sxt, sxd, sol, soh, sot, sod,
                        D: tl.constexpr, R: tl.constexpr, D_P2: tl.constexpr, BLOCK_T: tl.constexpr,
                        HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, RESTORE: tl.constexpr):
    pid_t = tl.program_id(0)
    lh = tl.program_id(1)
    layer = lh // H
    h = lh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    mask = (t < T) & (d < D)
    x_base = x_ptr + layer * sxl + h * sxh + t * sxt
    col = lh * D + d
    x = tl.load(x_base + d * sxd, mask=mask, other=0.0).to(tl.float32)
    mu = tl.load(mean_ptr + col, mask=d < D, other=0.0)
    if RESTORE:
        x = x + mu
    if HAS_ROPE:
        if INTERLEAVED:
            pd = tl.where(d < R, d ^ 1, d)
            first = (d % 2) == 0
        else:
            pd = tl.where(d < R // 2, d + R // 2, tl.where(d < R, d - R // 2, d))
            first = d < R // 2
        rmask = mask & (d < R)
        c = tl.load(cos_ptr + t * R + d, mask=rmask, other=1.0)
        s = tl.load(sin_ptr + t * R + d, mask=rmask, other=0.0)
        xp = tl.load(x_base + pd * sxd, mask=mask, other=0.0).to(tl.float32)
        if RESTORE:
            xp = xp + tl.load(mean_ptr + lh * D + pd, mask=d < D, other=0.0)
            x = x * c + tl.where(first, -1.0, 1.0) * xp * s
        else:
            x = tl.math.div_rn(x * c + tl.where(first, 1.0, -1.0) * xp * s, c * c + s * s)
    if not RESTORE:
        x = x - mu
    tl.store(out_ptr + layer * sol + h * soh + t * sot + d * sod, x.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
            mean: torch.Tensor, layout: str, restore: bool, cache_shape: tuple[int, int, int, int]) -> None:
    L, H, T, D = cache_shape
    p = L * H * D
    R = cos.shape[1] if cos is not None else 0
    # (T, p) features seen as (L, H, T, D) strides.
    feat = x if restore else out
    fl, fh, ft, fd = H * D * feat.stride(1), D * feat.stride(1), feat.stride(0), feat.stride(1)
    xs = (fl, fh, ft, fd) if restore else tuple(x.stride())
    os_ = tuple(out.stride()) if restore else (fl, fh, ft, fd)
    mean = mean.to(torch.float32).contiguous()
    cos = cos.to(torch.float32).contiguous() if cos is not None else mean
    sin = sin.to(torch.float32).contiguous() if sin is not None else mean
    block_t = 16
    grid = (triton.cdiv(T, block_t), L * H)
    _rope_center_kernel[grid](x, cos, sin, mean, out,
                              T, H, p, *xs, *os_, D=D, R=R, D_P2=triton.next_power_of_2(D), BLOCK_T=block_t,
                              HAS_ROPE=R > 0, INTERLEAVED=layout == "interleaved", RESTORE=restore)


def rope_center(cache: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, mean: torch.Tensor,
                layout: str = "half") -> torch.Tensor:
    """Triton: cache (L, H, T, D) any float dtype -> (T, p) float32 = remove_rope(cache) - mean."""
    L, H, T, D = cache.shape
    out = torch.empty(T, L * H * D, dtype=torch.float32, device=cache.device)
    if T:
        _launch(cache, out, cos, sin, mean, layout, False, (L, H, T, D))
    return out


def rope_restore(feat: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, mean: torch.Tensor,
                 out: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Triton: feat (T, p) float32 -> writes apply_rope(feat + mean) into out (L, H, T, D), any strides/dtype."""
    if out.shape[2]:
        _launch(feat, out, cos, sin, mean, layout, True, tuple(out.shape))
    return out


def _partner(x: torch.Tensor, R: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Partner dims and the sign of removal for the rotated part x (..., R)."""
    if layout == "interleaved":
        partner = x.reshape(*x.shape[:-1], R // 2, 2).flip(-1).reshape(x.shape)
        sign = torch.tensor([1.0, -1.0], device=x.device).repeat(R // 2)
    else:
        partner = torch.cat([x[..., R // 2:], x[..., : R // 2]], dim=-1)
        sign = torch.cat([torch.ones(R // 2, device=x.device), -torch.ones(R // 2, device=x.device)])
    return partner, sign


def rope_center_reference(cache: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                          mean: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Plain torch: cache (L, H, T, D) -> (T, p) float32 = remove_rope(cache) - mean."""
    L, H, T, D = cache.shape
    x = cache.float()
    if cos is not None:
        R = cos.shape[1]
        rot = x[..., :R]
        partner, sign = _partner(rot, R, layout)
        rot = (rot * cos + sign * partner * sin) / (cos * cos + sin * sin)
        x = torch.cat([rot, x[..., R:]], dim=-1)
    return x.permute(2, 0, 1, 3).reshape(T, L * H * D) - mean


def rope_restore_reference(feat: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                           mean: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype,
                           layout: str = "half") -> torch.Tensor:
    """Plain torch: feat (T, p) float32 -> (L, H, T, D) `dtype` = apply_rope(feat + mean)."""
    L, H, T, D = shape
    x = (feat + mean).reshape(T, L, H, D).permute(1, 2, 0, 3)
    if cos is not None:
        R = cos.shape[1]
        rot = x[..., :R]
        partner, sign = _partner(rot, R, layout)
        x = torch.cat([rot * cos - sign * partner * sin, x[..., R:]], dim=-1)
    return x.to(dtype)
