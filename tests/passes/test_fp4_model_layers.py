"""The NVFP4 recipe's high-precision layers are the whole model's (mxcompile/model_layers.py),
however the model is compiled: whole, or block by block as torchtitan does, with the output
projection compiled alone (its graph's only module name is '') and named `output`, not
`lm_head` (torchtitan before 0.3). Per-block compile used to apply the rule to each block's
graph: every block kept its own last layer, and dynamo ran that one graph for every block.

The model: a token embedding (vocabulary 48), 4 blocks of 2 linear layers (up, down) and the
output projection: 8 linear layers besides it. Per case, about 2 s here (2 shared cores)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn

import mxcompile
from gradient_blocks import decomposed_eager_lowering
from mxcompile.backend import compile_and_record
from mxcompile.config import MXConfig
from mxcompile.model_layers import MXSeparatedLayersWarning, decides_from_model, output_projection
from mxcompile.report import KEPT

WIDTH, VOCAB, BLOCKS, BATCH, SEQ = 32, 48, 4, 2, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(h)


def _backend(setting) -> functools.partial:
    config = MXConfig.for_recipe("nvfp4", {"high_precision_layers": setting})
    return functools.partial(compile_and_record, config=config, lower=decomposed_eager_lowering())


def _step(model: nn.Module) -> None:
    torch.manual_seed(1)
    model(torch.randint(0, VOCAB, (BATCH, SEQ))).sum().backward()


def _kept(reports, prefix: str = "") -> set[str]:
    """The model names of the linear layers whose GEMMs the reports keep by the recipe's rule."""
    return {f"{prefix}.{d.module}".strip(".") for r in reports for d in r.decisions
            if d.decision == KEPT and d.reason.startswith("high_precision_layers")}


def _per_block(setting) -> tuple[nn.Module, dict[str, list]]:
    """Each block compiled on its own (torchtitan's apply_compile), the output projection's
    forward too (examples/torchtitan_llama.py's compile_lm_head); the reports per block."""
    torch.manual_seed(0)
    model = Model()
    torch._dynamo.reset()
    backend = _backend(setting)  # one backend: dynamo reuses a graph only for the backend it was compiled by
    for block in model.layers:
        block.compile(backend=backend)
    model.output.forward = torch.compile(model.output.forward, backend=backend)
    _step(model)
    reports = {f"layers.{i}": mxcompile.report_of(block) for i, block in enumerate(model.layers)}
    reports["output"] = mxcompile.report_of(model.output)
    return model, reports


@pytest.mark.parametrize("setting, kept", [
    # round(0.15 * 8) = 1: the last block's down, and the output projection by its structure
    (0.15, {"layers.3.down", "output"}),
    # a count that cuts a block: the last block, and the one before keeps only its down
    (3, {"layers.2.down", "layers.3.up", "layers.3.down", "output"}),
    # patterns match the model's names, which a block's graph does not show
    (r"layers\.1\.up", {"layers.1.up"}),
])
def test_per_block_compile_keeps_the_models_last_layers(setting, kept):
    with pytest.warns(MXSeparatedLayersWarning, match="to a subclass of their class with the same name"):
        model, reports = _per_block(setting)
    per_block = {name: _kept(found, name) for name, found in reports.items()}
    print("kept per block:", per_block)
    assert set().union(*per_block.values()) == kept, per_block
    # each block ran one graph, shared only by blocks with the same decisions
    assert all(len(found) == 1 for found in reports.values()), {n: len(r) for n, r in reports.items()}
    graphs = {name: id(found[0]) for name, found in reports.items() if name != "output"}
    for a in graphs:
        for b in graphs:
            same_decisions = {k.split(".", 2)[-1] for k in per_block[a]} == {k.split(".", 2)[-1] for k in per_block[b]}
            assert (graphs[a] == graphs[b]) == same_decisions, (a, b, per_block)
    # a block that keeps layers has its own class for dynamo's guard, with the same name and base
    assert all(type(block).__name__ == "Block" and isinstance(block, Block) for block in model.layers)


