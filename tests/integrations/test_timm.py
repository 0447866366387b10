"""timm vision models under the mxfp8 backend: a tiny ViT (timm's VisionTransformer, random
weights, 32x32 images in 8x8 patches) trains 2 steps with its GEMMs and attention in MX. The
graphs run eagerly (`recording_eager_backend`: the backend's rewrite and reports without
Inductor's compile time).

timm needs torchvision, and the registry's torchvision wheels are CUDA builds that do not load
beside the CPU torch (2.13.0+cpu) of the dev set-up, so timm is an extra of its own (pyproject's
`timm`) and this file is skipped where it does not import; `scripts/check_torch.sh` installs it
beside the registry's torch builds, where it runs."""

from __future__ import annotations

import math

import pytest
import torch

import mxcompile
from hf_zoo import assert_converted, kept_gemms, recording_eager_backend
from mxcompile.report import CONVERTED

try:
    import timm
except (ImportError, RuntimeError) as err:  # a torchvision that does not load raises RuntimeError
    pytest.skip(f"timm does not import here ({type(err).__name__}: {err}); install it with pip install '.[timm]' "
                "beside a CUDA build of torch", allow_module_level=True)

IMAGE, PATCH, WIDTH, DEPTH, HEADS, CLASSES, BATCH, STEPS = 32, 8, 64, 2, 2, 10, 8, 2


def test_vit_trains_in_mx() -> None:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE, patch_size=PATCH,
                              embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS, num_classes=CLASSES)
    # timm zero-initialises ViT's head, so the first loss is exactly ln(classes) whatever the
    # body computes; a random head makes the loss depend on it.
    torch.nn.init.normal_(model.head.weight, std=0.02)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
    compiled = torch.compile(model, backend=recording_eager_backend())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.blocks[0].mlp.fc1.weight.detach().clone()
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(compiled(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(loss) for loss in losses) and losses[0] != pytest.approx(math.log(CLASSES), abs=1e-6)
    assert not torch.equal(model.blocks[0].mlp.fc1.weight, before)

    reports = mxcompile.report_of(model)
    assert len(reports) == 1, [r.summary() for r in reports]
    report = reports[0]
    assert_converted(report)
    # Every block's projections (qkv, proj, fc1, fc2) in all three GEMMs of training, and attention.
    converted = {(d.module.split(".")[-1], d.kind) for d in report.decisions if d.decision == CONVERTED}
    for layer in ("qkv", "proj", "fc1", "fc2"):
        for kind in ("output", "input_grad", "weight_grad"):
            assert (layer, kind) in converted, (layer, kind, kept_gemms(report))
    assert any(d.kind == "attention" and d.decision == CONVERTED for d in report.decisions), kept_gemms(report)
