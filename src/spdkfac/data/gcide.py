"""GCIDE, the Collaborative International Dictionary of English, as plain byte-level text.

Debian's ``dict-gcide`` package installs it for ``dictd`` as
``/usr/share/dictd/gcide.dict.dz`` (dictzip: gzip with an index in a header field, so
:mod:`gzip` reads it), about 40 MB of entries from Webster's 1913 dictionary and WordNet.
:func:`gcide_text` keeps the dictionary's English and drops its markup:

- the database's ``00-database-*`` entries and the licence preamble (everything before
  the first headword line, ``Word \\Pro*nun"ci*a`tion\\, n. ...``);
- pronunciations: the ``\\...\\`` after a headword and a parenthesised respelling right
  after it;
- source tags such as ``[1913 Webster]``, ``[WordNet 1.5 +PJC]`` (usage labels such as
  ``[Obs.]`` are the dictionary's content and stay);
- cross-reference braces (``{Abuse}`` becomes ``Abuse``); character codes become plain
  letters (``[=a]``, ``[a^]``, ``['e]`` become ``a``, ``e``; ``[ae]``, ``[oe]`` the pairs;
  ``[imac]``, ``[aum]``, ``[eth]``, ``[thorn]`` and the like their letters; Greek letters
  their names), and non-ASCII bytes are dropped;
- layout: each paragraph (lines between blank lines) becomes one line with single spaces,
  and each entry is a block of such lines after one blank line.

The text is split by position (:func:`spdkfac.data.text.split_bounds`): the first 99 %
train, then 0.5 % validation and 0.5 % test (about 145 KB each, so an evaluation costs
little next to training). The entries are in alphabetical order, so the validation and
test splits hold the last entries (words from about *Wo-* to *Z*) and share no text with
the training split. At 128 bytes per window the training split holds about 224,000
windows (``TextWindows`` without random offsets, see ``spdkfac train --dataset gcide``):
more than a run of 1,500 steps of 2 workers x 16 windows reads (48,000), so no text
repeats within such a run.
"""

from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path

import torch

from spdkfac.data.text import TEXT_SPLITS, TextCorpus, TextCorpusError, split_bounds

__all__ = [
    "DEFAULT_GCIDE_PATH",
    "SPLIT_ENDS",
    "gcide_text",
    "load_gcide_corpus",
    "read_gcide_bytes",
]

DEFAULT_GCIDE_PATH = Path("/usr/share/dictd/gcide.dict.dz")
"""Where Debian's ``dict-gcide`` installs the dictionary."""

#: Train on the first 99 %, validate on the next 0.5 %, test on the last 0.5 % (about
#: 145 KB each: evaluations stay cheap next to training, and the text is large).
SPLIT_ENDS = (0.99, 0.995)
_HOW_TO_GET = (
    "run scripts/ensure_gcide.sh (it unpacks gcide.dict.dz from Debian's dict-gcide "
    "without installing the dictd server the package depends on) or pass a gcide.dict.dz "
    "(or an uncompressed .dict) with `--data PATH`"
)
#: A headword line: text at column 0, then a pronunciation between backslashes.
_HEADWORD = re.compile(r"^[^\s\\][^\\\n]*\\[^\\\n]+\\", re.MULTILINE)
#: A pronunciation between backslashes with the respelling in parentheses that may follow
#: it, or a respelling alone (its syllables split by ``*``).
_PRONUNCIATION = re.compile(r"\s*\\[^\\\n]*\\(?:\s*\([^()\n]*\))?|\s*\([^()\n]*\*[^()\n]*\)")
#: Syllable and stress marks inside a word (``Dis*pir"it*ed``).
_SYLLABLE = re.compile(r"(?<=[A-Za-z])[*`\"](?=[A-Za-z])")
_SOURCE_TAG = re.compile(
    r"\[(?:[^\[\]\n]*(?:Webster|WordNet|PJC|Century Dict)[^\[\]\n]*|AS|RDH|RHUD|MW10|MI11|GG|RP)\]"
)
#: A letter with a diacritic: a mark before it (``[=a]``, ``['e]``, ``[.a]``) or ``^`` after.
_DIACRITIC = re.compile(r"\[(?:[=.\-~^\"'`,*]([A-Za-z]{1,2})|([A-Za-z]{1,2})\^)\]")
_GREEK = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
          "pi rho sigma tau upsilon phi chi psi omega")  # fmt: skip
