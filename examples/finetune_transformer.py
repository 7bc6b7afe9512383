#!/usr/bin/env python3
"""Private (DP-SGD) fine-tuning of a Hugging Face ``transformers`` model: a causal language model
(``--task causal-lm``, reports held-out perplexity) or a sequence classifier (``--task classify``,
reports held-out accuracy), all weights or LoRA adapters only (``--lora``, with ``peft``).

Model: ``--model-name-or-path`` loads a pretrained checkpoint (a local folder or a hub name) with
``AutoModelForCausalLM``/``AutoModelForSequenceClassification`` and ``AutoTokenizer``;
``--from-config gpt2|llama`` (the default when no path is given) builds a small randomly
initialised model with a byte-level tokenizer, so the script runs offline.

Data (see ``common/text_data.py``): by default text that ships with Python — the Language
Reference of ``pydoc_data.topics`` cut into blocks of ``--block-size`` tokens (causal LM), or
lines of standard-library sources labelled ``code``/``docstring`` by Python's parser (classify);
``--dataset NAME`` loads a ``datasets`` dataset instead (``--text-column``, ``--label-column``).
One block or one line is one example, the unit the (ε, δ) guarantee protects.

Loss: each example's mean next-token loss (or its cross-entropy), averaged over the batch, so an
example's gradient never depends on the other examples of its batch (a loss averaged over all
the batch's tokens would make it depend on their number). Under ``--bf16`` the forward pass
and the loss run in ``torch.autocast`` bfloat16; clipping and noise stay in float32.

Examples::

    python examples/finetune_transformer.py                          # tiny GPT-2, offline, < 3 min
    python examples/finetune_transformer.py --lora --lora-rank 8
    python examples/finetune_transformer.py --task classify --epochs 2
    python examples/finetune_transformer.py --model-name-or-path gpt2 --lora --block-size 128
    torchrun --nproc_per_node=2 examples/finetune_transformer.py --max-epsilon 8
"""

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import checkpoints, text_data
from common.classification import make_optimizer
from common.cli import add_output_args, add_privacy_args, add_training_args, check_common_args, make_parser
from common.distributed import barrier, init_from_args, shutdown, wrap_model
from common.loop import (EpochProgress, _sum_over_processes, epsilon_due, first_epoch, set_epoch, set_learning_rate,
                         to_device)
