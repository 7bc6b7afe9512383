"""Shared pieces of the ``DPTrainer`` tests: a tiny GPT-2, token blocks, a batch recorder, and the
worker run by each of the gloo processes (``test_hf_trainer.py``)."""

import os
import warnings

import torch
import transformers

from opacus_dp.integrations.transformers import DPTrainer, PrivacyArguments

N, SEQ, VOCAB = 30, 6, 24
PHYSICAL, ACCUMULATION = 3, 2
L = PHYSICAL * ACCUMULATION  # expected logical batch; q = L / N
LR = 0.5


class TokenBlocks(torch.utils.data.Dataset):
    def __init__(self, seed: int = 1):
        self.ids = torch.randint(0, VOCAB, (N, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "index": i}


class Recorder(transformers.TrainerCallback):
    """Collator that drops ``index`` and records which examples formed each training batch."""

    def __init__(self):
        self.batches = []
        self.armed = False

    def __call__(self, features):
        if self.armed:
            self.batches.append([f["index"] for f in features])
        return {k: torch.stack([f[k] for f in features]) for k in ("input_ids", "labels")}

    def on_train_begin(self, args, state, control, **kwargs):
        self.armed = True


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def tiny_llama(seed: int = 0):
    """A Llama: rotary positions, no position embedding (GPT-2, :func:`tiny_model`, embeds
    positions, called on one row broadcast over the batch)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def record_output_dtypes(model) -> list:
    """The dtypes of ``model.lm_head``'s outputs in the forwards with grad (training), as they run."""
    dtypes = []
    model.lm_head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype) if torch.is_grad_enabled() else None)
    return dtypes


def training_args(out, **overrides):
    settings = dict(output_dir=str(out), per_device_train_batch_size=PHYSICAL,
                    gradient_accumulation_steps=ACCUMULATION, max_steps=4, logging_steps=1, report_to=[],
                    use_cpu=True, save_strategy="no", learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
                    weight_decay=0.0, disable_tqdm=True, remove_unused_columns=False, seed=7)
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def train_on_rank(rank: int, world_size: int, out_dir: str, steps: int, clip: float, overrides=None):
    """One process of a torchrun-style run (the process group exists already): σ = 0, clipping
    active; returns the batches this rank drew, its final parameters, the accountant's history,
    the dtypes of the training forwards' logits and the number of graphs dynamo compiled.
    ``overrides``: more ``TrainingArguments``."""
    from torch._dynamo.utils import counters

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    recorder = Recorder()
    model = tiny_model()
    dtypes = record_output_dtypes(model)
    args = training_args(out_dir, max_steps=steps, **(overrides or {}))
    trainer = DPTrainer(model=model, args=args, train_dataset=TokenBlocks(),
                        data_collator=recorder, callbacks=[recorder],
                        privacy_args=PrivacyArguments(target_delta=1e-5, noise_multiplier=0.0, max_grad_norm=clip))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    params = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    return {"batches": recorder.batches, "params": params, "steps": trainer.state.global_step,
            "history": list(trainer.privacy_engine.accountant.history), "world": trainer.args.world_size,
            "dtypes": sorted(set(str(d) for d in dtypes)), "graphs": counters["stats"]["unique_graphs"]}
