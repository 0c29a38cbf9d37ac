"""The training text: CPython's ``pydoc_data.topics`` (the Python documentation topics), split for training.

``pydoc_data/topics.py`` ships with every CPython (Debian's ``libpython3.x-stdlib`` too) and is
licensed under the Python Software Foundation License Version 2 (PSF-2.0), like the rest of the
CPython documentation it is generated from. Each topic is a page of English prose with a title
underlined by ``*`` and sections underlined by ``=`` / ``-``.

- Held out: every ``HOLDOUT_EVERY``-th topic in sorted order (whole topics, never seen in training,
  not used to train the tokenizer either); alternate held-out topics form a validation set
  (checkpoint choice) and a test set (reported perplexity).
- Chat pairs: every section title with the paragraph under it becomes a user/assistant exchange
  ("Explain <title>." -> the paragraph), so the chat template is meaningful to the model.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

HOLDOUT_EVERY = 6
ANSWER_MAX_CHARS = 420
QUESTIONS = ("Explain {t}.", "What is {t}?", "Tell me about {t}.", "Describe {t}.",
             "What does the manual say about {t}?")
_UNDERLINE = re.compile(r"^([*=\-~^])\1{3,}$")


@dataclass(frozen=True)
class Corpus:
    train_topics: dict[str, str]
    heldout_topics: dict[str, str]

    @property
    def train_text(self) -> str:
        return "\n\n".join(self.train_topics.values())

    @property
    def heldout_text(self) -> str:
        return "\n\n".join(self.heldout_topics.values())

    @property
    def valid_text(self) -> str:
        """Held-out topics at odd positions: picks the checkpoint during training."""
        return "\n\n".join(v for i, v in enumerate(self.heldout_topics.values()) if i % 2 == 1)

    @property
    def test_text(self) -> str:
        """Held-out topics at even positions: the reported perplexity (never used for a decision)."""
        return "\n\n".join(v for i, v in enumerate(self.heldout_topics.values()) if i % 2 == 0)


def load_corpus() -> Corpus:
    """The topics of the running interpreter's ``pydoc_data``, split into training and held-out topics."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held = {n: _clean(topics[n]) for i, n in enumerate(names) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1}
    train = {n: _clean(topics[n]) for n in names if n not in held}
    return Corpus(train, held)


def _clean(text: str) -> str:
    return text.replace("\r\n", "\n").strip()


def sections(text: str) -> list[tuple[str, list[str]]]:
    """(title, paragraphs) for each underlined heading of a topic page; code blocks (indented) dropped."""
    out: list[tuple[str, list[str]]] = []
    blocks = re.split(r"\n\s*\n", text)
    title: str | None = None
    paras: list[str] = []
    for block in blocks:
        lines = block.split("\n")
        if len(lines) >= 2 and _UNDERLINE.match(lines[-1].strip()):
            if title is not None and paras:
                out.append((title, paras))
            title, paras = " ".join(x.strip() for x in lines[:-1]), []
            continue
        if block.startswith(" ") or title is None:
            continue
        paras.append(" ".join(x.strip() for x in lines))
    if title is not None and paras:
        out.append((title, paras))
    return out


def ask(subject: str, rng: random.Random) -> str:
    """A user question about ``subject`` in one of the :data:`QUESTIONS` phrasings."""
    return rng.choice(QUESTIONS).format(t=subject)


def chat_pairs(topics: dict[str, str]) -> list[tuple[str, str]]:
    """(subject, answer) pairs: each section title, answered by its first paragraph(s)."""
    pairs: list[tuple[str, str]] = []
    for text in topics.values():
        for title, paras in sections(text):
            answer = paras[0]
            for p in paras[1:]:
                if len(answer) + len(p) > ANSWER_MAX_CHARS:
                    break
                answer += "\n\n" + p
            subject = title[0].lower() + title[1:] if title[:2].istitle() else title
            pairs.append((subject.rstrip("."), answer))
    return pairs
