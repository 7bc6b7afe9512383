"""Compatibility matrix: real architectures x every ``grad_sample_mode``.

Each architecture of :mod:`tests.hf.matrix_models` (tiny, random weights, float64, no dropout)
takes one σ = 0 step with clipping active (the bound lies between the smallest and the largest
per-sample norm) in ``hooks``, ``functorch``, ``ghost`` and ``bk``. The update must equal the
microbatch oracle (each sample differentiated alone, clipped, averaged), or the step must be
refused with the message recorded in ``REFUSED``; docs/supported_models.md and the README table
must say the same. GPT-2 and BERT (full fine-tuning) are checked the same way in
``test_transformers_models.py``.

Tolerance: ``RTOL`` of the largest entry of the oracle's update (the release criterion is
2e-3). The models run in float64, but Hugging Face's RMS norms (Llama, Qwen2, Mistral, T5)
compute their statistics in float32; the batch's backward pass carries the gradient scaled by
1/B through those float32 operations, the oracle's carries it unscaled, so the two round
differently at about 1e-7.
"""

import functools
import re
from pathlib import Path

import pytest

from opacus_dp.errors import UnsupportedModuleError
from tests.hf import matrix_models as mm
from tests.hf.helpers import MODES, assert_update_matches, oracle_step, private_update

RTOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap of CPU attention
ROOT = Path(__file__).resolve().parents[2]

# name -> (error type, pattern of its message); the same in every mode
REFUSED = {
    "T5": (UnsupportedModuleError, r"relative_attention_bias \(Embedding\) cannot be trained privately: it is looked "
           r"up with position ids that have no batch dimension"),
    "wav2vec2": (UnsupportedModuleError, r"pos_conv_embed\.conv \(ParametrizedConv1d\) cannot be private: "
                 r"its weights come from torch\.nn\.utils\.parametrize"),
}
CHECKED_ELSEWHERE = ["GPT-2", "BERT"]  # test_transformers_models.py
MATCHING = [a for a in mm.ARCHITECTURES if a.name not in REFUSED]
REFUSING = [a for a in mm.ARCHITECTURES if a.name in REFUSED]


@functools.lru_cache(maxsize=None)
def _oracle(name: str):
    arch = next(a for a in mm.ARCHITECTURES if a.name == name)
    return oracle_step(arch.build(), arch.loss, arch.batch_size)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", MATCHING, ids=lambda a: a.name)
def test_private_step_equals_the_oracle(arch, mode):
    pytest.importorskip(arch.library)
    expected, bound, scale = _oracle(arch.name)
    got = private_update(arch.build(), arch.loss, arch.batch_size, bound, mode)
    assert_update_matches(expected, got, scale, RTOL, f"{arch.name} / {mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", REFUSING, ids=lambda a: a.name)
def test_refused_with_a_clear_message(arch, mode):
    pytest.importorskip(arch.library)
    error, pattern = REFUSED[arch.name]
    with pytest.raises(error, match=pattern):
        private_update(arch.build(), arch.loss, arch.batch_size, 1.0, mode)


@pytest.mark.parametrize("mode", MODES)
def test_t5_with_sequence_length_equal_to_the_batch_size_is_refused_too(mode):
    """T5's relative-position ids (T, T) have no batch dimension: with T = B they would pass for
    a batch and the table's per-sample gradients would be wrong, silently. The trainable table
    is refused by structure, whatever T and B."""
    pytest.importorskip("transformers")
    error, pattern = REFUSED["T5"]
    with pytest.raises(error, match=pattern):
        private_update(mm.t5(), mm.seq2seq_square_loss, 4, 1.0, mode)


def _table_rows(path: Path):
    """``{first cell: other cells}`` of the markdown table rows of ``path``."""
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 5 and not set(cells[0]) <= set("-: "):
            rows[cells[0]] = cells[1:]
    return rows


def test_the_docs_table_records_every_architecture_and_mode():
    rows = _table_rows(ROOT / "docs" / "supported_models.md")
    header = rows.pop("Architecture")
    assert header[:4] == MODES
    names = [a.name for a in mm.ARCHITECTURES] + CHECKED_ELSEWHERE
    assert sorted(rows) == sorted(names)
    for name in names:
        want = "refused" if name in REFUSED else "✓"
        assert all(cell.startswith(want) for cell in rows[name][:4]), (name, rows[name])


def test_the_readme_table_records_the_refusals():
    rows = _table_rows(ROOT / "README.md")
    for name in REFUSED:
        cells = next(cells for first, cells in rows.items() if re.match(rf"{re.escape(name)}\b", first))
        assert all(cell.startswith("refused") for cell in cells[:4]), (name, cells)
    assert sum(cells[:4] == ["✓"] * 4 for cells in rows.values()) >= 4
