"""Train a tiny Qwen3-MoE byte-level language model whose experts run in megamoe.

The model is built from a config (no download), patched with megamoe.integrations.hf (router kept, experts
in megamoe.experts) and trained on examples/data/tiny_corpus.txt, which ships with the repository.

    python examples/train_moe.py                                    # 1 process; ~1 minute on 2 CPU cores
    python examples/train_moe.py --check-determinism                # trains twice, compares losses and weights bitwise
    torchrun --nproc-per-node 2 examples/train_moe.py               # DDP over data (gloo on CPU, nccl on GPU)
    torchrun --nproc-per-node 2 examples/train_moe.py --expert-parallel   # + experts sharded over the ranks

Writes <out-dir>/loss.csv (step, loss averaged over ranks, tokens/s) and <out-dir>/loss.png, and with
--save-model a plain transformers checkpoint in <out-dir>/model (unpatched first).

With --expert-parallel every rank is both a data-parallel replica and an expert owner: rank r keeps experts
[r*E_l, (r+1)*E_l) of every layer, and megamoe exchanges tokens between ranks. Expert weights are then not
replicas, so DDP must not average their gradients (megamoe.parallel.ddp_ignore_experts); megamoe's backward
already sums each expert's gradient over every rank's tokens, which is W times the data-parallel average,
so megamoe.parallel.reduce_expert_grads divides them by W.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import pathlib
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from megamoe.config import BACKENDS

DEFAULT_CORPUS = pathlib.Path(__file__).with_name("data") / "tiny_corpus.txt"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a tiny Qwen3-MoE LM with megamoe experts.")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="clip the gradient to this norm (megamoe.parallel.clip_grad_norm_: one norm on every rank)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-intermediate", type=int, default=64)
    parser.add_argument("--backend", default="auto", choices=BACKENDS, help="megamoe.MoEConfig.backend")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--amp", action="store_true", help="bf16 autocast on the CPU (on CUDA it is always on)")
    parser.add_argument("--expert-parallel", action="store_true", help="shard experts over all ranks")
    parser.add_argument("--check-determinism", action="store_true", help="train twice; compare losses and final weights bitwise")
    parser.add_argument("--save-model", action="store_true", help="save a plain checkpoint to <out-dir>/model")
    parser.add_argument("--corpus", type=pathlib.Path, default=DEFAULT_CORPUS)
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("runs/train_moe"))
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = parser.parse_args(argv)
    # Checked here, not where they would fail: after training (--steps 0) or deep inside the model.
    for name in ("steps", "batch_size", "seq_len", "layers", "experts", "top_k", "expert_intermediate"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    head_dim = args.hidden // 4  # build_model: 4 attention heads
    if head_dim < 2 or head_dim % 2:
        parser.error(f"--hidden {args.hidden}: its 4 attention heads get hidden // 4 = {head_dim} dims each, and "
                     "rotary embeddings need an even number >= 2; use a multiple of 8")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch finds no CUDA GPU here; use auto or cpu")
    if args.backend == "triton" and (args.device == "cpu" or not torch.cuda.is_available()):
        parser.error("--backend triton: the fused kernels need an NVIDIA GPU and this run is on the CPU; use auto or "
                     "torch")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    for name in ("lr", "max_grad_norm"):
        value = getattr(args, name)
        if value is not None and not value >= 0:  # nan too
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k}: more than --experts {args.experts}")
    try:  # opened, not only stat'ed: a folder or an unreadable file fails here, not in main
        with open(args.corpus, "rb") as corpus:
            corpus_bytes = os.fstat(corpus.fileno()).st_size
    except OSError as e:
        parser.error(f"--corpus {args.corpus}: cannot read ({e.strerror})")
    if args.seq_len > corpus_bytes - 2:  # a window is seq_len + 1 bytes at a random start
        parser.error(f"--seq-len {args.seq_len}: longer than the corpus allows ({args.corpus} has {corpus_bytes} "
                     f"bytes: at most {corpus_bytes - 2})")
    try:  # the outputs are written after training: a folder that cannot take them fails now, not then
        args.out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out_dir).close()
    except OSError as e:
        parser.error(f"--out-dir {args.out_dir}: cannot write there ({e.strerror})")
    return args


def setup_distributed(args):
    """(rank, world, device): torchrun's environment if present, else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world, device


def build_model(args, device):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_intermediate, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, max_position_embeddings=args.seq_len, output_router_logits=True,
        router_aux_loss_coef=0.01, tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(args.seed)  # same initial weights on every rank and every run
    return Qwen3MoeForCausalLM(config).to(device)


