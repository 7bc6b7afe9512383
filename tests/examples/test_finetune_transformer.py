"""End-to-end runs of examples/finetune_transformer.py, offline, on small slices of its data.

Data: the Language Reference shipped in ``pydoc_data.topics`` (causal LM), standard-library
source lines labelled code/docstring (classify), and a local folder read by ``datasets``. Models:
tiny GPT-2/Llama built from configs, and a GPT-2 + byte-level tokenizer saved with
``save_pretrained`` for the ``--model-name-or-path`` path. Every run checks the printed ε against
the saved (σ, q, steps) history replayed by our accountant and by Opacus.
"""

import json
import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.examples.example_runs import (  # noqa: E402
    SECURE_MODE_WARNING,
    assert_epsilon_consistent,
    assert_history,
    example_module,
    load_checkpoint,
    read_json,
    run_example,
    run_in_processes,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(SECURE_MODE_WARNING),
              pytest.mark.filterwarnings("ignore::UserWarning:peft.*"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]

SIGMA = 0.8
N = 256  # --max-examples: training examples (and at most as many held out)
SMALL = ["--block-size", 32, "--hidden-size", 32, "--n-heads", 2, "--n-layers", 1, "--max-examples", N,
         "--batch-size", 64, "--sigma", SIGMA, "--no-progress"]  # q = 64/256: 4 steps per epoch
RESULT = re.compile(r"held-out (perplexity|accuracy) = ([0-9.]+)( %)? \(before training: ([0-9.]+)")


def _argv(out, *extra, epochs=1, name="run"):
    return [*SMALL, "--epochs", epochs, "--checkpoint-file", out / f"{name}.pt",
            "--metrics-file", out / f"{name}.json", *extra]


def _result(out: str):
    """``(final, initial)`` as printed (accuracy as a fraction)."""
    kind, final, percent, initial = RESULT.findall(out)[-1]
    scale = 0.01 if percent else 1.0
    return float(final) * scale, float(initial) * scale


def _weights(path):
    return load_checkpoint(path)["module_state_dict"]


def _held_out(argv):
    """The script's own held-out set and tokenizer for ``argv``."""
    ft = example_module("finetune_transformer")
    args = ft.parse_args([str(a) for a in argv])
    tokenizer = ft.load_tokenizer(args)
    return ft, args, tokenizer, ft.load_data(args, tokenizer)[1]


def test_causal_lm_improves_and_reports_true_perplexity(tmp_path, capsys):
    argv = _argv(tmp_path, epochs=2)
    out = run_example("finetune_transformer", argv, capsys)
    metrics = read_json(tmp_path / "run.json")
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=64 / N, steps=8)
    assert_epsilon_consistent(out, metrics["privacy"])
    final, initial = _result(out)
    assert math.isfinite(final) and initial > 150 and final < 0.8 * initial, out
    assert metrics["perplexity"] == pytest.approx(final, abs=5e-4)
    # Independently: exp of transformers' own next-token loss of the saved model on the held-out blocks.
    ft, args, tokenizer, test_set = _held_out(argv)
    model = transformers.AutoModelForCausalLM.from_config(ft.tiny_config(args, tokenizer, 2))
    model.load_state_dict(_weights(tmp_path / "run.pt"))
    (blocks,) = test_set.tensors
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss
    assert math.exp(float(loss)) == pytest.approx(metrics["perplexity"], rel=1e-4)
    # --evaluate reads the checkpoint and prints the same figure.
    again = run_example("finetune_transformer", [*argv, "--resume", tmp_path / "run.pt", "--evaluate"], capsys)
    assert f"held-out perplexity = {final:.3f}" in again


