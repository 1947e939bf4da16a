"""3D Gaussian rasterization: gsplat on CUDA, a dense pure-PyTorch fallback elsewhere.

Both take gsplat's arguments and conventions: means [N,3], quats [N,4] (wxyz, normalised
here), activated scales [N,3] and opacities [N], colours [N,D], world-to-camera viewmats
[C,4,4] (OpenCV: x right, y down, z forward), intrinsics Ks [C,3,3], pixel centres at +0.5.
Both return (colours [C,H,W,D], alphas [C,H,W,1], info) with the info keys gsplat's
DefaultStrategy reads (means2d [C,N,2] with its gradient, radii [C,N,2], width, height,
n_cameras, gaussian_ids), so one training loop and one strategy serve both.

The fallback follows gsplat's "classic" kernel: EWA projection with the clamped Jacobian and
eps2d = 0.3, near plane 0.01, alpha = min(0.999, o exp(-sigma)) dropped below 1/255,
depth-sorted front-to-back compositing that stops once transmittance would fall to 1e-4.
It is dense (every Gaussian at every pixel, no tiles): for tiny scenes only. Without tiles a
Gaussian also reaches pixels outside its 3-sigma box that gsplat's tile culling may skip.
"""
import importlib.util
import math
import os
import sys

import torch
import torch.nn.functional as F


def use_prebuilt_gsplat() -> None:
    """Load gsplat's CUDA extension from GSPLAT_CUDA_SO (a gsplat_cuda.so built earlier for this
    torch) instead of gsplat's JIT build. gsplat imports `gsplat.csrc` before compiling, and its
    JIT step re-runs ninja whenever the object files are absent, a full rebuild (~100 s on a
    16-core machine) even with the .so in place. Called before gsplat is first imported."""
    path = os.environ.get("GSPLAT_CUDA_SO")
    if not path or "gsplat.csrc" in sys.modules:
        return
    try:
        spec = importlib.util.spec_from_file_location("gsplat_cuda", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as e:
        print(f"GSPLAT_CUDA_SO={path} did not load ({e}); gsplat builds its own extension", flush=True)
        return
    sys.modules["gsplat.csrc"] = module


use_prebuilt_gsplat()

EPS2D = 0.3
NEAR = 0.01
ALPHA_MAX = 0.999
ALPHA_MIN = 1.0 / 255.0
T_MIN = 1e-4


def quat_to_rotmat(q: torch.Tensor) -> torch.Tensor:
    w, x, y, z = F.normalize(q, dim=-1).unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ], -1).reshape(q.shape[:-1] + (3, 3))


def project(means, quats, scales, viewmats, Ks, width, height):
    """EWA projection: (means2d [C,N,2], conics [C,N,3] (a, b, c of the inverse 2D
    covariance), depths [C,N], radii [C,N,2] int32, 0 where culled)."""
    R, t = viewmats[:, :3, :3], viewmats[:, :3, 3]
    pc = torch.einsum("cij,nj->cni", R, means) + t[:, None]  # [C,N,3]
    x, y, z = pc.unbind(-1)
    zs = z.clamp_min(NEAR)
    fx, fy = Ks[:, 0, 0, None], Ks[:, 1, 1, None]
    cx, cy = Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    # gsplat clamps the point the Jacobian is taken at to 30 % beyond the field of view
    tx = zs * torch.maximum(torch.minimum(x / zs, (width - cx) / fx + 0.15 * width / fx), -(cx / fx + 0.15 * width / fx))
    ty = zs * torch.maximum(torch.minimum(y / zs, (height - cy) / fy + 0.15 * height / fy),
                            -(cy / fy + 0.15 * height / fy))
    zero = torch.zeros_like(zs)
    J = torch.stack([fx / zs, zero, -fx * tx / zs ** 2, zero, fy / zs, -fy * ty / zs ** 2], -1)
    J = J.reshape(J.shape[:-1] + (2, 3))  # [C,N,2,3]
    M = quat_to_rotmat(quats) * scales[:, None, :]  # R S
    cov_w = M @ M.transpose(-1, -2)  # [N,3,3]
    cov_c = torch.einsum("cij,njk,clk->cnil", R, cov_w, R)
    cov2d = J @ cov_c @ J.transpose(-1, -2)
    a = cov2d[..., 0, 0] + EPS2D
    b = cov2d[..., 0, 1]
    c = cov2d[..., 1, 1] + EPS2D
    det = (a * c - b * b).clamp_min(1e-12)
    conics = torch.stack([c / det, -b / det, a / det], -1)
    means2d = torch.stack([fx * x / zs + cx, fy * y / zs + cy], -1)
    with torch.no_grad():
        rx = torch.ceil(3 * a.sqrt())
        ry = torch.ceil(3 * c.sqrt())
        mx, my = means2d.unbind(-1)
        ok = (z > NEAR) & (mx + rx > 0) & (mx - rx < width) & (my + ry > 0) & (my - ry < height)
        radii = torch.stack([rx, ry], -1).where(ok[..., None], torch.zeros_like(means2d)).to(torch.int32)
    return means2d, conics, z, radii


