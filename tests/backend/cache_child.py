"""Run in a fresh process by test_compile_cache.py: compile a tiny MLP with the mxfp8 backend
(options from argv[1] as JSON), run one forward and backward, save the output and gradients to
argv[2], and print one JSON line with torch's cache counters and the graph's report."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import mxcompile

WIDTH, HIDDEN, BATCH = 64, 128, 64


class TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def main() -> None:
    options, out = json.loads(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    model = TinyMLP()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = torch.compile(model, backend="mxfp8", options=options)(x)
    y.sum().backward()
    torch.save({"y": y.detach(), "x.grad": x.grad, **{n: p.grad for n, p in model.named_parameters()}}, out)
    report = mxcompile.report_of(model)[-1]
    print("RESULT " + json.dumps({
        "counters": {f"{g}.{k}": v for g in ("inductor", "aot_autograd") for k, v in counters[g].items()},
        "decisions": [(d.node, d.decision, d.reason) for d in report.decisions],
        "summary": report.summary(),
    }))


if __name__ == "__main__":
    main()