def test_whole_model_compile_keeps_the_same_layers_and_classes():
    torch.manual_seed(0)
    model = Model()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MXSeparatedLayersWarning)  # nothing moved, nothing said
        _step(torch.compile(model, backend=_backend(3)))
    assert _kept(mxcompile.report_of(model)) == {"layers.2.down", "layers.3.up", "layers.3.down", "output"}
    assert {type(block) for block in model.layers} == {Block}  # one graph: no class moved


def test_a_graph_compiled_without_gradients_follows_the_recipe():
    """Under torch.no_grad (inference, or a reentrant checkpoint's forward) dynamo's graph is an
    inference graph: its linear layers' GEMMs run in NVFP4 and the kept ones in high precision,
    as in training (they ran in MXFP8, kept layers included, when only a joint graph's
    parameters were known)."""
    torch.manual_seed(0)
    model = Model()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=_backend(3))(torch.randint(0, VOCAB, (BATCH, SEQ)))
    (report,) = mxcompile.report_of(model)
    assert _kept([report]) == {"layers.2.down", "layers.3.up", "layers.3.down", "output"}
    formats = {d.module: d.operands[0].format for d in report.decisions if d.decision != KEPT}
    assert len(formats) == 5 and set(formats.values()) == {"nvfp4"}, formats


def test_graphs_that_decide_from_the_model_are_not_left_to_torchs_cache(monkeypatch):
    """Torch's AOTAutograd cache key does not see a block's place in the model: one block's cached
    decisions would serve every block, and a graph served runs no pass. So through Inductor the
    backend compiles the graphs of `decides_from_model` configs afresh (not under
    compile_cache.tagged), as graphs with a memory budget; other configs stay cacheable. The
    lowering is swapped for the eager one after the backend chose (Inductor's compile is slow);
    one block compiled."""
    import mxcompile.backend as backend

    config = MXConfig.for_recipe("nvfp4", {"high_precision_layers": 1})
    assert decides_from_model(config)
    assert not decides_from_model(MXConfig.for_recipe("nvfp4", {"high_precision_layers": 0}))
    cacheable = []
    compile_graph = backend.compile_graph

    def eager_compile_graph(gm, example_inputs, config, **kwargs):
        cacheable.append(kwargs["cacheable"])
        return compile_graph(gm, example_inputs, config, **{**kwargs, "lower": decomposed_eager_lowering(),
                                                            "cacheable": False})

    monkeypatch.setattr(backend, "compile_graph", eager_compile_graph)
    chosen = {}
    for setting in (1, 0):
        torch._dynamo.reset()
        cacheable.clear()
        model = Model()
        model.layers[0] = torch.compile(model.layers[0], backend=functools.partial(
            compile_and_record, config=MXConfig.for_recipe("nvfp4", {"high_precision_layers": setting})))
        _step(model)
        chosen[setting] = set(cacheable)
    assert chosen == {1: {False}, 0: {True}}, chosen


def test_output_projection_is_the_last_layer_onto_the_vocabulary_or_tied():
    model = Model()
    layers = [f"layers.{i}.{name}" for i in range(BLOCKS) for name in ("up", "down")] + ["output"]
    assert output_projection(model, layers) == "output"  # out_features = the embedding's rows
    assert output_projection(model, layers[:-1]) is None  # the last layer is not onto the vocabulary
    model.layers[3].down = nn.Linear(2 * WIDTH, VOCAB)  # onto the vocabulary, but not tied and not last
    assert output_projection(model, layers) == "output"
    model.output = nn.Linear(WIDTH, VOCAB + 1, bias=False)
    assert output_projection(model, layers) is None
    model.output.weight = model.tok_embeddings.weight  # tied: whatever its shape says
    assert output_projection(model, layers) == "output"
