"""mxcompile.profiling.step_profile: operator classes, timing flags, and the Inductor option it
patches only for the duration of a profile."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mxcompile.profiling.step_profile import OTHER_OPERATOR_CLASS, StepProfile, classify_operator


@pytest.mark.parametrize(
    ("name", "op_class"),
    [("aten::mm", "GEMM"), ("graph_0_cpp_fused__to_copy_gelu_1", "Inductor fused kernels"),
     ("cpp_fused_0", "Inductor fused kernels"), ("aten::_to_copy", "copies and casts"),
     ("## Call CompiledFxGraph abc ##", "compiled-graph and autograd overhead"),
     ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
     ("mxcompile::attention", "mxcompile custom ops (not fused)"), ("aten::sum", OTHER_OPERATOR_CLASS)],
)
def test_classify_operator(name: str, op_class: str) -> None:
    assert classify_operator(name) == op_class


def test_step_profile_flags_noisy_timings() -> None:
    def profile(times: list[float]) -> StepProfile:
        return StepProfile("inductor", True, 1.0, times, None, None, [], [], {})

    assert profile([0.010, 0.011, 0.040]).noisy
    busy = StepProfile("mxfp8", True, 1.0, [0.01], None, None, [], [], {}, load_average=4.2, cpu_count=2)
    assert busy.machine_busy and not profile([0.01]).machine_busy
    quiet = profile([0.010, 0.011, 0.012])
    assert not quiet.noisy and quiet.min_step_s == 0.010 and quiet.median_step_s == 0.011


# Runs profile_training_step in a child process (it changes malloc's settings for the rest of
# its process) on an eager model (no compile: the test is about the option, not Inductor), and
# records the Inductor option each forward call sees.
_PATCH_PROBE = textwrap.dedent("""
    import json

    import torch
    import torch._inductor.config as inductor_config
    from torch import nn

    from mxcompile.profiling import step_profile

    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            seen.append(inductor_config.cpp.enable_kernel_profile)
            return self.linear(x)

    step_profile.compile_for_backend = lambda model, backend, config: model
    before = inductor_config.cpp.enable_kernel_profile
    profile = step_profile.profile_training_step(Probe(), (torch.randn(4, 8),), backend="inductor",
                                                 steps=2, warmup=1, autocast_bf16=False)
    print(json.dumps({"before": before, "seen": seen, "after": inductor_config.cpp.enable_kernel_profile,
                      "timed": len(profile.step_times_s)}))
""")


def test_kernel_profile_option_is_patched_only_while_profiling() -> None:
    done = subprocess.run([sys.executable, "-c", _PATCH_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] is False and result["after"] is False
    # 1 warm-up + 2 timed + 1 profiled + 2 for the peak resident set, all under the patch.
    assert result["seen"] == [True] * 6
    assert result["timed"] == 2
