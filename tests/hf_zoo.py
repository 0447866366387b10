"""The model zoo: HF transformers architectures, each from its own tiny config with its default
dropout, and a batch to train it on. Random weights; nothing is downloaded."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from mxcompile.backend import compile_and_record
from mxcompile.config import MXConfig
from mxcompile.lowering import eager_compiler
from mxcompile.report import KEPT, Report

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, FFN, LAYERS, HEADS, HEAD_DIM = 256, 64, 128, 2, 2, 32
BATCH, SEQ = 2, 32
IMAGE, PATCH, IMAGE_BATCH, LABELS = 64, 8, 4, 10  # ViT: 8 x 8 patches + CLS = 65 tokens
MAX_POSITIONS = 128
LR = 1e-3
MIN_CONVERTED_FLOP_SHARE = 0.95


@dataclass(frozen=True)
class ZooModel:
    """An architecture: how to build it, and its training batch (keyword inputs with labels)."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[int], dict[str, Any]]  # sequence length -> keyword inputs


def _decoder(config_cls, model_cls, **overrides) -> Callable[[], torch.nn.Module]:
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS)
    return lambda: getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**common, **overrides}))


def _tokens(seq: int) -> dict[str, Any]:
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seq))
    return {"input_ids": ids, "labels": ids}


def _padded_tokens(seq: int) -> dict[str, Any]:
    """The second sequence ends in padding, masked out of attention and of the loss."""
    batch = _tokens(seq)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[1, seq * 3 // 4:] = 0
    batch["attention_mask"] = mask
    batch["labels"] = batch["input_ids"].masked_fill(mask == 0, -100)
    return batch


def _images(_: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(IMAGE_BATCH, 3, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, LABELS, (IMAGE_BATCH,), generator=g)}


ZOO: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("llama", _decoder("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=1), _tokens),
    ZooModel("mistral", _decoder("MistralConfig", "MistralForCausalLM", num_key_value_heads=1), _tokens),
    ZooModel("qwen3", _decoder("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=1, head_dim=HEAD_DIM), _tokens),
    ZooModel("gemma2", _decoder("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=1, head_dim=HEAD_DIM),
             _tokens),
    ZooModel("phi", _decoder("PhiConfig", "PhiForCausalLM"), _tokens),
    ZooModel("gpt_neox", _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM"), _tokens),
    ZooModel("gpt2", lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS)), _tokens),
    ZooModel("opt", lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        word_embed_proj_dim=HIDDEN, max_position_embeddings=MAX_POSITIONS)), _tokens),
    ZooModel("bert", lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS)), _padded_tokens),
    ZooModel("t5", lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HEAD_DIM, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
        decoder_start_token_id=0)), _tokens),
    ZooModel("vit", lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_labels=LABELS)), _images),
    ZooModel("mixtral", _decoder("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=1,
                                 num_local_experts=4, num_experts_per_tok=2), _tokens),
]}


def recording_eager_backend():
    """The backend's recording path (reports(), report_of) with the graphs run eagerly."""
    return functools.partial(compile_and_record, config=MXConfig(), lower=eager_compiler)


def kept_gemms(report: Report) -> str:
    """Each kept GEMM with its reason, for a failure message."""
    total = report.gemm_flops_total or 1
    lines = [f"  {d.graph} {d.node} [{d.kind}] {d.module or '-'} {list(d.shapes)} "
             f"({d.flops / total:.1%} of FLOPs): {d.reason}" for d in report.decisions if d.decision == KEPT]
    return f"{report.converted_flop_fraction:.1%} of GEMM FLOPs converted; kept:\n" + "\n".join(lines)


def assert_converted(report: Report) -> None:
    assert report.decisions, "no GEMM was found"
    assert report.converted_flop_fraction >= MIN_CONVERTED_FLOP_SHARE, kept_gemms(report)


def params_marking(known_failures: dict[str, str], names=None) -> list:
    """The zoo's models (or `names`); those in known_failures marked xfail(strict) with the
    measured reason, so that they turn into failures (XPASS) once fixed."""
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=known_failures[name]))
            if name in known_failures else name for name in (names or ZOO)]
