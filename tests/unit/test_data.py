"""Token sources and the data cursor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from samestep.loop.data import Corpus, DataCursor, load_corpus, stdlib_files


def test_stdlib_corpus_is_deterministic_and_fingerprinted():
    """Two loads of the embedded default give the same bytes and fingerprint; it is a real corpus."""
    a, b = load_corpus("stdlib"), load_corpus("stdlib")
    assert a.fingerprint == b.fingerprint and np.array_equal(a.tokens, b.tokens)
    assert a.tokens.size > 1_000_000 and a.vocab_size == 256
    names = [p.name for p in stdlib_files()]
    assert "os.py" in names and not any("site-packages" in str(p) for p in stdlib_files())


def test_text_and_bin_sources(tmp_path):
    """A text directory reads in sorted order; a uint16 .bin file keeps its tokens and vocabulary."""
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    text = load_corpus("text", tmp_path)
    raw = bytes(text.tokens)
    assert raw.index(b"first") < raw.index(b"second")
    tokens = np.array([1, 700, 3, 50000, 5], dtype="<u2")
    bin_path = tmp_path / "train.bin"
    tokens.tofile(bin_path)
    corpus = load_corpus("bin", bin_path)
    assert corpus.tokens.tolist() == tokens.tolist() and corpus.vocab_size == 50001


@pytest.mark.parametrize(
    "source,path,needle",
    [
        ("web", None, "data.source='web' is unknown"),
        ("text", "/nonexistent", "data.path='/nonexistent' is not a directory"),
        ("bin", "/nonexistent.bin", "is not a file"),
    ],
)
def test_bad_sources_are_named(source, path, needle):
    """An unknown source or a missing path is refused with the field and value."""
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_corpus(source, path)


def test_cursor_maps_samples_purely_and_restores(tmp_path):
    """A global sample index reads the same window from any cursor; state round-trips; mismatches are named."""
    corpus = load_corpus("stdlib")
    c1, c2 = DataCursor(corpus, 64, seed=3), DataCursor(corpus, 64, seed=3)
    x1, y1 = c1.samples(1000, 4)
    x2, y2 = c2.samples(1000, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(x1[:, 1:], y1[:, :-1])
    other = DataCursor(corpus, 64, seed=4)
    assert not torch.equal(other.samples(1000, 4)[0], x1)  # negative control: another seed, another order
    c1.advance(48)
    c2.load_state_dict(c1.state_dict())
    assert c2.position == 48
    with pytest.raises(ValueError, match="saved seed=3 but this run has 4"):
        other.load_state_dict(c1.state_dict())


def test_epochs_visit_every_window_once():
    """Within an epoch every window is read exactly once; the next epoch uses another order."""
    corpus = Corpus(tokens=np.arange(8 * 50 + 1, dtype=np.uint16), vocab_size=401, fingerprint="f", description="t")
    cursor = DataCursor(corpus, 8, seed=0)
    first, _ = cursor.samples(0, 50)
    second, _ = cursor.samples(50, 50)
    assert sorted(first[:, 0].tolist()) == list(range(0, 400, 8))
    assert sorted(second[:, 0].tolist()) == list(range(0, 400, 8))
    assert first[:, 0].tolist() != second[:, 0].tolist()