def rasterize_torch(means, quats, scales, opacities, colors, viewmats, Ks, width, height):
    means2d, conics, depths, radii = project(means, quats, scales, viewmats, Ks, width, height)
    C, N = depths.shape
    dev, dt = means.device, means.dtype
    ys, xs = torch.meshgrid(torch.arange(height, device=dev, dtype=dt) + 0.5,
                            torch.arange(width, device=dev, dtype=dt) + 0.5, indexing="ij")
    pix = torch.stack([xs.reshape(-1), ys.reshape(-1)], -1)  # [P,2]
    order = torch.argsort(depths.detach(), dim=1)  # front to back, per camera
    visible = torch.gather((radii > 0).all(-1), 1, order)  # [C,N]
    m2 = torch.gather(means2d, 1, order[..., None].expand(-1, -1, 2))
    co = torch.gather(conics, 1, order[..., None].expand(-1, -1, 3))
    op = opacities[order]  # [C,N]
    d = m2[:, :, None, :] - pix[None, None]  # [C,N,P,2]
    sigma = 0.5 * (co[..., 0, None] * d[..., 0] ** 2 + co[..., 2, None] * d[..., 1] ** 2) \
        + co[..., 1, None] * d[..., 0] * d[..., 1]
    alpha = (op[..., None] * torch.exp(-sigma)).clamp(max=ALPHA_MAX)
    keep = visible[..., None] & (sigma >= 0) & (alpha >= ALPHA_MIN)
    alpha = torch.where(keep, alpha, torch.zeros_like(alpha))
    T_after = torch.cumprod(1 - alpha, dim=1)
    T = torch.cat([torch.ones_like(T_after[:, :1]), T_after[:, :-1]], 1)
    # the kernel stops before a Gaussian that would push T to 1e-4 or below
    w = torch.where(T_after > T_MIN, alpha * T, torch.zeros_like(alpha))  # [C,N,P]
    col = colors[order] if colors.dim() == 2 else torch.gather(
        colors, 1, order[..., None].expand(-1, -1, colors.shape[-1]))
    out = torch.einsum("cnp,cnd->cpd", w, col).reshape(C, height, width, -1)
    alphas = w.sum(1).reshape(C, height, width, 1)
    info = dict(means2d=means2d, radii=radii, depths=depths, conics=conics, width=width,
                height=height, n_cameras=C, gaussian_ids=None)
    return out, alphas, info


def rasterize(means, quats, scales, opacities, colors, viewmats, Ks, width, height, backend="auto"):
    """Render C cameras. backend: "gsplat", "torch" or "auto" (gsplat on CUDA tensors)."""
    if backend == "auto":
        backend = "gsplat" if means.is_cuda else "torch"
    if backend == "gsplat":
        import gsplat
        return gsplat.rasterization(means, quats, scales, opacities, colors, viewmats, Ks,
                                    width, height, packed=False)
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'gsplat' or 'torch', got {backend!r}")
    return rasterize_torch(means, quats, scales, opacities, colors, viewmats, Ks, width, height)


def blend_weights(means, quats, scales, opacities, viewmats, Ks, width, height, backend="auto",
                  batch=8) -> torch.Tensor:
    """Per-Gaussian sum over all pixels of all cameras of alpha_i * T_i (the blending weight
    the 3DGS pruning papers rank by). The render is linear in the colours with coefficient
    alpha_i T_i, so the gradient of the summed render w.r.t. a zero colour channel is exactly
    that sum: one forward+backward per camera batch, any renderer."""
    acc = torch.zeros(means.shape[0], device=means.device, dtype=means.dtype)
    args = [a.detach() for a in (means, quats, scales, opacities)]
    for i in range(0, viewmats.shape[0], batch):
        col = torch.zeros(means.shape[0], 3, device=means.device, dtype=means.dtype, requires_grad=True)
        img, _, _ = rasterize(*args, col, viewmats[i:i + batch], Ks[i:i + batch], width, height, backend)
        (g,) = torch.autograd.grad(img[..., 0].sum(), col)
        acc += g[:, 0]
    return acc
