"""End-to-end runs of examples/fsdp_finetune.py under torchrun: 2 gloo processes, a tiny Llama
(built from a config, or saved and read back with ``from_pretrained``) sharded with FSDP2, 128
blocks of the Language Reference.

The script prints its σ, q and steps per epoch, and a final ``final: steps=N epsilon=E
perplexity=P`` line with every digit (``repr``); the tests recompute ε from (σ, q, N) with fresh
accountants (ours and Opacus'), and compare runs figure by figure: straight vs resumed, whole
Poisson batches vs pieces of ``BatchMemoryManager``.
"""

import math
import re
import warnings

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from opacus_dp.accountants import create_accountant  # noqa: E402
from tests.examples.example_runs import example_module, run_torchrun  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

N = 128  # training blocks (--max-examples)
BATCH = 32  # expected global batch: q = 32/128, 4 steps per epoch
SIGMA = 1.0
SMALL = ["--max-examples", N, "--block-size", 32, "--hidden-size", 32, "--n-heads", 2, "--n-layers", 1,
         "--batch-size", BATCH, "--batch-size-test", 64, "--sigma", SIGMA]
PRIVACY = re.compile(r"privacy: sigma=(\S+) q=(\S+) steps_per_epoch=(\d+) delta=(\S+) accountant=(\w+)")
FINAL = re.compile(r"^final: steps=(\d+) epsilon=(\S+) perplexity=(\S+)$", re.MULTILINE)
BEFORE = re.compile(r"before training: held-out perplexity ([0-9.]+)")


def _privacy(out: str) -> dict:
    found = PRIVACY.search(out)
    assert found, out
    sigma, q, per_epoch, delta, accountant = found.groups()
    return {"sigma": float(sigma), "q": float(q), "steps_per_epoch": int(per_epoch), "delta": float(delta),
            "accountant": accountant}


def _final(out: str) -> dict:
    found = FINAL.findall(out)
    assert len(found) == 1, out
    steps, epsilon, perplexity = found[0]
    return {"steps": int(steps), "epsilon": float(epsilon), "perplexity": float(perplexity)}


