"""Text files read in bounded pieces: a document larger than memory is never one string, and
everything downstream (tokens, mixing by weight, the held-out split) keeps it whole."""

from __future__ import annotations

import json

from accord.data import chunks, pieces
from accord.data.sources import load_source, mix
from accord.data.split import hold_out
from accord.models.build import build_byte_tokenizer
from accord.recipe.schema import SourceConfig
from accord.tasks.base import text_prefix
from test_shards import _prepare, _recipe, _text


def test_a_text_file_read_in_pieces_prepares_the_tokens_of_the_whole_file(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces, "PIECE_CHARS", 3001)  # pieces end anywhere, units (2000) straddle them
    monkeypatch.setattr(chunks, "UNIT_CHARS", 2000)
    folder = tmp_path / "docs"
    folder.mkdir()
    docs = {"a.txt": _text(0, 8000), "b.txt": _text(1, 30), "c.txt": _text(2, 1500) + "\r\nend\n"}
    for name, text in docs.items():
        (folder / name).write_bytes(text.encode())
    rows = load_source(SourceConfig(path=str(folder)), ("text",))
    assert len(rows) > 3 and rows[pieces.PIECE][:2] == [0, 1]
    prepared, _ = _prepare(_recipe(tmp_path, "pretrain", str(folder)))
    tokenizer = build_byte_tokenizer()
    whole = [
        t
        for text in docs.values()
        for t in text_prefix(tokenizer)
        + tokenizer(text.replace("\r\n", "\n"), add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
    ]
    assert prepared.train[list(range(len(prepared.train)))]["input_ids"] == [
        whole[i : i + 64] for i in range(0, len(whole), 64)
    ]


def _documents(ds) -> list[str]:
    """The documents of a dataset of pieces, joined, in row order."""
    out: list[str] = []
    for text, piece in zip(ds["text"], ds[pieces.PIECE]):
        if piece == 0:
            out.append(text)
        else:
            out[-1] += text
    return out


def test_mixing_by_weight_and_holding_out_keep_each_pieced_document_whole(tmp_path, monkeypatch):
    folder = tmp_path / "books"
    folder.mkdir()
    books = [_text(10 + i, n) for i, n in enumerate([900, 40, 2000, 300])]
    for i, text in enumerate(books):
        (folder / f"{i}.txt").write_text(text)
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": _text(50 + i, 20)}) + "\n" for i in range(12)))
    sources = [SourceConfig(path=str(folder), weight=1.0), SourceConfig(path=str(tmp_path / "notes.jsonl"), weight=3.0)]

    def mixed():
        return mix([load_source(s, ("text",)) for s in sources], [s.weight for s in sources], seed=3)

    whole = mixed()  # every document one row
    monkeypatch.setattr(pieces, "PIECE_CHARS", 500)
    pieced = mixed()
    assert len(pieced) > len(whole) and _documents(pieced) == whole["text"]  # the same documents, the same draws

    train, held = hold_out(pieced, 0.2, seed=1, documents=True)
    total = sum(map(len, whole["text"]))
    held_chars = sum(map(len, _documents(held)))
    assert abs(held_chars - 0.2 * total) < 20  # whole documents, then a tail cut at a space
    assert sum(map(len, _documents(train))) + held_chars == total
    for doc in _documents(held) + _documents(train):  # every document is a stretch of one source document
        assert any(doc in source for source in whole["text"])
    assert train[pieces.PIECE][0] == 0 and held[pieces.PIECE][0] == 0
