"""The FP4 recipes' typed configuration (issue 48): `Recipe`, the switches and their defaults per
recipe (`config.RECIPES`), validation naming the field and the accepted values, the per-role
operand format table, the high-precision layer rule, and MXConfig's defaults unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from mxcompile.config import (
    NVFP4_HIGH_PRECISION_FRACTION,
    AttentionMode,
    GemmRole,
    MXConfig,
    OperandKind,
    Recipe,
)
from mxcompile.numerics.formats import MXFP4, MXFP8_E4M3, NVFP4

# MXConfig's defaults before issue 48's fields: they must not change.
MXFP8_DEFAULTS = {
    "forward_elem": "e4m3", "grad_elem": "e4m3", "scale_mode": "rceil", "block_size": 32, "hp_weight_grad": False,
    "include": (), "exclude": (), "min_gemm_flops": 0, "attention": "both", "smooth_swiglu": False,
    "gemm_kernel": "auto", "memory_budget": None, "offload": False, "fsdp_all_gather": "bf16", "fallback": True,
}
ROLES_AND_OPERANDS = [(GemmRole.OUTPUT, OperandKind.ACTIVATION), (GemmRole.OUTPUT, OperandKind.WEIGHT),
                      (GemmRole.INPUT_GRAD, OperandKind.GRADIENT), (GemmRole.INPUT_GRAD, OperandKind.WEIGHT),
                      (GemmRole.WEIGHT_GRAD, OperandKind.GRADIENT), (GemmRole.WEIGHT_GRAD, OperandKind.ACTIVATION)]


def test_mxfp8_defaults_are_unchanged():
    config = MXConfig()
    assert {k: v for k, v in config.to_dict().items() if k in MXFP8_DEFAULTS} == MXFP8_DEFAULTS
    assert config.recipe is Recipe.MXFP8 and config.fp4 is None
    for role, operand in ROLES_AND_OPERANDS:  # the mxfp8 row: E4M3 blocks of 32, nearest, 1-D, no RHT
        assert config.operand_format(role, operand) == dataclasses.replace(
            config.operand_format(role, operand), block_format=MXFP8_E4M3, stochastic=False, block_2d=False, rht=False)


def test_nvfp4_row_is_the_papers_recipe():
    config = MXConfig.for_recipe("nvfp4")
    assert config.attention is AttentionMode.OFF  # attention stays out of FP4 by default
    table = {(role, operand): config.operand_format(role, operand).describe() for role, operand in ROLES_AND_OPERANDS}
    assert table == {
        (GemmRole.OUTPUT, OperandKind.ACTIVATION): "nvfp4",
        (GemmRole.OUTPUT, OperandKind.WEIGHT): "nvfp4 2d",
        (GemmRole.INPUT_GRAD, OperandKind.GRADIENT): "nvfp4 sr",
        (GemmRole.INPUT_GRAD, OperandKind.WEIGHT): "nvfp4 2d",
        (GemmRole.WEIGHT_GRAD, OperandKind.GRADIENT): "nvfp4 sr rht",
        (GemmRole.WEIGHT_GRAD, OperandKind.ACTIVATION): "nvfp4 rht",
    }
    assert config.fp4.block_format is NVFP4 and config.fp4.high_precision_layers == NVFP4_HIGH_PRECISION_FRACTION
    off = MXConfig.for_recipe("nvfp4", {"rht": False, "stochastic_rounding": False, "weight_2d": False,
                                        "attention": "both"})
    assert {off.operand_format(r, o).describe() for r, o in ROLES_AND_OPERANDS} == {"nvfp4"}
    assert off.attention is AttentionMode.BOTH


def test_mxfp4_row_has_its_switches_off_by_default():
    config = MXConfig.for_recipe("mxfp4")
    assert {config.operand_format(r, o).describe() for r, o in ROLES_AND_OPERANDS} == {"mxfp4"}
    assert config.fp4.block_format is MXFP4
    on = MXConfig.for_recipe("mxfp4", {"rht": True, "stochastic_rounding": True})
    assert on.operand_format(GemmRole.WEIGHT_GRAD, OperandKind.GRADIENT).describe() == "mxfp4 sr rht"


@pytest.mark.parametrize("options, message", [
    ({"recipe": "nvfp5"}, "recipe='nvfp5' is not accepted; accepted: ['mxfp8', 'nvfp4', 'mxfp4']"),
    ({"rht": True}, "rht=True does not apply to recipe='mxfp8'; it applies to ['nvfp4', 'mxfp4']"),
    ({"recipe": "mxfp4", "weight_2d": True},
     "weight_2d=True does not apply to recipe='mxfp4'; it applies to ['nvfp4']"),
    ({"recipe": "nvfp4", "stochastic_rounding": "yes"}, "stochastic_rounding='yes' is not accepted; accepted: True"),
    ({"recipe": "nvfp4", "high_precision_layers": 1.5}, "high_precision_layers=1.5 is not a fraction in [0, 1]"),
    ({"recipe": "nvfp4", "high_precision_layers": -1}, "high_precision_layers=-1 is negative"),
    ({"recipe": "nvfp4", "high_precision_layers": True}, "high_precision_layers=True is not accepted"),
    ({"recipe": "nvfp4", "high_precision_layers": ("[",)}, "high_precision_layers pattern '[' is not a valid"),
    ({"recipe": "nvfp4", "seed": -1}, "seed=-1: give a non-negative int"),
])
def test_unknown_values_raise_with_the_accepted_ones(options, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        MXConfig.from_options(options)


def test_for_recipe_rejects_a_contradicting_recipe_option():
    with pytest.raises(ValueError, match="contradicts the backend's recipe 'nvfp4'"):
        MXConfig.for_recipe("nvfp4", {"recipe": "mxfp4"})


LAYERS = [f"layers.{i}.{p}" for i in range(2) for p in ("q", "k", "v", "o", "gate", "up", "down")] + ["lm_head"]


@pytest.mark.parametrize("setting, kept", [
    (0.15, {"layers.1.up", "layers.1.down", "lm_head"}),  # round(0.15 * 14) = 2, and the lm_head
    (0.0, set()),  # no high-precision layers: the lm_head too in FP4
    (3, {"layers.1.gate", "layers.1.up", "layers.1.down", "lm_head"}),
    (100, set(LAYERS)),
    (("q$", "lm_head"), {"layers.0.q", "layers.1.q", "lm_head"}),
    ("layers\\.0\\.o", {"layers.0.o"}),  # one pattern as a str
])
def test_high_precision_layers_keep_the_last_layers_and_say_why(setting, kept):
    reasons = MXConfig.for_recipe("nvfp4", {"high_precision_layers": setting}).fp4.high_precision_modules(LAYERS)
    assert set(reasons) == kept
    assert all("high_precision_layers" in why for why in reasons.values())


def test_fraction_rounds_half_up():
    fp4 = MXConfig.for_recipe("nvfp4", {"high_precision_layers": 0.25}).fp4
    assert set(fp4.high_precision_modules(["a", "b"])) == {"b"}  # 0.5 layers -> 1
    assert fp4.high_precision_modules(["a"]) == {}  # 0.25 -> 0


def test_an_output_projection_found_by_structure_is_kept_as_the_lm_head():
    """`heads`: an output projection named otherwise (torchtitan's older `output`), found by
    model_layers.output_projection, is kept besides the count, as the lm_head is."""
    fp4 = MXConfig.for_recipe("nvfp4").fp4
    names = LAYERS[:-1] + ["output"]
    assert set(fp4.high_precision_modules(names)) == {"layers.1.down", "output"}  # round(0.15 * 15) = 2 layers
    reasons = fp4.high_precision_modules(names, heads=("output",))
    assert set(reasons) == {"layers.1.up", "layers.1.down", "output"}  # round(0.15 * 14) = 2, and the head
    assert "the lm_head stays in high precision" in reasons["output"]
