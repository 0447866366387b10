"""Train a small HF Llama on the Shakespeare corpus with FSDP2 and the mxfp8 backend, printing
the loss and the bytes of the collectives of every step. Run under torchrun:

    torchrun --standalone --nproc-per-node 2 scripts/train_llama_fsdp.py --steps 20

On CPU the process group is gloo, on CUDA nccl (`--device cuda`, one GPU per process). Each
rank draws its own batches (seed = --seed + rank); the model starts from the same weights on
every rank (seed --seed). The loss printed is the mean over ranks; the bytes are this rank's
payload of the collectives FSDP2 issues (all-gathers of parameters, reduce-scatters of
gradients), from `mxcompile.distributed.CollectiveCounter`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from mxcompile import MXConfig
from mxcompile.distributed import CollectiveCounter, fully_shard
from mxcompile.examples.data import batches, load_corpus, train_val_split

BYTE_VOCAB = 256  # byte-level tokens
MB = 1e6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--texts", type=int, default=4, help="Shakespeare texts to load")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--all-gather", choices=("mxfp8", "bf16"), default="mxfp8",
                        help="FSDP2 weight all-gather: MX-quantized shards or the parameter dtype")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=BYTE_VOCAB, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(config)


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" \
        else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(args.device, (world,))
    model = build_model(args).to(device)
    config = MXConfig(fsdp_all_gather=args.all_gather)
    result = fully_shard(model, mesh, config=config)
    if rank == 0:
        print(f"{world} ranks, FSDP units: {list(result.units)}")
        kept = {name: why for name, why in result.all_gather.items() if not why.startswith("mxfp8")}
        print(f"MX all-gather on {len(result.all_gather) - len(kept)} weights; kept: {kept or 'none'}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_data, _ = train_val_split(load_corpus(num_texts=args.texts))
    stream = batches(train_data, args.batch, args.seq, seed=args.seed + rank, device=device)
    for step in range(args.steps):
        inputs, targets = next(stream)
        start = time.perf_counter()
        with CollectiveCounter() as counter:
            logits = model(input_ids=inputs).logits
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        if rank == 0:
            moved = counter.totals.bytes
            print(f"step {step:3d}  loss {mean_loss.item():.4f}  all-gather {moved.get('all_gather', 0) / MB:.3f} MB  "
                  f"reduce-scatter {moved.get('reduce_scatter', 0) / MB:.3f} MB  "
                  f"total {counter.totals.total_bytes / MB:.3f} MB  {elapsed:.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