def _replayed_epsilon(make, privacy: dict, steps: int) -> float:
    """ε of ``steps`` steps of (σ, q) according to a fresh accountant from ``make(name)``."""
    accountant = make(privacy["accountant"])
    for _ in range(steps):
        accountant.step(noise_multiplier=privacy["sigma"], sample_rate=privacy["q"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(accountant.get_epsilon(privacy["delta"]))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Two epochs in one go, checkpointing after each: ``(output, checkpoint dir)``."""
    folder = tmp_path_factory.mktemp("straight")
    out = run_torchrun("fsdp_finetune", [*SMALL, "--epochs", 2, "--checkpoint-dir", folder / "ckpt"])
    return out, folder / "ckpt"


def test_epsilon_equals_an_independent_accountant(straight):
    out, _ = straight
    privacy, final = _privacy(out), _final(out)
    assert privacy["q"] == 1 / math.ceil(N / BATCH)  # --batch-size is the global batch, not each rank's
    assert privacy["sigma"] == SIGMA and privacy["accountant"] == "prv"
    assert final["steps"] == 2 * privacy["steps_per_epoch"] == 2 * math.ceil(N / BATCH)
    ours = _replayed_epsilon(create_accountant, privacy, final["steps"])
    assert final["epsilon"] == pytest.approx(ours, rel=1e-9)
    opacus = pytest.importorskip("opacus.accountants")
    assert final["epsilon"] == pytest.approx(_replayed_epsilon(opacus.create_accountant, privacy, final["steps"]),
                                             rel=0.02)
    epochs = re.findall(r"epoch (\d): train loss ([0-9.]+), held-out perplexity ([0-9.]+), ε = ([0-9.]+)", out)
    assert [e[0] for e in epochs] == ["1", "2"], out
    assert float(epochs[-1][3]) == pytest.approx(final["epsilon"], abs=5e-5)
    assert float(epochs[0][3]) < float(epochs[1][3])
    initial = float(BEFORE.search(out).group(1))
    assert math.isfinite(final["perplexity"]) and final["perplexity"] < initial, out


def test_only_rank_zero_prints(straight):
    out, _ = straight
    assert out.count("privacy: sigma=") == 1 and out.count("epoch 1:") == 1, out


def test_resume_continues_bit_exactly(straight, tmp_path):
    out, folder = straight
    assert (folder / "private_rank0.pt").is_file() and (folder / "private_rank1.pt").is_file()
    part = tmp_path / "ckpt"
    first = run_torchrun("fsdp_finetune", [*SMALL, "--epochs", 1, "--checkpoint-dir", part])
    resumed = run_torchrun("fsdp_finetune", [*SMALL, "--epochs", 2, "--checkpoint-dir", part, "--resume"])
    assert _final(first)["steps"] == _privacy(first)["steps_per_epoch"]
    assert "resumed from" in resumed and "epoch 1:" not in resumed and "epoch 2:" in resumed, resumed
    assert _final(resumed) == _final(out)  # ε, perplexity (every digit) and steps


def test_physical_batches_change_memory_only(straight, tmp_path):
    """--max-physical-batch-size 3 cuts each rank's share into pieces (the smaller shares get
    empty ones, as every rank runs the same number): the same steps, ε and model."""
    out, _ = straight
    cut = run_torchrun("fsdp_finetune", [*SMALL, "--epochs", 2, "--max-physical-batch-size", 3])
    whole, pieces = _final(out), _final(cut)
    assert pieces["steps"] == whole["steps"] and pieces["epsilon"] == whole["epsilon"]
    assert pieces["perplexity"] == pytest.approx(whole["perplexity"], rel=1e-4)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama with tied input and output embeddings (as Llama 3.2's) and a byte-level
    tokenizer, saved as ``from_pretrained`` reads them."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("pretrained")
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {**{c: i for i, c in enumerate(alphabet)}, "<|end_of_text|>": len(alphabet)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end_of_text|>").save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=True, eos_token_id=len(alphabet))
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_ghost_bf16_run_of_a_checkpoint_reaches_the_target_epsilon(pretrained):
    target = 3.0
    out = run_torchrun("fsdp_finetune", [*SMALL[:4], "--batch-size", BATCH, "--model-name-or-path", pretrained,
                                         "--lr", 0.01, "--epochs", 1, "--grad-sample-mode", "ghost", "--bf16",
                                         "--epsilon", target, "--accountant", "rdp"])
    privacy, final = _privacy(out), _final(out)
    assert f"model: {pretrained}, " in out and "bf16" in out and "mode=ghost" in out
    assert privacy["sigma"] > SIGMA  # calibrated: 4 steps of q = 1/4 at σ = 1 spend more than ε = 3
    assert final["steps"] == privacy["steps_per_epoch"] == math.ceil(N / BATCH)
    assert target - 0.05 <= final["epsilon"] <= target
    assert final["epsilon"] == pytest.approx(_replayed_epsilon(create_accountant, privacy, final["steps"]), rel=1e-9)
    initial = float(BEFORE.search(out).group(1))
    assert math.isfinite(final["perplexity"]) and final["perplexity"] < initial, out


@pytest.mark.parametrize("flags, message", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--model-name-or-path", "x", "--from-config", "llama"], "exclude each other"),
    (["--hidden-size", 30, "--n-heads", 4], "multiple of --n-heads"),
    (["--max-physical-batch-size", 0], "--max-physical-batch-size must be at least 1"),
    (["--sigma", -1], "--sigma must be a finite number"),
    (["--epsilon", "nan"], "--epsilon must be a finite number > 0"),
    (["--grad-sample-mode", "functorch"], "invalid choice"),
])
def test_bad_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example_module("fsdp_finetune").parse_args([str(a) for a in flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_philox_noise_resumes_bit_exactly_and_is_another_stream(straight, tmp_path):
    philox = [*SMALL, "--fast-noise", "philox"]
    whole = run_torchrun("fsdp_finetune", [*philox, "--epochs", 2, "--checkpoint-dir", tmp_path / "whole"])
    run_torchrun("fsdp_finetune", [*philox, "--epochs", 1, "--checkpoint-dir", tmp_path / "part"])
    resumed = run_torchrun("fsdp_finetune", [*philox, "--epochs", 2, "--checkpoint-dir", tmp_path / "part",
                                             "--resume"])
    assert _final(resumed) == _final(whole)  # ε, perplexity (every digit) and steps
    assert _final(whole)["epsilon"] == _final(straight[0])["epsilon"]  # the noise changes no accounting
    assert _final(whole)["perplexity"] != _final(straight[0])["perplexity"]  # but it is another stream
