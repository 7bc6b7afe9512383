"""Pieces of the FSDP2 fine-tuning example: the process group, the causal LM and its tokenizer,
the ``fsdp`` options of ``make_private``, the per-example loss and a held-out evaluation that
every rank runs in step.

Under FSDP2 each forward pass all-gathers the parameters of every ``fully_shard`` block, a
collective: all ranks must run the same number of forward passes, empty batches included.
The evaluation therefore gives every rank its own share of the held-out blocks in the same
number of batches (the last ones possibly empty) and sums the losses over the ranks.
"""

import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from common import text_data

try:
    import transformers
except ImportError:  # pragma: no cover - reported when the example starts
    transformers = None


@dataclass(frozen=True)
class Ranks:
    """This process in the job: its rank, the number of ranks, its device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_process_group() -> Ranks:
    """Join the job torchrun started (nccl on CUDA, else gloo; one device per ``LOCAL_RANK``),
    or a one-process group when started without torchrun (FSDP2 always needs a group)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Ranks(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def fsdp_options(ranks: Ranks, bf16: bool) -> dict:
    """``make_private(..., fsdp=...)``: one 1-D mesh over all ranks; with ``bf16`` the sharded
    float32 weights are gathered in bfloat16 for compute, gradients reduced in float32."""
    options = {"mesh": init_device_mesh(ranks.device.type, (ranks.world_size,))}
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return options


# ------------------------------------------------------------------------------ model, data
def _check_transformers() -> None:
    if transformers is None:
        raise SystemExit("this example needs the transformers package (pip install transformers)")


def load_tokenizer(args):
    """The checkpoint's tokenizer, or the byte-level one of a model built from a config."""
    if not args.model_name_or_path:
        return text_data.ByteTokenizer()
    _check_transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"--model-name-or-path {args.model_name_or_path}: the tokenizer has no "
                         "end-of-text token (needed to separate documents)")
    return tokenizer


def load_blocks(args, tokenizer):
    """``(train, held-out)`` blocks of ``--block-size`` tokens of the Python Language Reference
    (one block is one example, the unit the (ε, δ) guarantee protects)."""
    train, test = text_data.split_documents(text_data.language_reference(), args.test_fraction, args.split_seed)
    return tuple(text_data.lm_blocks(tokenizer, docs, args.block_size, args.max_examples) for docs in (train, test))


def tiny_llama_config(args, tokenizer):
    """A small ``LlamaConfig`` over ``tokenizer``'s vocabulary (random weights, offline)."""
    _check_transformers()
    return transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
        max_position_embeddings=args.block_size, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, use_cache=False)


def build_model(args, tokenizer, device: torch.device):
    """The unsharded causal LM in float32 on ``device``, in training mode; every rank builds the
    same one (same seed, or the same checkpoint)."""
    _check_transformers()
    if args.model_name_or_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
        model.config.use_cache = False
    else:
        model = transformers.LlamaForCausalLM(tiny_llama_config(args, tokenizer))
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and args.block_size > positions:
        raise SystemExit(f"--block-size {args.block_size} exceeds the model's {positions} positions")
    return model.to(device).train()


# ------------------------------------------------------------------------------ loss, evaluation
def next_token_logits(model, ids: torch.Tensor):
    """``(logits of positions 0..T-2 in float32, their targets)``; a block has no padding.

    An empty batch (a rank's share of a Poisson batch, or of the held-out set, may be empty)
    still runs the model, as every rank must under FSDP2, on one placeholder block whose logits
    are dropped: no example, no gradient (transformers' attention cannot run on zero rows)."""
    rows = len(ids)
    if rows == 0:
        ids = torch.zeros((1, ids.shape[1]), dtype=ids.dtype, device=ids.device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:rows, :-1].float()
    return logits, ids[:rows, 1:]


def per_example_mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of each example's mean next-token loss (0 for an empty batch): an
    example's gradient does not depend on the other examples of its batch."""
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return losses.view(targets.shape).mean(dim=1).sum() / max(len(targets), 1)


def _rank_batches(num_examples: int, batch_size: int, ranks: Ranks):
    """This rank's share ``rank::world_size`` cut into the number of batches every rank runs."""
    mine = list(range(ranks.rank, num_examples, ranks.world_size))
    largest_share = math.ceil(num_examples / ranks.world_size)
    count = max(1, math.ceil(largest_share / batch_size))
    return [mine[i * batch_size:(i + 1) * batch_size] for i in range(count)]


@torch.no_grad()
def held_out_perplexity(model, dataset, batch_size: int, ranks: Ranks) -> float:
    """exp(mean next-token loss) over all held-out blocks, each rank evaluating its share."""
    model.eval()
    (blocks,) = dataset.tensors
    total = torch.zeros(2, dtype=torch.float64, device=ranks.device)
    for indices in _rank_batches(len(blocks), batch_size, ranks):
        logits, targets = next_token_logits(model, blocks[indices].to(ranks.device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        total += torch.tensor([float(loss), targets.numel()], dtype=torch.float64, device=ranks.device)
    dist.all_reduce(total)
    model.train()
    return math.exp(float(total[0] / total[1]))


def sum_over_ranks(device: torch.device, *values: float):
    """Totals of ``values`` over all ranks."""
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return tuple(totals.tolist())
