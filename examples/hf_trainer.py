#!/usr/bin/env python3
"""Private (DP-SGD) fine-tuning of a causal language model with the Hugging Face ``Trainer``
(``opacus_dp.integrations.transformers.DPTrainer``), all weights or LoRA adapters (``--lora``).

Model: by default a small randomly initialised GPT-2 built from a config with a byte-level
tokenizer, so the script runs offline; ``--model-name-or-path`` loads a pretrained model and its
tokenizer with ``from_pretrained`` (a local folder or a hub name).

Data: the Python Language Reference shipped in ``pydoc_data.topics``, cut into blocks of
``--block-size`` tokens; one block is one example, the unit the (ε, δ) guarantee protects.

Batches: each step is a Poisson sample with expected size ``--batch-size × --accumulation`` (the
Trainer's ``per_device_train_batch_size × gradient_accumulation_steps``), run in pieces of at most
``--batch-size`` examples. ε is logged with the loss; checkpoints (``--save-steps``) hold the
privacy state and ``--resume`` continues from the last one exactly.

Examples::

    python examples/hf_trainer.py                                   # tiny GPT-2, offline, < 1 min
    python examples/hf_trainer.py --lora --target-epsilon 4 --epochs 2
    python examples/hf_trainer.py --save-steps 10 --output-dir runs/dp && \\
        python examples/hf_trainer.py --save-steps 10 --output-dir runs/dp --resume
    python examples/hf_trainer.py --model-name-or-path gpt2 --lora --block-size 128 --bf16
    torchrun --nproc_per_node=2 examples/hf_trainer.py --max-epsilon 8
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_data  # noqa: E402
from common.cli import add_fast_noise_arg  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument("--model-name-or-path", default=None, metavar="PATH",
                       help="pretrained model and tokenizer (from_pretrained); default: a tiny GPT-2, offline")
    model.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    model.add_argument("--lora-rank", type=int, default=8, help="rank r of the LoRA adapters")
    model.add_argument("--bf16", action="store_true", help="forward pass under bfloat16 autocast")
    data = parser.add_argument_group("data and training")
    data.add_argument("--block-size", type=int, default=32, help="tokens per example")
    data.add_argument("--max-examples", type=int, default=512, help="training blocks kept (0: all)")
    data.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size (a piece)")
    data.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps")
    data.add_argument("--epochs", type=float, default=1.0, help="num_train_epochs")
    data.add_argument("--max-steps", type=int, default=-1, help="max_steps (-1: from --epochs)")
    data.add_argument("--lr", type=float, default=5e-3, help="learning rate (AdamW)")
    data.add_argument("--output-dir", default="hf_trainer_output", help="checkpoints and logs")
    data.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    data.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    data.add_argument("--seed", type=int, default=0, help="seed of the model, the sampling and the noise")
    privacy = parser.add_argument_group("privacy")
    privacy.add_argument("--sigma", type=float, default=None, help="noise multiplier (default 1.0)")
    privacy.add_argument("--target-epsilon", type=float, default=None, help="calibrate sigma to spend this epsilon")
    privacy.add_argument("--delta", type=float, default=1e-5, help="target delta")
    privacy.add_argument("--max-grad-norm", type=float, default=1.0, help="per-example clipping bound C")
    privacy.add_argument("--max-epsilon", type=float, default=None, help="stop before epsilon exceeds this")
    add_fast_noise_arg(privacy)
    args = parser.parse_args(argv)
    if args.sigma is not None and args.target_epsilon is not None:
        parser.error("--sigma and --target-epsilon exclude each other")
    if args.sigma is None and args.target_epsilon is None:
        args.sigma = 1.0
    for name in ("block_size", "batch_size", "accumulation", "lora_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


class Blocks(torch.utils.data.Dataset):
    """Token blocks as the Trainer's dict examples; the labels are the inputs (the model shifts)."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def load_model_and_tokenizer(args):
    import transformers

    if args.model_name_or_path is None:
        tokenizer = text_data.ByteTokenizer()
        config = transformers.GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=64, n_layer=2, n_head=4,
                                         n_positions=args.block_size, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, use_cache=False, bos_token_id=tokenizer.eos_token_id,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(args.seed)
        model = transformers.GPT2LMHeadModel(config)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name_or_path)
        if tokenizer.eos_token_id is None:
            raise SystemExit(f"--model-name-or-path {args.model_name_or_path}: the tokenizer has no end-of-text token")
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
        model.config.use_cache = False
    if args.lora:
        import peft

        config = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                 fan_in_fan_out=model.config.model_type == "gpt2", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
    return model, tokenizer


def main(argv=None) -> dict:
    args = parse_args(argv)
    import transformers
    from opacus_dp.integrations.transformers import DPTrainer, PrivacyArguments

    model, tokenizer = load_model_and_tokenizer(args)
    train_docs, test_docs = text_data.split_documents(text_data.language_reference(), 0.1, args.seed)
    limit = args.max_examples or None
    train = Blocks(text_data.lm_blocks(tokenizer, train_docs, args.block_size, limit).tensors[0])
    test = Blocks(text_data.lm_blocks(tokenizer, test_docs, args.block_size, limit).tensors[0])
    training = transformers.TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation, num_train_epochs=args.epochs, max_steps=args.max_steps,
        learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=5, report_to=[], seed=args.seed,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        per_device_eval_batch_size=64, bf16=args.bf16, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    privacy = PrivacyArguments(noise_multiplier=args.sigma, target_epsilon=args.target_epsilon,
                               target_delta=args.delta, max_grad_norm=args.max_grad_norm,
                               max_epsilon=args.max_epsilon, fast_noise=args.fast_noise)
    trainer = DPTrainer(model=model, args=training, train_dataset=train, eval_dataset=test, privacy_args=privacy)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    epsilon = trainer.get_epsilon()
    print(f"{trainer.state.global_step} steps, sigma = {trainer.noise_multiplier:.4g}, "
          f"epsilon = {epsilon:.3f} at delta = {args.delta:g}; held-out loss {metrics['eval_loss']:.3f}")
    return {"epsilon": epsilon, "steps": trainer.state.global_step, "train_examples": len(train),
            "sigma": trainer.noise_multiplier, **metrics}


if __name__ == "__main__":
    main()
