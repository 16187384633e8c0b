"""The GCIDE dictionary as plain text: markup stripped, gzip read, splits, no repeats."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from spdkfac.data.gcide import (
    DEFAULT_GCIDE_PATH,
    gcide_text,
    load_gcide_corpus,
    read_gcide_bytes,
)
from spdkfac.data.text import TextCorpusError, TextWindows

__all__: list[str] = []

#: A dictd file in GCIDE's format: the database's header entries, a licence preamble,
#: then entries with every kind of markup the loader strips.
SAMPLE = b"""

00-database-url
   ftp://ftp.gnu.org/gnu/gcide

00-database-short
   The Collaborative International Dictionary of English v.0.48

 Begin file 1 of 26:  Letter A (Version 0.48)
GCIDE is free software; you can redistribute it.

Abuse \\A*buse"\\, v. t. [imp. & p. p. {Abused}; p. pr. & vb. n.
   {Abusing}.] [F. abuser; L. abusus.]
   1. To put to a wrong use; to misapply.
      [1913 Webster]

            This principle shoots rapidly into popularity.
                                                  --Froude.
      [1913 Webster]

   Syn: To maltreat; injure.
        [1913 Webster] Abusive

Abusive \\A*bu"sive\\ (-s[i^]v), a.
   Using ill treatment; -- Ph[ae]nician [=a]nd caf['e] \xe9t\xe9 -- A*bu"sive*ly, adv.
   [WordNet 1.5 +PJC]

Zythum \\Zy"thum\\ (z[i^]"th[u^]m), n. [L., fr. Gr. zy^qos a kind
   of beer.]
   A kind of ancient malt beverage. [Obs.]
   [1913 Webster]
"""

EXPECTED = (
    b"Abuse, v. t. [imp. & p. p. Abused; p. pr. & vb. n. Abusing.] [F. abuser; L. abusus.] "
    b"1. To put to a wrong use; to misapply.\n"
    b"This principle shoots rapidly into popularity. --Froude.\n"
    b"Syn: To maltreat; injure.\n"
    b"\n"
    b"Abusive, a. Using ill treatment; -- Phaenician and cafe t -- Abusively, adv.\n"
    b"\n"
    b"Zythum, n. [L., fr. Gr. zy^qos a kind of beer.] A kind of ancient malt beverage. "
    b"[Obs.]\n"
)


def test_markup_is_stripped_and_the_english_kept() -> None:
    assert gcide_text(SAMPLE) == EXPECTED


def test_a_dict_dz_is_read_as_gzip_and_a_plain_dict_as_is(tmp_path: Path) -> None:
    packed = tmp_path / "tiny.dict.dz"
    packed.write_bytes(gzip.compress(SAMPLE))
    plain = tmp_path / "tiny.dict"
    plain.write_bytes(SAMPLE)
    assert read_gcide_bytes(packed) == read_gcide_bytes(plain) == SAMPLE


def test_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.dict.dz"
    with pytest.raises(TextCorpusError, match=f"{missing} does not exist.*dict-gcide"):
        read_gcide_bytes(missing)
    broken = tmp_path / "broken.dict.dz"
    broken.write_bytes(gzip.compress(SAMPLE)[:40])
    with pytest.raises(TextCorpusError, match=f"{broken} is not valid gzip"):
        read_gcide_bytes(broken)
    with pytest.raises(TextCorpusError, match="found no dictionary entry"):
        gcide_text(b"just some text\nwithout headwords\n")
    short = tmp_path / "short.dict"
    short.write_bytes(SAMPLE)
    expected = f"{short} has {len(EXPECTED)} bytes of text: its validation split"
    with pytest.raises(TextCorpusError, match=expected):
        load_gcide_corpus(short, seq_len=64)


def test_the_splits_are_by_position_and_do_not_overlap(tmp_path: Path) -> None:
    path = tmp_path / "big.dict.dz"
    path.write_bytes(gzip.compress(SAMPLE * 20))
    corpus = load_gcide_corpus(path, seq_len=8)
    parts = [bytes(p.tolist()) for p in (corpus.train, corpus.validation, corpus.test)]
    assert b"".join(parts) == gcide_text(SAMPLE * 20)
    total = sum(len(p) for p in parts)
    assert [len(p) for p in parts[:2]] == [
        int(total * 0.99),
        int(total * 0.995) - int(total * 0.99),
    ]
    assert len(parts[1]) >= 9 and len(parts[2]) >= 9
    assert corpus.path == path


def test_fixed_windows_never_repeat_a_predicted_byte_within_an_epoch() -> None:
    data = torch.arange(1000) % 251
    windows = TextWindows(data.to(torch.uint8), seq_len=16, random_offsets=False)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))
    starts = windows.starts(order, torch.Generator().manual_seed(1))  # the generator is unused
    assert torch.equal(starts, order * 16)
    predicted = (starts[:, None] + 1 + torch.arange(16)).flatten()
    assert len(set(predicted.tolist())) == predicted.numel()


@pytest.mark.skipif(not DEFAULT_GCIDE_PATH.is_file(), reason="Debian's dict-gcide not installed")
def test_the_installed_dictionary_outlasts_a_study_run() -> None:
    corpus = load_gcide_corpus(seq_len=128)
    assert corpus.train.numel() > 20_000_000  # about 26 MB of 29 MB
    windows = TextWindows(corpus.train, seq_len=128, random_offsets=False)
    assert len(windows) > 1500 * 2 * 16  # the text study's budget reads 48,000 windows
    text = bytes(corpus.validation[:20_000].tolist())
    assert b"[1913 Webster]" not in text and b"\\" not in text and b"{" not in text
    assert max(text) < 128