_NAMED = {
    "ae": "ae", "AE": "AE", "oe": "oe", "OE": "OE", "imac": "i", "aum": "a", "eth": "th",
    "thorn": "th", "asl": "a", "add": "a", "udd": "u", "ng": "ng", "th": "th", "yogh": "y",
    "root": "", "?": "", "deg": " degrees", "sect": "section", "pounds": "pounds",
    **{name: name for name in _GREEK.split()},
    **{name.capitalize(): name.capitalize() for name in _GREEK.split()},
}  # fmt: skip
_NAMED_CODE = re.compile(r"\[(" + "|".join(re.escape(name) for name in _NAMED) + r")\]")
_SPACES = re.compile(r"[ \t]+")


def read_gcide_bytes(path: str | Path | None = None) -> bytes:
    """The dictionary file's bytes: gunzipped when it is gzip (``.dict.dz``), else as is.

    Raises:
        TextCorpusError: The file is missing or empty, or not valid gzip (the message
            names it).
    """
    source = DEFAULT_GCIDE_PATH if path is None else Path(path)
    if not source.is_file():
        raise TextCorpusError(f"dictionary {source} does not exist; {_HOW_TO_GET}")
    raw = source.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as error:
            raise TextCorpusError(f"dictionary {source} is not valid gzip: {error}") from None
    if not raw:
        raise TextCorpusError(f"dictionary {source} holds no text; {_HOW_TO_GET}")
    return raw


def _clean_line(line: str) -> str:
    if _SOURCE_TAG.match(line.lstrip()):
        # A source tag's line; what follows a tag there is a stray copy of the next
        # headword ("[1913 Webster] Analytic").
        return ""
    line = _PRONUNCIATION.sub("", _SOURCE_TAG.sub("", line))
    line = _DIACRITIC.sub(lambda m: m.group(1) or m.group(2), line)
    line = _NAMED_CODE.sub(lambda m: _NAMED[m.group(1)], line)
    line = _SYLLABLE.sub("", line.replace("{", "").replace("}", ""))
    return _SPACES.sub(" ", line).strip()


def gcide_text(raw: bytes) -> bytes:
    """The plain English text of a dictd-format dictionary's bytes (see the module).

    Raises:
        TextCorpusError: No headword line was found (not a GCIDE-like dictionary).
    """
    text = raw.decode("ascii", errors="ignore")
    first = _HEADWORD.search(text)
    if first is None:
        raise TextCorpusError(
            "found no dictionary entry (a line 'Word \\Pro*nun\"ci*a`tion\\, ...') in the file"
        )
    entries: list[list[str]] = []  # each entry's paragraphs, one line each
    lines: list[str] = []  # the paragraph being read
    for line in text[first.start() :].split("\n"):
        if line[:1].strip() and _HEADWORD.match(line):
            _close_paragraph(entries, lines)
            entries.append([])
        if not line.strip():
            _close_paragraph(entries, lines)
        elif cleaned := _clean_line(line):
            lines.append(cleaned)
    _close_paragraph(entries, lines)
    blocks = ("\n".join(paragraphs) for paragraphs in entries if paragraphs)
    return ("\n\n".join(blocks) + "\n").encode("ascii")


def _close_paragraph(entries: list[list[str]], lines: list[str]) -> None:
    """Add the lines read so far to the last entry as one paragraph; start another."""
    if lines:
        # A pronunciation removed at a line's end leaves "Word ," when the lines join.
        entries[-1].append(" ".join(lines).replace(" ,", ","))
        lines.clear()


def load_gcide_corpus(path: str | Path | None = None, *, seq_len: int) -> TextCorpus:
    """Read the dictionary, strip its markup and split it by position (99 / 0.5 / 0.5 %).

    Args:
        path: A ``.dict.dz`` (gzip) or uncompressed ``.dict`` file; None:
            :data:`DEFAULT_GCIDE_PATH`.
        seq_len: Window length; every split must hold at least ``seq_len + 1`` bytes.

    Raises:
        TextCorpusError: The file is missing, empty, not gzip or holds no entry, or a split
            is shorter than one window.
    """
    source = DEFAULT_GCIDE_PATH if path is None else Path(path)
    plain = gcide_text(read_gcide_bytes(source))
    data = torch.frombuffer(bytearray(plain), dtype=torch.uint8)
    parts = [data[start:end] for start, end in split_bounds(len(data), SPLIT_ENDS)]
    for name, part in zip(TEXT_SPLITS, parts, strict=True):
        if len(part) < seq_len + 1:
            raise TextCorpusError(
                f"dictionary {source} has {len(data)} bytes of text: its {name} split gets "
                f"{len(part)}, fewer than one window of --seq-len + 1 = {seq_len + 1}"
            )
    return TextCorpus(source, *parts)
