"""Text data of the transformer fine-tuning example: a byte-level tokenizer and two corpora that
ship with Python itself (no download), or a Hugging Face ``datasets`` dataset.

* **Language modelling** (``--task causal-lm``): the Python Language Reference as the standard
  library ships it in ``pydoc_data.topics`` (the text ``help("if")`` prints: 79 topics,
  about 460,000 characters). Its paragraphs are split once into train and test with a seed; each
  side is tokenized, joined (an end-of-text token after each paragraph) and cut into blocks of
  ``block_size`` tokens. **One block is one example**, the unit of privacy: (ε, δ) protects the
  presence of any single block of text.
* **Classification** (``--task classify``): lines of the standard library's own source files
  (a fixed list of modules), labelled by Python's parser: ``code`` (a statement line) or
  ``docstring`` (a line of prose inside a docstring). Comment and blank lines are left out and
  indentation is stripped, so the model has to read the words. Both classes are kept in equal
  numbers; one line is one example.

Every example has the same shape (blocks, or token ids padded to ``block_size`` with an attention
mask), so an empty Poisson batch keeps the shape of a full one.
"""

import ast
import importlib.util
import re
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils.data import TensorDataset

SOURCE_MODULES = ("argparse", "calendar", "configparser", "csv", "dataclasses", "difflib", "fractions",
                  "functools", "heapq", "inspect", "ipaddress", "pickle", "shutil", "statistics",
                  "string", "textwrap", "threading", "typing", "zipfile", "tarfile")
LINE_CLASSES = ("code", "docstring")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0–255, then padding (256) and end of text (257): fixed, offline,
    and independent of the data. ``encode``/``decode`` mirror a Hugging Face tokenizer's."""

    pad_token_id, eos_token_id, vocab_size = 256, 257, 258

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def split_documents(documents: List, test_fraction: float, seed: int) -> Tuple[List, List]:
    """``(train, test)``: a seeded random ``test_fraction`` of the documents is held out."""
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = max(1, round(test_fraction * len(documents)))
    return [documents[i] for i in order[n_test:]], [documents[i] for i in order[:n_test]]


# ------------------------------------------------------------------------------------ corpora
def language_reference() -> List[str]:
    """The paragraphs of the Language Reference shipped in ``pydoc_data.topics``, in topic order."""
    from pydoc_data.topics import topics

    return [p.strip() for name in sorted(topics) for p in re.split(r"\n\s*\n", topics[name]) if p.strip()]


def _docstring_lines(tree: ast.AST) -> set:
    """Line numbers (1-based) of the docstrings of ``tree``'s modules, classes and functions."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def source_lines(seed: int, modules: Sequence[str] = SOURCE_MODULES) -> List[Tuple[str, int]]:
    """``[(line, label)]``: the code and docstring lines of ``modules``' sources (module doc),
    the larger class cut down at random (``seed``) to the size of the smaller one."""
    by_class: List[List[str]] = [[], []]
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue  # not in this Python's standard library as source
        with open(spec.origin, encoding="utf-8") as f:
            source = f.read()
        in_docstring = _docstring_lines(ast.parse(source))
        for number, raw in enumerate(source.splitlines(), start=1):
            line = raw.strip().strip('"').strip("'").strip() if number in in_docstring else raw.strip()
            if line and not line.startswith("#"):
                by_class[int(number in in_docstring)].append(line)
    size = min(len(lines) for lines in by_class)
    generator = torch.Generator().manual_seed(seed)
    kept = [[lines[i] for i in sorted(torch.randperm(len(lines), generator=generator)[:size].tolist())]
            for lines in by_class]
    return [(line, label) for label, lines in enumerate(kept) for line in lines]


def hub_documents(name: str, config: Optional[str], text_column: str, label_column: Optional[str]):
    """``(train, test or None, class names or None)`` from ``datasets.load_dataset(name, config)``:
    its ``train`` split and its ``test`` split (``validation`` if the test split is absent or
    unlabelled); rows are texts, or ``(text, label index)`` pairs when ``label_column`` is given."""
    try:
        import datasets
    except ImportError:
        raise SystemExit("--dataset needs the datasets package (pip install datasets)") from None
    try:
        loaded = datasets.load_dataset(name, config)
    except Exception as error:  # offline, unknown name, bad config: one line, no traceback
        raise SystemExit(f"--dataset {name}: {type(error).__name__}: {error}") from None
    if "train" not in loaded:
        raise SystemExit(f"--dataset {name}: no 'train' split (splits: {', '.join(loaded)})")
    columns = loaded["train"].column_names
    for column in (text_column, label_column):
        if column is not None and column not in columns:
            raise SystemExit(f"--dataset {name}: no column {column!r} (columns: {', '.join(columns)})")

    names = None
    if label_column is not None:
        feature = loaded["train"].features[label_column]
        names = list(getattr(feature, "names", None) or sorted({str(y) for y in loaded["train"][label_column]}))

    def rows(split):
        texts = [text or "" for text in split[text_column]]
        if label_column is None:
            return texts
        labels = split[label_column]
        if not hasattr(loaded["train"].features[label_column], "names"):  # raw values: their sorted order
            labels = [names.index(str(y)) if str(y) in names else -1 for y in labels]
        return [(text, label) for text, label in zip(texts, labels) if 0 <= label < len(names)]

    held_out = (rows(loaded[split]) for split in ("test", "validation") if split in loaded)
    return rows(loaded["train"]), next((r for r in held_out if r), None), names


# ------------------------------------------------------------------------------- tensors
def lm_blocks(tokenizer, documents: Sequence[str], block_size: int,
              max_blocks: Optional[int] = None) -> TensorDataset:
    """The documents' tokens, each document followed by end of text, cut into blocks of
    ``block_size`` (the last, incomplete block is dropped); the first ``max_blocks`` if given
    (the documents after them are not even tokenized)."""
    ids: List[int] = []
    for text in documents:
        if max_blocks is not None and len(ids) >= max_blocks * block_size:
            break
        ids += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    n_blocks = min(len(ids) // block_size, max_blocks or len(ids))
    if n_blocks == 0:
        raise SystemExit(f"{len(ids)} tokens of text: not one block of --block-size {block_size}")
    return TensorDataset(torch.tensor(ids[:n_blocks * block_size]).view(n_blocks, block_size))


def padded(tokenizer, rows: Sequence[Tuple[str, int]], length: int) -> TensorDataset:
    """``(input_ids, attention_mask, label)`` of each ``(text, label)``: the text's first ``length``
    tokens (with the tokenizer's special tokens, e.g. BERT's [CLS]), padded on the right."""
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (text, _) in enumerate(rows):
        tokens = tokenizer.encode(text, add_special_tokens=True)[:length] or [tokenizer.eos_token_id]
        ids[i, :len(tokens)] = torch.tensor(tokens)
        mask[i, :len(tokens)] = 1
    return TensorDataset(ids, mask, torch.tensor([label for _, label in rows], dtype=torch.long))
