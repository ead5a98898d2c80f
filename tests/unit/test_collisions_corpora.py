"""Corpora: built-in offline sources, user files, seeded window sampling, deduplication, one-line errors."""

from __future__ import annotations

import pytest

import lminvert
from lminvert.corpora import corpus_documents, sample_prompts
from lminvert.errors import LminvertError


@pytest.fixture(scope="module")
def tokenizer():
    return lminvert.load_model("tiny-llama").tokenizer


@pytest.mark.parametrize("corpus", ["code", "prose", "records", "mixed"])
def test_builtin_corpora_give_distinct_windows_of_k_tokens(tokenizer, corpus):
    prompts, summary = sample_prompts(tokenizer, corpus, 300, max_tokens=12, seed=1)
    assert len(prompts) == 300
    assert len({p.ids for p in prompts}) == 300
    assert sum(len(p.ids) == 12 for p in prompts) >= 290  # windows, only the odd end-of-document one is shorter
    assert all(1 <= len(p.ids) <= 12 for p in prompts)
    assert summary["documents"] > 100
    again, _ = sample_prompts(tokenizer, corpus, 300, max_tokens=12, seed=1)
    assert [p.ids for p in again] == [p.ids for p in prompts]  # seeded
    other, _ = sample_prompts(tokenizer, corpus, 300, max_tokens=12, seed=2)
    assert len({p.ids for p in other} & {p.ids for p in prompts}) < 30  # random windows, not the first documents


def test_mixed_is_half_code_half_prose(tokenizer):
    prompts, _ = sample_prompts(tokenizer, "mixed", 400, max_tokens=8, seed=0)
    code = sum(p.source.startswith("code:") for p in prompts)
    assert 140 < code < 260
    assert {p.source.split(":")[0] for p in prompts} == {"code", "prose"}


def test_prose_is_english_and_code_is_python(tokenizer):
    docs, weights = corpus_documents("prose")
    assert abs(weights.sum() - 1) < 1e-9
    assert "In the beginning" in docs[0].load()
    code_docs, _ = corpus_documents("code")
    assert any(d.name.endswith("os.py") for d in code_docs)


def test_records_hold_other_languages_and_identifiers():
    """The synthetic records (the reading's training text beside code and prose): one per line, in several scripts,
    with the identifiers a leaked prompt holds."""
    docs, weights = corpus_documents("records")
    texts = [d.load() for d in docs]
    assert len(texts) == 4000 and abs(weights.sum() - 1) < 1e-9
    assert all(text and "\n" not in text for text in texts)
    joined = " ".join(texts)
    for marker in ("ä", "é", "ñ", "ł", "ş", "Д", "の", "的", "IBAN", "@example", "https://", '"password"'):
        assert marker in joined, marker


def test_the_reading_trains_on_a_quarter_records(monkeypatch):
    from lminvert.invert import reading

    model = lminvert.load_model("tiny-llama")
    calls = []
    real = reading.sample_prompts

    def spy(tokenizer, corpus, n, **kw):
        calls.append((corpus, n))
        return real(tokenizer, corpus, n, **kw)

    monkeypatch.setattr(reading, "sample_prompts", spy)
    prompts = reading.training_prompts(model, text=40, random=3)
    assert calls == [("mixed", 30), ("records", 10)]
    assert len(prompts) == 43


def test_user_files(tokenizer, tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "alpha beta gamma delta"}\n\n{"text": "one two three four five"}\n')
    prompts, summary = sample_prompts(tokenizer, str(jsonl), 10, max_tokens=64, seed=0)
    assert summary["documents"] == 2
    assert len(prompts) == 2  # only two distinct windows exist: the whole (short) documents, deduplicated
    text = tmp_path / "book.txt"
    text.write_text(" ".join(f"word{i}" for i in range(3000)))
    prompts, _ = sample_prompts(tokenizer, str(text), 50, max_tokens=10, seed=0)
    assert len(prompts) == 50 and all(len(p.ids) == 10 for p in prompts)
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.md").write_text("some markdown text here " * 50)
    (folder / "b.py").write_text("def f(x):\n    return x\n" * 50)
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    docs, _ = corpus_documents(str(folder))
    assert sorted(d.name for d in docs) == ["a.md", "b.py"]


@pytest.mark.parametrize(
    "content,suffix,message",
    [
        (None, ".jsonl", "not found"),
        ("", ".txt", "empty"),
        ("\n  \n", ".jsonl", "no text"),
        ("not json\n", ".jsonl", "not valid JSON"),
        ('{"body": "x"}\n', ".jsonl", 'no string "text" field'),
        ("x", ".csv", "unsupported corpus file"),
    ],
)
def test_bad_corpora_give_one_line_errors(tokenizer, tmp_path, content, suffix, message):
    path = tmp_path / f"corpus{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(LminvertError, match=message) as info:
        sample_prompts(tokenizer, str(path), 5)
    assert "\n" not in str(info.value)


def test_hf_without_datasets_or_network_is_a_one_line_error(tokenizer):
    with pytest.raises(LminvertError, match=r"datasets|could not load") as info:
        sample_prompts(tokenizer, "hf:wikimedia/wikipedia:20231101.en", 5)
    assert "\n" not in str(info.value)


def test_bad_arguments(tokenizer):
    with pytest.raises(LminvertError, match="at least 1"):
        sample_prompts(tokenizer, "prose", 0)
    with pytest.raises(LminvertError, match="max-tokens"):
        sample_prompts(tokenizer, "prose", 5, max_tokens=0)