def test_progress_bar_shows_epsilon_from_the_first_step(tmp_path, capsys):
    ft = example_module("finetune_transformer")
    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        assert ft.main([str(a) for a in _argv(tmp_path) if a != "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    shown = [float(v) for v in re.findall(r"eps=([0-9.]+)", capsys.readouterr().err)]
    assert shown and shown[0] == pytest.approx(3.89, abs=0.01)  # ε after one step of (0.8, 1/4)


def test_resume_equals_the_uninterrupted_run(tmp_path, capsys):
    run_example("finetune_transformer", _argv(tmp_path, name="part"), capsys)
    out = run_example("finetune_transformer", _argv(tmp_path, "--resume", tmp_path / "part.pt", epochs=2,
                                                    name="part"), capsys)
    run_example("finetune_transformer", _argv(tmp_path, epochs=2, name="whole"), capsys)
    part, whole = read_json(tmp_path / "part.json"), read_json(tmp_path / "whole.json")
    assert "epoch 1:" not in out and "epoch 2:" in out  # the resumed run trains epoch 2 only
    assert [e["epoch"] for e in part["epochs"]] == [1, 2]
    assert part["privacy"]["history"] == whole["privacy"]["history"]
    assert_history(part["privacy"], sigma=SIGMA, sample_rate=64 / N, steps=8)
    assert_epsilon_consistent(out, part["privacy"])
    assert part["epsilon"] == whole["epsilon"] and part["perplexity"] == whole["perplexity"]
    assert part["initial_perplexity"] == whole["initial_perplexity"]
    a, b = _weights(tmp_path / "part.pt"), _weights(tmp_path / "whole.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_physical_batches_only_change_memory_use(tmp_path, capsys, monkeypatch):
    """``--max-physical-batch-size`` (BatchMemoryManager) trains the very same model in pieces."""
    ft = example_module("finetune_transformer")
    sizes = []

    def recording(model, batch, *rest):
        if torch.is_grad_enabled():  # training, not evaluation
            sizes.append(len(batch[0]))
        return forward(model, batch, *rest)

    forward = ft.forward
    monkeypatch.setattr(ft, "forward", recording)
    run_example("finetune_transformer", _argv(tmp_path, "--max-physical-batch-size", 16, name="cut"), capsys)
    cut, sizes[:] = list(sizes), []
    run_example("finetune_transformer", _argv(tmp_path, name="whole"), capsys)
    assert max(cut) <= 16 < max(sizes)
    histories = [read_json(tmp_path / f"{name}.json")["privacy"]["history"] for name in ("cut", "whole")]
    assert histories[0] == histories[1]
    a, b = _weights(tmp_path / "cut.pt"), _weights(tmp_path / "whole.pt")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)


def test_lora_trains_only_the_adapters(tmp_path, capsys):
    pytest.importorskip("peft")
    argv = _argv(tmp_path, "--from-config", "llama", "--lora", "--lora-rank", 4, "--lr", 0.02, "--bf16", epochs=2)
    out = run_example("finetune_transformer", argv, capsys)
    metrics = read_json(tmp_path / "run.json")
    assert_epsilon_consistent(out, metrics["privacy"])
    final, initial = _result(out)
    assert final < initial, out
    trained = int(re.search(r"([0-9,]+) trained", out).group(1).replace(",", ""))
    assert trained == 2 * 4 * 2 * 32  # A (4×32) and B (32×4) on q_proj and v_proj of the one layer
    ft, args, tokenizer, _ = _held_out(argv)
    torch.manual_seed(args.seed)  # the script's initial model
    fresh = ft.build_model(args, tokenizer, 2).state_dict()
    saved = _weights(tmp_path / "run.pt")
    assert fresh.keys() == saved.keys()
    changed = {k for k in saved if not torch.equal(saved[k], fresh[k])}
    assert changed and all("lora_" in k for k in changed), changed


def test_classifier_improves(tmp_path, capsys):
    argv = _argv(tmp_path, "--task", "classify", "--max-examples", 512, epochs=2)
    out = run_example("finetune_transformer", argv, capsys)
    assert "classes code, docstring" in out
    metrics = read_json(tmp_path / "run.json")
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=64 / 512, steps=16)
    assert_epsilon_consistent(out, metrics["privacy"])
    final, initial = _result(out)
    assert final >= 0.65 and final >= initial + 0.15, out  # measured: 46.7 % → 73.1 %
    assert metrics["accuracy"] == pytest.approx(final, abs=5e-5)


def test_privacy_budget_stops_cleanly(tmp_path, capsys):
    # ε after 5 steps of (σ, q) = (0.8, 1/4) is 6.71, after 6 it is 7.18: the 6th step (in epoch 2) is refused.
    out = run_example("finetune_transformer", _argv(tmp_path, "--max-epsilon", 7.0, epochs=3), capsys)
    metrics = read_json(tmp_path / "run.json")
    assert "stopping: privacy budget" in out and metrics["stopped"] == "privacy budget"
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=64 / N, steps=5)
    assert assert_epsilon_consistent(out, metrics["privacy"]) <= 7.0
    assert [e["epoch"] for e in metrics["epochs"]] == [1]
    saved = load_checkpoint(tmp_path / "run.pt")
    assert saved["privacy"]["history"] == metrics["privacy"]["history"] and saved["epoch"] == 1
    assert math.isfinite(_result(out)[0])  # the model as it stands, after the 5th step


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny GPT-2 and a byte-level tokenizer, saved as ``from_pretrained`` reads them."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("pretrained")
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {**{c: i for i, c in enumerate(alphabet)}, "<|endoftext|>": len(alphabet)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(vocab), n_positions=64,
                                     bos_token_id=len(alphabet), eos_token_id=len(alphabet))
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_model_name_or_path_loads_a_saved_checkpoint(pretrained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = run_example("finetune_transformer", _argv(tmp_path, "--model-name-or-path", pretrained, "--lr", 0.01),
                      capsys)
    assert f"model: {pretrained}, " in out
    assert_epsilon_consistent(out, read_json(tmp_path / "run.json")["privacy"])
    final, initial = _result(out)
    assert final < initial, out


def test_dataset_flag_reads_a_local_dataset(tmp_path, capsys, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "reviews"
    folder.mkdir()
    rows = {"train": 128, "test": 32}
    for split, n in rows.items():
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(json.dumps({"sentence": f"{'fine' if i % 2 else 'awful'} film number {i}",
                                    "label": "good" if i % 2 else "bad"}) + "\n")
    out = run_example("finetune_transformer", _argv(tmp_path, "--dataset", folder, "--text-column", "sentence",
                                                    "--task", "classify"), capsys)
    assert "128 training and 32 held-out texts, classes bad, good" in out
    metrics = read_json(tmp_path / "run.json")
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=64 / 128, steps=2)
    assert_epsilon_consistent(out, metrics["privacy"])


@pytest.mark.parametrize("flags, message", [
    (["--model-name-or-path", "x", "--from-config", "gpt2"], "exclude each other"),
    (["--hidden-size", 30, "--n-heads", 4], "multiple of --n-heads"),
    (["--max-physical-batch-size", 0], "--max-physical-batch-size must be at least 1"),
    (["--max-physical-batch-size", 8, "--n-accumulation-steps", 2], "give one"),
    (["--dataset-config", "x"], "--dataset-config needs --dataset"),
    (["--test-fraction", 1], "--test-fraction must lie in (0, 1)"),
    (["--task", "translate"], "invalid choice"),
    (["--lora-rank", 4], "need --lora"),
])
def test_bad_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example_module("finetune_transformer").parse_args([str(a) for a in flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_block_longer_than_the_model_is_refused(pretrained, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info:
        run_example("finetune_transformer", ["--model-name-or-path", pretrained, "--block-size", 65,
                                             "--max-examples", 8, "--no-progress"], capsys)
    assert "--block-size 65 exceeds the model's 64 positions" in str(exit_info.value)


@pytest.mark.distributed
def test_two_processes(tmp_path):
    # 2 processes × B = 32 per process: q = 64/256, 4 steps of the global batch.
    pytest.importorskip("peft")
    argv = _argv(tmp_path, "--batch-size", 32, "--lora")
    outputs = run_in_processes([("finetune_transformer", argv)], tmp_path)
    metrics = read_json(tmp_path / "run.json")
    assert metrics["world_size"] == 2
    assert_history(metrics["privacy"], sigma=SIGMA, sample_rate=64 / N, steps=4)
    assert_epsilon_consistent(outputs["finetune_transformer"], metrics["privacy"])
    assert math.isfinite(metrics["perplexity"])