def batches(data: torch.Tensor, args, rank: int, device):
    """Random windows of the corpus; rank r draws from its own stream, so ranks see different data."""
    generator = torch.Generator().manual_seed(args.seed * 10_007 + rank)
    offsets = torch.arange(args.seq_len + 1)
    while True:
        starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.batch_size, 1), generator=generator)
        yield data[starts + offsets].to(device, non_blocking=True)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args, rank: int, world: int, device, data: torch.Tensor):
    """One training run from scratch; returns (losses per step, tokens/s per step, the unwrapped model)."""
    import megamoe
    from megamoe import parallel
    from megamoe.integrations import hf
    from tqdm import tqdm

    model = build_model(args, device)
    ep_group = dist.new_group(list(range(world))) if args.expert_parallel and world > 1 else None
    hf.patch_model(model, group=ep_group, config=megamoe.MoEConfig(backend=args.backend))
    trained = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        parallel.ddp_ignore_experts(model)  # expert shards are not replicas: DDP leaves them alone
        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # Built after patching: with expert parallelism, patching replaced the expert parameters by local slices.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    amp = args.amp or device.type == "cuda"

    losses, rates = [], []
    stream = batches(data, args, rank, device)
    bar = tqdm(range(args.steps), disable=rank != 0 or args.no_progress, unit="step", dynamic_ncols=True)
    for step in bar:
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        ids = next(stream)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = trained(input_ids=ids, labels=ids).loss  # next-byte cross entropy + router aux loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        parallel.reduce_expert_grads(model)  # the experts' gradients, on DDP's convention (a no-op without EP)
        if args.max_grad_norm is not None:  # after reduce_expert_grads: the norm of the gradients the step applies
            parallel.clip_grad_norm_(model, args.max_grad_norm)
        optimizer.step()
        logged = loss.detach().float()
        if world > 1:
            dist.all_reduce(logged)
            logged /= world
        losses.append(logged.item())  # the host waits here, once per step, for logging only
        rates.append(world * ids.numel() / (time.perf_counter() - start))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rates[-1]:,.0f}")
    bar.close()
    # The model keeps running over ep_group (its state_dict, unpatch_model): main's destroy_process_group ends it.
    return losses, rates, model


def write_outputs(out_dir: pathlib.Path, losses, rates) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(out_dir / "loss.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", "tokens_per_s"])
        for step, (loss, rate) in enumerate(zip(losses, rates)):
            writer.writerow([step, repr(loss), f"{rate:.1f}"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(len(losses)), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (next byte, nats) + aux")
    ax.set_title("tiny Qwen3-MoE with megamoe experts")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same bits. torch.equal compares values, for which NaN != NaN (a run that diverged
    would read as not reproducible, however exactly it was) and -0.0 == 0.0. DTensors compare over all shards."""
    if a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    return torch.equal(a, b)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = setup_distributed(args)
    if device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace; this must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: a non-deterministic kernel elsewhere in the stack warns instead of stopping the run, and
    # --check-determinism reports the outcome.
    torch.use_deterministic_algorithms(True, warn_only=True)
    data = torch.frombuffer(bytearray(args.corpus.read_bytes()), dtype=torch.uint8).long()

    losses, rates, model = train(args, rank, world, device, data)
    identical = True
    if args.check_determinism:
        losses_again, _, model_again = train(args, rank, world, device, data)
        same_losses = same_bits(*(torch.tensor(run, dtype=torch.float64) for run in (losses, losses_again)))
        same_params = all(
            same_bits(a, b) for a, b in zip(model.state_dict().values(), model_again.state_dict().values())
        )
        identical = same_losses and same_params
        if rank == 0:
            print(f"determinism: losses bitwise identical across 2 runs: {same_losses}; "
                  f"final parameters identical: {same_params}")
    if rank == 0:
        write_outputs(args.out_dir, losses, rates)
        print(f"final loss {losses[-1]:.4f} after {args.steps} steps; "
              f"median {sorted(rates)[len(rates) // 2]:,.0f} tokens/s; wrote {args.out_dir}/loss.csv and loss.png")
    if args.save_model:
        from megamoe.integrations import hf

        hf.unpatch_model(model)  # a collective with --expert-parallel: every rank calls it
        if rank == 0:
            model.save_pretrained(args.out_dir / "model")
            print(f"saved a plain transformers checkpoint to {args.out_dir / 'model'}")
    if world > 1:
        dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
