"""A procedural multi-view scene: reference Gaussians on textured surfaces, seen from cameras
on a sphere around it. Nothing is downloaded; the same seed gives the same scene."""
import math

import torch

from renderer import rasterize


def _texture(p: torch.Tensor, freq: float) -> torch.Tensor:
    """High-frequency colour pattern of a 3D position: stripes, checks and a colour wash."""
    x, y, z = p.unbind(-1)
    check = torch.sign(torch.sin(freq * x) * torch.sin(freq * y) * torch.sin(freq * z))
    r = 0.5 + 0.35 * torch.sin(2.1 * freq * x + 1.3 * z) + 0.15 * check
    g = 0.5 + 0.35 * torch.sin(1.7 * freq * y + 2.0 * x) - 0.15 * check
    b = 0.5 + 0.35 * torch.sin(2.9 * freq * z + 0.7 * y) + 0.1 * check
    fine = 0.12 * torch.sin(4.3 * freq * (x + y - z))  # detail a few pixels wide
    return (torch.stack([r, g, b], -1) + fine[:, None]).clamp(0.02, 0.98)


def _surface_points(n: int, gen: torch.Generator) -> torch.Tensor:
    """n points spread over a sphere, a torus, a box and a ground disc."""
    parts = []
    n_sph, n_tor, n_box = int(0.3 * n), int(0.25 * n), int(0.2 * n)
    n_gnd = n - n_sph - n_tor - n_box
    v = torch.randn(n_sph, 3, generator=gen)
    parts.append(0.55 * v / v.norm(dim=-1, keepdim=True) + torch.tensor([0.0, 0.0, 0.55]))
    u, w = torch.rand(n_tor, generator=gen) * 2 * math.pi, torch.rand(n_tor, generator=gen) * 2 * math.pi
    R, r = 0.45, 0.14
    parts.append(torch.stack([(R + r * torch.cos(w)) * torch.cos(u) + 0.75, (R + r * torch.cos(w)) * torch.sin(u) - 0.6,
                              r * torch.sin(w) + 0.3], -1))
    q = torch.rand(n_box, 3, generator=gen) * 2 - 1
    face = torch.randint(0, 3, (n_box,), generator=gen)
    q[torch.arange(n_box), face] = torch.sign(q[torch.arange(n_box), face])
    parts.append(q * 0.3 + torch.tensor([-0.8, -0.4, 0.3]))
    rad = 1.6 * torch.sqrt(torch.rand(n_gnd, generator=gen))
    ang = torch.rand(n_gnd, generator=gen) * 2 * math.pi
    parts.append(torch.stack([rad * torch.cos(ang), rad * torch.sin(ang), torch.zeros(n_gnd)], -1))
    return torch.cat(parts)


def reference_gaussians(n: int, seed: int = 0) -> dict:
    """Activated parameters (means, quats, scales, opacities, colours) of the reference scene."""
    gen = torch.Generator().manual_seed(seed)
    means = _surface_points(n, gen)
    spacing = math.sqrt(12.0 / n)  # ~ the mean gap between points on ~12 square units of surface
    scales = spacing * torch.exp(0.3 * torch.randn(n, 3, generator=gen)) * torch.tensor([1.0, 1.0, 0.3])
    return dict(means=means, quats=torch.randn(n, 4, generator=gen), scales=scales,
                opacities=0.6 + 0.39 * torch.rand(n, generator=gen), colors=_texture(means, 9.0))


def look_at(eye: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """World-to-camera 4x4 (OpenCV: x right, y down, z forward) for a camera at eye."""
    f = target - eye
    f = f / f.norm()
    up = torch.tensor([0.0, 0.0, 1.0])
    right = torch.linalg.cross(f, up)
    right = right / right.norm()
    down = torch.linalg.cross(f, right)
    R = torch.stack([right, down, f])
    V = torch.eye(4)
    V[:3, :3], V[:3, 3] = R, -R @ eye
    return V


def orbit_cameras(n: int, width: int, height: int, radius: float = 3.2, fov_deg: float = 55.0):
    """n cameras on a Fibonacci spiral over the upper part of a sphere, all looking at the
    scene centre. Returns viewmats [n,4,4], Ks [n,3,3]."""
    views = []
    golden = math.pi * (3 - math.sqrt(5))
    for i in range(n):
        z = 0.15 + 0.8 * (i + 0.5) / n  # elevations from ~9 to ~70 degrees
        rxy = math.sqrt(1 - z * z)
        eye = radius * torch.tensor([rxy * math.cos(golden * i), rxy * math.sin(golden * i), z])
        views.append(look_at(eye, torch.tensor([0.0, 0.0, 0.3])))
    f = 0.5 * width / math.tan(math.radians(fov_deg) / 2)
    K = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])
    return torch.stack(views), K.expand(n, 3, 3).clone()


@torch.no_grad()
def make_scene(n_ref: int, n_views: int, width: int, height: int, device, backend="auto",
               seed: int = 0, batch: int = 8) -> dict:
    """Reference Gaussians rendered from n_views cameras; every 8th view is held out."""
    ref = {k: v.to(device) for k, v in reference_gaussians(n_ref, seed).items()}
    viewmats, Ks = orbit_cameras(n_views, width, height)
    viewmats, Ks = viewmats.to(device), Ks.to(device)
    imgs = []
    for i in range(0, n_views, batch):
        img, _, _ = rasterize(ref["means"], ref["quats"], ref["scales"], ref["opacities"], ref["colors"],
                              viewmats[i:i + batch], Ks[i:i + batch], width, height, backend)
        imgs.append(img.clamp(0, 1))
    imgs = torch.cat(imgs)
    test = torch.arange(n_views, device=device) % 8 == 0
    return dict(ref=ref, images=imgs, viewmats=viewmats, Ks=Ks, width=width, height=height,
                train=torch.where(~test)[0], test=torch.where(test)[0])
