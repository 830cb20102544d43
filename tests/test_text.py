"""Reproducible text contexts from files shipped on the machine."""

from __future__ import annotations

import pytest

from kvsim.kv.text import SOURCES, assemble, documents
from kvsim.model.tiny import ByteTokenizer


@pytest.mark.parametrize("source", SOURCES)
def test_assemble_exact_length_and_reproducible(source):
    tok = ByteTokenizer()
    a = assemble(tok, 3000, source, seed=3)
    b = assemble(tok, 3000, source, seed=3)
    assert len(a.ids) == 3000
    assert a.ids == b.ids and a.sha256 == b.sha256
    assert a.documents == b.documents


def test_seeds_give_different_text():
    tok = ByteTokenizer()
    assert assemble(tok, 500, "stdlib-docs", 0).ids != assemble(tok, 500, "stdlib-docs", 1).ids


def test_text_is_real_prose():
    sample = assemble(ByteTokenizer(), 2000, "stdlib-docs", 0)
    text = ByteTokenizer().decode(sample.ids)
    words = text.split()
    assert len(words) > 200
    # docstrings are mostly English words, not code symbols
    alpha = sum(w.isalpha() for w in words) / len(words)
    assert alpha > 0.5


def test_bad_requests():
    with pytest.raises(ValueError, match="positive number of tokens"):
        assemble(ByteTokenizer(), 0)
    with pytest.raises(ValueError, match="unknown text source"):
        documents("wikipedia")
    with pytest.raises(ValueError, match="holds only"):
        assemble(ByteTokenizer(), 10**9, "licenses")