from common.privacy import physical_batches, prepare_training
from common.reporting import MetricsLog, privacy_line, resume_line, run_settings_line


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--task", default="causal-lm", choices=["causal-lm", "classify"],
                       help="causal-lm: next-token prediction (perplexity); classify: sequence classifier (accuracy)")
    group.add_argument("--model-name-or-path", default=None, metavar="PATH",
                       help="pretrained model and tokenizer: a local folder or a hub name (from_pretrained)")
    group.add_argument("--from-config", default=None, choices=["gpt2", "llama"],
                       help="random model of this architecture with a byte-level tokenizer, offline "
                            "(None: gpt2 unless --model-name-or-path is given)")
    group.add_argument("--n-layers", type=int, default=2, help="--from-config: transformer blocks")
    group.add_argument("--hidden-size", type=int, default=64, help="--from-config: width")
    group.add_argument("--n-heads", type=int, default=4, help="--from-config: attention heads")
    group.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    group.add_argument("--lora-rank", type=int, default=8, help="rank r of the LoRA adapters")
    group.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scaling α (updates scaled by α/r)")
    group.add_argument("--lora-targets", default=None, metavar="NAMES",
                       help="comma-separated module names to adapt (None: peft's choice for the architecture)")
    group.add_argument("--bf16", action="store_true", help="forward pass and loss under torch.autocast bfloat16")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--dataset", default=None, metavar="NAME",
                       help="datasets.load_dataset(NAME) instead of the text shipped with Python")
    group.add_argument("--dataset-config", default=None, metavar="NAME", help="configuration of --dataset")
    group.add_argument("--text-column", default="text", help="--dataset: column of the texts")
    group.add_argument("--label-column", default="label", help="--dataset with --task classify: column of the labels")
    group.add_argument("--block-size", type=int, default=64,
                       help="tokens per example: causal-lm block length; classify: texts cut/padded to this")
    group.add_argument("--test-fraction", type=float, default=0.1,
                       help="share of the documents held out (when the data has no test split)")
    group.add_argument("--split-seed", type=int, default=0, help="seed of the train/test split")
    group.add_argument("--max-examples", type=int, default=None, metavar="N",
                       help="keep at most N training and N held-out examples")


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser("Private fine-tuning of a transformers causal LM or sequence classifier")
    _add_model_args(parser)
    _add_data_args(parser)
    add_training_args(parser, epochs=3, batch_size=128, lr=6e-3, optim="Adam")
    parser.add_argument("--max-physical-batch-size", type=int, default=None, metavar="M",
                        help="private runs: cut each Poisson batch into pieces of at most M examples "
                             "(BatchMemoryManager; memory only, the step is the same)")
    add_privacy_args(parser, sigma=0.8, max_grad_norm=1.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of each process (torch.set_num_threads; 0: torch's default). The "
                             "default model is too small to gain from more, and more only contend on a busy CPU")
    parser.set_defaults(grad_sample_mode="bk")
    add_output_args(parser, example="finetune_transformer")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.model_name_or_path and args.from_config:
        parser.error("--model-name-or-path and --from-config exclude each other")
    if not args.model_name_or_path:
        args.from_config = args.from_config or "gpt2"
    for name in ("n_layers", "hidden_size", "n_heads", "lora_rank", "max_examples", "max_physical_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads < 0:
        parser.error("--threads must be 0 (torch's default) or more")
    if args.hidden_size % args.n_heads:
        parser.error(f"--hidden-size {args.hidden_size} is not a multiple of --n-heads {args.n_heads}")
    if args.block_size < 2:
        parser.error("--block-size must be at least 2")
    if not (args.lora_alpha > 0 and math.isfinite(args.lora_alpha)):
        parser.error("--lora-alpha must be a finite number > 0")
    if not 0 < args.test_fraction < 1:
        parser.error("--test-fraction must lie in (0, 1)")
    if args.dataset_config and not args.dataset:
        parser.error("--dataset-config needs --dataset")
    changed_lora = [f for f in ("lora_rank", "lora_alpha", "lora_targets") if getattr(args, f) != parser.get_default(f)]
    if changed_lora and not args.lora:
        parser.error("--lora-rank, --lora-alpha and --lora-targets need --lora")
    if args.max_physical_batch_size and args.n_accumulation_steps > 1:
        parser.error("--max-physical-batch-size and --n-accumulation-steps both cut batches: give one")
    if args.data_parallel:
        parser.error("--data-parallel is not supported here; use torchrun (DPDDP) for several devices")


# ------------------------------------------------------------------------------ data, model
def _transformers():
    try:
        import transformers
    except ImportError:
        raise SystemExit("this example needs the transformers package (pip install transformers)") from None
    return transformers


def load_tokenizer(args):
    if args.from_config:
        return text_data.ByteTokenizer()
    tokenizer = _transformers().AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # e.g. GPT-2's; padded positions are masked out
    if tokenizer.pad_token_id is None or (args.task == "causal-lm" and tokenizer.eos_token_id is None):
        raise SystemExit(f"--model-name-or-path {args.model_name_or_path}: the tokenizer has no "
                         "end-of-text token (needed to separate documents and to pad)")
    return tokenizer


def load_data(args, tokenizer):
    """``(train, test, class names or None, description)`` as tensor datasets."""
    classify = args.task == "classify"
    if args.dataset:
        train, test, names = text_data.hub_documents(args.dataset, args.dataset_config, args.text_column,
                                                     args.label_column if classify else None)
        about = f"--dataset {args.dataset}"
    elif classify:
        train, test, names = text_data.source_lines(args.split_seed), None, list(text_data.LINE_CLASSES)
        about = f"standard-library source lines ({len(text_data.SOURCE_MODULES)} modules), code vs docstring"
    else:
        train, test, names = text_data.language_reference(), None, None
        about = "the Python Language Reference (pydoc_data.topics)"
    if test is None:
        train, test = text_data.split_documents(train, args.test_fraction, args.split_seed)
    if classify:
        return (*(text_data.padded(tokenizer, rows[:args.max_examples], args.block_size) for rows in (train, test)),
                names, about)
    return (*(text_data.lm_blocks(tokenizer, docs, args.block_size, args.max_examples) for docs in (train, test)),
            names, about)


def tiny_config(args, tokenizer, num_labels: int):
    transformers = _transformers()
    ids = dict(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id, num_labels=num_labels,
               bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    if args.from_config == "llama":
        return transformers.LlamaConfig(
            hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size, num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
            max_position_embeddings=args.block_size, use_cache=False, **ids)
    return transformers.GPT2Config(n_embd=args.hidden_size, n_layer=args.n_layers, n_head=args.n_heads,
                                   n_positions=args.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   use_cache=False, **ids)


def build_model(args, tokenizer, num_labels: int):
    transformers = _transformers()
    auto = (transformers.AutoModelForSequenceClassification if args.task == "classify"
            else transformers.AutoModelForCausalLM)
    if args.from_config:
        model = auto.from_config(tiny_config(args, tokenizer, num_labels))
    else:
        extra = {"num_labels": num_labels} if args.task == "classify" else {}
        model = auto.from_pretrained(args.model_name_or_path, **extra)
        model.config.pad_token_id, model.config.use_cache = tokenizer.pad_token_id, False
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if positions and args.block_size > positions:
        raise SystemExit(f"--block-size {args.block_size} exceeds the model's {positions} positions")
    model.train()  # from_pretrained returns the model in eval mode; DP-SGD trains it (dropout as configured)
    return with_lora(args, model) if args.lora else model


def with_lora(args, model):
    try:
        import peft
    except ImportError:
        raise SystemExit("--lora needs the peft package (pip install peft)") from None
    targets = [name.strip() for name in args.lora_targets.split(",")] if args.lora_targets else None
    config = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                             target_modules=targets, fan_in_fan_out=model.config.model_type == "gpt2",
                             task_type="SEQ_CLS" if args.task == "classify" else "CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as error:
        raise SystemExit(f"--lora: {error} (name the layers to adapt with --lora-targets)") from None


# ------------------------------------------------------------------------------ loss, metrics
def forward(model, batch, args, device: torch.device):
    """``(mean loss over the examples, summed loss, number of predictions, correct ones)``."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
        if args.task == "causal-lm":
            (ids,) = batch  # a block has no padding: every position is attended
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1].float()
            targets = ids[:, 1:]
        else:
            ids, mask, targets = batch
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        per_example = losses.view(len(ids), -1).mean(dim=1)
    correct = int((logits.argmax(dim=-1) == targets).sum())
    return per_example.mean(), float(losses.detach().sum()), targets.numel(), correct


@torch.no_grad()
def evaluate(model, dataset, args, device: torch.device) -> dict:
    """Held-out ``loss`` (per prediction) and ``perplexity`` (causal LM) or ``accuracy``."""
    model.eval()
    total, count, correct = 0.0, 0, 0
    for batch in DataLoader(dataset, batch_size=args.batch_size_test):
        _, summed, n, right = forward(model, to_device(tuple(batch), device), args, device)
        total, count, correct = total + summed, count + n, correct + right
    loss = total / max(count, 1)
    if args.task == "causal-lm":
        return {"loss": loss, "perplexity": math.exp(loss)}
    return {"loss": loss, "accuracy": correct / max(count, 1)}


def metric_name(args) -> str:
    return "perplexity" if args.task == "causal-lm" else "accuracy"


def shown(args, value: float) -> str:
    return f"{value:.3f}" if args.task == "causal-lm" else f"{100 * value:.2f} %"


# ------------------------------------------------------------------------------ training
def train_epoch(run, args, setup, epoch: int) -> dict:
    """One pass of Poisson batches; raises PrivacyBudgetExceededError from ``step``."""
    run.model.train()
    set_epoch(run.train_loader, epoch)
    torch.manual_seed(args.seed * 10_007 + epoch)  # dropout, if any: a resumed run draws the same
    loss_sum, seen, steps, before = 0.0, 0, 0, run.accounted_steps()
    epsilon, show = run.epsilon(), setup.is_main and not args.no_progress
    with EpochProgress(total=len(run.train_loader), epoch=epoch, enabled=show) as bar, \
            physical_batches(run) as batches:
        for batch, take_step in batches:
            batch = to_device(tuple(batch), setup.device)
            run.optimizer.zero_grad(set_to_none=True)
            if len(batch[0]):  # an empty Poisson batch still takes its (noise only) step
                loss = forward(run.model, batch, args, setup.device)[0]
                loss.backward()
                loss_sum, seen = loss_sum + loss.item() * len(batch[0]), seen + len(batch[0])
            run.optimizer.step() if take_step else run.optimizer.virtual_step()
            stepped = run.accounted_steps() - before if run.private else steps + take_step
            if run.private and epsilon_due(stepped, steps, args.print_freq):
                epsilon = run.epsilon()
            steps = stepped
            bar.advance(loss=f"{loss_sum / max(seen, 1):.3f}", eps=f"{epsilon:.3f}")
        epsilon = run.epsilon()
        bar.close(loss=f"{loss_sum / max(seen, 1):.3f}", eps=f"{epsilon:.3f}")
    loss_sum, seen = _sum_over_processes(setup.device, loss_sum, seen)
    return {"epoch": epoch, "train_loss": loss_sum / max(seen, 1), "steps": steps,
            "epsilon": epsilon, "total_steps": run.accounted_steps()}


def build_run(args, setup, tokenizer, train_set, num_labels: int):
    """Model (→ DPDDP under torchrun), optimizer of the trainable weights, privacy engine; resumed
    from ``--resume`` if given. Returns ``(run, checkpoint entries)``."""
    torch.manual_seed(args.seed)
    model = wrap_model(build_model(args, tokenizer, num_labels).to(setup.device), setup, private=not args.disable_dp)
    optimizer = make_optimizer(args, [p for p in model.parameters() if p.requires_grad])
    saved = checkpoints.read(args.resume, args.unsafe_resume) if args.resume else {}
    sigma = checkpoints.saved_noise_multiplier(args, saved, lambda text: say(setup, text))
    run = prepare_training(args, model, optimizer, train_set, setup, noise_multiplier=sigma)
    if args.max_physical_batch_size:
        run.physical_limit = args.max_physical_batch_size
    entries = checkpoints.restore(run, args.resume, map_location=setup.device,
                                  unsafe=args.unsafe_resume) if args.resume else {}
    return run, entries


def say(setup, text: str) -> None:
    if setup.is_main:
        print(text, flush=True)


def save(run, args, setup, entries: dict, best: bool = False) -> None:
    if setup.is_main:
        checkpoints.save(run, args.checkpoint_file, entries, best=best)
    barrier(setup)


def train(args, setup, run, entries: dict, test_set) -> dict:
    """The epochs after the resumed one, evaluating and saving after each; the final figures."""
    from opacus_dp.errors import PrivacyBudgetExceededError

    name, lower_is_better = metric_name(args), args.task == "causal-lm"
    model = checkpoints.unwrap(run.model)
    say(setup, f"checkpoint: {args.checkpoint_file}")
    if args.resume:
        per_epoch = len(run.train_loader)
        say(setup, resume_line(args.resume, steps=run.accounted_steps() if run.private else
                               entries.get("epoch", 0) * per_epoch, planned_steps=args.epochs * per_epoch,
                               finished=first_epoch(args, entries) > args.epochs,
                               epsilon=run.epsilon() if run.private else None))
    initial = entries.get("initial") or evaluate(model, test_set, args, setup.device)
    say(setup, f"before training: held-out {name} {shown(args, initial[name])}")
    log = MetricsLog(args.metrics_file, args.tensorboard, enabled=setup.is_main, settings=vars(args),
                     history=entries.get("metrics"))
    best, stopped, test = entries.get("best", initial[name]), None, None
    for epoch in range(first_epoch(args, entries), args.epochs + 1):
        set_learning_rate(run.optimizer, args, epoch)
        try:
            record = train_epoch(run, args, setup, epoch)
        except PrivacyBudgetExceededError as error:
            say(setup, f"stopping: {error}")
            stopped = "privacy budget"
            save(run, args, setup, dict(epoch=epoch - 1, initial=initial, best=best, metrics=log.epochs,
                                        stopped=stopped))
            break
        test = evaluate(model, test_set, args, setup.device)
        log.add_epoch(dict(record, test_loss=test["loss"], **{name: test[name]}))
        improved = test[name] < best if lower_is_better else test[name] > best
        best = min(best, test[name]) if lower_is_better else max(best, test[name])
        save(run, args, setup, dict(epoch=epoch, initial=initial, best=best, metrics=log.epochs), best=improved)
        eps = f", ε = {record['epsilon']:.3f}" if run.private else ""
        say(setup, f"epoch {epoch}: train loss {record['train_loss']:.4f}, held-out {name} "
                   f"{shown(args, test[name])}{eps}")
    final = test if test is not None and stopped is None else evaluate(model, test_set, args, setup.device)
    return dict(initial=initial, final=final, stopped=stopped, log=log)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args)
    train_set, test_set, names, about = load_data(args, tokenizer)
    setup = init_from_args(args)
    try:
        unit = f"blocks of {args.block_size} tokens" if not names else "texts" if args.dataset else "lines"
        say(setup, f"data: {about}: {len(train_set)} training and {len(test_set)} held-out {unit}"
                   + (f", classes {', '.join(map(str, names))}" if names else ""))
        run, entries = build_run(args, setup, tokenizer, train_set, len(names or [0, 1]))
        model = checkpoints.unwrap(run.model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        say(setup, f"model: {args.model_name_or_path or args.from_config + ' (random, from config)'}"
                   f"{' + LoRA r=%d' % args.lora_rank if args.lora else ''}, "
                   f"{sum(p.numel() for p in model.parameters()):,} parameters, {trainable:,} trained")
        if run.private:
            say(setup, run_settings_line(run, args.epochs, C=f"{args.max_grad_norm:g}"))
        if args.evaluate:
            result = evaluate(model, test_set, args, setup.device)
            say(setup, f"held-out {metric_name(args)} = {shown(args, result[metric_name(args)])} "
                       f"(checkpoint {args.resume})")
            return 0
        out = train(args, setup, run, entries, test_set)
        name, epsilon = metric_name(args), run.epsilon()
        out["log"].finish(**{f"initial_{name}": out["initial"][name], name: out["final"][name]},
                          test_loss=out["final"]["loss"], epsilon=epsilon, privacy=run.privacy_summary(),
                          world_size=setup.world_size, stopped=out["stopped"])
        say(setup, f"held-out {name} = {shown(args, out['final'][name])} "
                   f"(before training: {shown(args, out['initial'][name])})")
        if run.private:
            say(setup, privacy_line(epsilon, args.delta, run.engine.accountant.mechanism()))
        return 0
    finally:
        shutdown(setup)


if __name__ == "__main__":
    sys.exit(main())
