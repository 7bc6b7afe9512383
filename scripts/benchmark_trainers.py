"""Step time of private and non-private training through other software, eager and compiled.

One Llama or GPT-2 (``--model``) built from its config (no download) trains on random token
blocks (next-token loss), four ways, in one process, with the framework of ``--framework``:

* ``hf``: the Hugging Face ``Trainer`` and the ``DPTrainer``, compiled with ``torch_compile=True``;
* ``lightning``: a ``LightningModule`` fitted by a Lightning ``Trainer``, without and with
  ``DPCallback``, compiled as ``trainer.fit(torch.compile(module))``;

private runs with σ = 1, C = 1, Poisson batches of expected size ``--batch-size`` and the noise
generator ``--fast-noise`` (off, threads, philox), compiled runs with ``--backend``. Each run
takes ``--steps`` steps; its step time is the median wall time of the steps after ``--warmup``
(compiling happens there).
``--rounds`` repeats the four runs; the ratios are medians over rounds of each round's ratio:

* ``x eager``: the compiled run's step over the same trainer's eager step;
* ``x non-private``: the private step over the non-private step of the same kind (eager or compiled).

``graphs`` and ``breaks``: what dynamo built for the run (:mod:`scripts.compile_stats`).

    python scripts/benchmark_trainers.py --framework hf --threads 1
    python scripts/benchmark_trainers.py --framework lightning --threads 1 [--fast-noise philox]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opacus_dp.engine.fast_noise import FAST_NOISE_NAMES  # noqa: E402
from scripts.compile_stats import counting  # noqa: E402

VARIANTS = ("non-private", "non-private compiled", "private", "private compiled")


def causal_lm(args):
    """The ``--model`` (a Llama or a GPT-2) built from its config, seeded."""
    import transformers

    torch.manual_seed(0)
    if args.model == "gpt2":
        config = transformers.GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=4,
                                         n_positions=args.length, use_cache=False)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=args.length, use_cache=False)
    return transformers.LlamaForCausalLM(config)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run(variant: str, args, out_dir: str) -> dict:
    """One training run; ``{"ms": median step ms, "graphs": ..., "breaks": ...}``."""
    times = []
    compiled, private = variant.endswith("compiled"), variant.startswith("private")
    torch._dynamo.reset()
    with counting() as stats, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = _hf_run if args.framework == "hf" else _lightning_run
        train(args, out_dir, private, compiled, times)
    return {"ms": 1000 * statistics.median(times[args.warmup:]), "graphs": stats["graphs"],
            "breaks": stats["graph_breaks"]}


def _hf_run(args, out_dir: str, private: bool, compiled: bool, times: list) -> None:
    import transformers

    from opacus_dp.integrations.transformers import DPTrainer, PrivacyArguments

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    training = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args.batch_size, max_steps=args.steps, report_to=[],
        use_cpu=args.device == "cpu", save_strategy="no", disable_tqdm=True, logging_steps=10 ** 6, seed=0,
        torch_compile=compiled, torch_compile_backend=args.backend if compiled else None)
    common = dict(model=causal_lm(args), args=training, train_dataset=Blocks(args.examples, args.length, args.vocab),
                  callbacks=[Clock()])
    if private:
        privacy = PrivacyArguments(target_delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0,
                                   fast_noise=args.fast_noise)
        DPTrainer(privacy_args=privacy, **common).train()
    else:
        transformers.Trainer(**common).train()


def _lightning_run(args, out_dir: str, private: bool, compiled: bool, times: list) -> None:
    import lightning.pytorch as pl

    from opacus_dp.integrations.lightning import DPCallback, PrivateDataLoader

    class Clock(pl.Callback):
        def on_train_batch_start(self, *a):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *a):
            times.append(time.perf_counter() - self.start)

    class CausalLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = causal_lm(args)

        def forward(self, ids):
            return self.net(input_ids=ids).logits

        def training_step(self, batch, batch_idx):
            ids = batch["input_ids"]
            logits = self(ids)[:, :-1].float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=5e-5)

        def train_dataloader(self):
            loader = torch.utils.data.DataLoader(Blocks(args.examples, args.length, args.vocab),
                                                 batch_size=args.batch_size)
            return PrivateDataLoader(loader) if private else loader

    callbacks = [Clock()]
    if private:
        callbacks.append(DPCallback(target_delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0,
                                    fast_noise=args.fast_noise))
    module = CausalLM()
    trainer = pl.Trainer(max_steps=args.steps, accelerator=args.device, devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, default_root_dir=out_dir)
    trainer.fit(torch.compile(module, backend=args.backend) if compiled else module)


def report(rounds) -> str:
    """The table of the module doc, from ``rounds``: one ``{variant: run}`` per round."""
    def paired(numerator: str, denominator: str) -> float:
        return statistics.median(r[numerator]["ms"] / r[denominator]["ms"] for r in rounds)

    lines = [f"{'variant':22s} {'step ms':>9s} {'x eager':>8s} {'x non-private':>14s} {'graphs':>7s} {'breaks':>7s}"]
    for variant in VARIANTS:
        compiled = variant.endswith("compiled")
        eager = variant.replace(" compiled", "")
        x_eager = f"{paired(variant, eager):8.2f}" if compiled else f"{'':8s}"
        plain = variant.replace("private", "non-private") if variant.startswith("private") else None
        x_plain = f"{paired(variant, plain):14.2f}" if plain else f"{'':14s}"
        last = rounds[-1][variant]
        lines.append(f"{variant:22s} {statistics.median(r[variant]['ms'] for r in rounds):9.1f} {x_eager} {x_plain} "
                     f"{last['graphs']:7d} {last['breaks']:7d}")
    return "\n".join(lines)


def main(argv=None) -> list:
    """Run the benchmark (module doc), print the table and return the rounds (:func:`report`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=("hf", "lightning"), default="hf")
    parser.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--fast-noise", choices=tuple(FAST_NOISE_NAMES), default="off",
                        help="the private runs' noise generator")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be below --steps")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out_dir:
        rounds = [{variant: run(variant, args, out_dir) for variant in VARIANTS} for _ in range(args.rounds)]
    table = report(rounds)
    print(f"{args.framework}: {args.model} {args.layers} layers, hidden {args.hidden}, T = {args.length}, B = {args.batch_size}, "
          f"{args.threads} thread(s), backend {args.backend}, {args.device}, noise {args.fast_noise}")
    print(table)
    return rounds


if __name__ == "__main__":
    main()
