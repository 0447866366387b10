"""Hugging Face Trainer with the mxfp8 backend (mxcompile.integrations.hf): a tiny Llama (random
weights from a small config, nothing downloaded) trains 3 steps on the CPU through the real
backend (Inductor), its GEMMs in MXFP8, the loss finite, and the MX share in the log history;
and the same with the nvfp4 recipe (`config=MXConfig.for_recipe("nvfp4")`), its linear layers'
GEMMs in NVFP4 but those the recipe keeps."""

from __future__ import annotations

import math

import pytest
import torch

import mxcompile
from hf_zoo import MIN_CONVERTED_FLOP_SHARE, assert_converted

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install accelerate)")
hf = pytest.importorskip("mxcompile.integrations.hf")

VOCAB, HIDDEN, FFN, LAYERS, HEADS = 256, 64, 128, 2, 2
SEQ, BATCH, STEPS = 32, 2, 3
LINEARS = LAYERS * 7 + 1  # q, k, v, o, gate, up, down per layer, and the lm_head


class _TokenDataset(torch.utils.data.Dataset):
    """Random token sequences, labels = inputs (the model shifts them)."""

    def __init__(self, count: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=1,
                                      max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def _args(output_dir, **overrides) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, **overrides)


def _assert_recipe_decisions(report: mxcompile.Report) -> None:
    """nvfp4: every linear layer's GEMM in NVFP4 but those of the layers the recipe keeps (the
    last 2 of 14 linear layers, round(0.15 * 14), and the lm_head), attention kept (off)."""
    kept = {d.module for d in report.decisions if d.decision == "kept" and d.kind != "attention"}
    assert kept == {"model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj", "lm_head"}, kept
    assert all("high_precision_layers=0.15" in d.reason for d in report.decisions
               if d.decision == "kept" and d.kind != "attention")
    assert all("attention='off'" in d.reason for d in report.decisions if d.kind == "attention")
    assert report.converted_by_format() == {"nvfp4": 3 * (LINEARS - 3)}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_trainer_trains_a_tiny_llama_in_mx(tmp_path, recipe) -> None:
    model = _tiny_llama()
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    args = _args(tmp_path)
    config = mxcompile.MXConfig.for_recipe(recipe)
    trainer = transformers.Trainer(model=hf.compile_model(model, args, config=config), args=args,
                                   train_dataset=_TokenDataset(BATCH * STEPS), callbacks=[hf.MXReportCallback()])
    trainer.train()

    assert trainer.state.global_step == STEPS
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), trainer.state.log_history
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before)  # the optimizer stepped

    # One training graph (forward and backward) for the model, every GEMM of it in MX.
    reports = mxcompile.report_of(model)
    assert len(reports) == 1, [r.summary() for r in reports]
    assert_converted(reports[0]) if recipe == "mxfp8" else _assert_recipe_decisions(reports[0])
    kinds = {d.graph for d in reports[0].decisions}
    assert kinds == {"forward", "backward"}, kinds
    assert trainer.model is model  # compiled in place: the Trainer sees the model's class and signature
    share = hf.mx_share(model)
    assert share.graphs == 1 and share.converted_flop_fraction == reports[0].converted_flop_fraction
    assert share.gemms == len(reports[0].decisions) and share.summary().startswith("1 graph(s): ")
    # The callback put the share into each log entry of a step.
    logged = [entry[hf.FLOP_FRACTION_KEY] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == [share.converted_flop_fraction] * STEPS, trainer.state.log_history


@pytest.mark.slow
def test_trainer_with_gradient_checkpointing_trains_in_mx(tmp_path) -> None:
    """TrainingArguments(gradient_checkpointing=True): the Trainer enables HF's checkpointing in
    train(), after compile_model; dynamo cannot trace it, so mxcompile compiles each layer on its
    own and says so. Was (issue 46): 3 GEMMs (the lm_head) in MX, the layers eager in fp32, no
    warning."""
    from mxcompile.checkpointed_layers import MXCheckpointingWarning

    model = _tiny_llama()
    args = _args(tmp_path, gradient_checkpointing=True)
    trainer = transformers.Trainer(model=hf.compile_model(model, args), args=args,
                                   train_dataset=_TokenDataset(BATCH * STEPS), callbacks=[hf.MXReportCallback()])
    with pytest.warns(MXCheckpointingWarning, match="compiled on its own"):
        trainer.train()
    converted = {d.module for r in mxcompile.report_of(model) for d in r.decisions if d.decision == "mxfp8"}
    # the layers' shared graph (its modules named from the layer runner's argument: "args.0.mlp...");
    # before the fix only lm_head
    assert {"args.0.mlp.down_proj", "args.0.self_attn.q_proj"} <= converted, sorted(converted)
    assert hf.mx_share(model).converted_flop_fraction >= MIN_CONVERTED_FLOP_SHARE


def test_compile_model_refuses_trainer_compilation(tmp_path) -> None:
    """torch_compile=True would make accelerate compile again, with a backend list that has no
    mxfp8: the helper says so before the Trainer starts."""
    args = _args(tmp_path, torch_compile=True, torch_compile_backend="mxfp8")
    with pytest.raises(ValueError, match="set torch_compile=False"):
        hf.compile_model(_tiny_llama(), args)
    with pytest.raises(ValueError, match="already compiled"):
        hf.compile_model(torch.compile(torch.nn.Linear(4, 4), backend="eager"))
    with pytest.raises(ValueError, match="compile_model sets backend and options itself"):
        hf.compile_model(_tiny_llama(), backend="inductor")
    # What the helper protects from: accelerate refuses the name before any backend runs.
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        transformers.Trainer(model=_tiny_llama(), args=args)


def test_callback_warns_when_the_model_was_not_compiled_with_mxfp8(tmp_path) -> None:
    callback = hf.MXReportCallback()
    state = transformers.TrainerState()
    model = _tiny_llama()
    with pytest.warns(UserWarning, match="compiled no graph of this model"):
        callback.on_train_end(_args(tmp_path), state, transformers.TrainerControl(), model=model)
    logs: dict[str, float] = {"loss": 1.0}
    callback.on_log(_args(tmp_path), state, transformers.TrainerControl(), logs=logs, model=model)
    assert logs == {"loss": 1.0, hf.FLOP_FRACTION_KEY: 0.0, hf.GRAPHS_KEY: 0}

