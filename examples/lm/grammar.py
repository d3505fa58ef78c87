"""Text in a made-up language, written by a seeded probabilistic grammar.

The example's data ship as this program: nothing is downloaded. A seed fixes
a *language* (its lexicon and topics); each document of a split is then
written from a seed of its own, so the same seeds give the same bytes on
every machine (only ``random.Random.random`` is used, whose stream Python
keeps stable).

What a model can learn from it, roughly in the order a small transformer does:

* spelling: words are one to three syllables (onset, nucleus, coda) of a
  fixed inventory;
* a lexicon of about 4,000 content words, drawn with Zipf's law (the
  shorter, the more frequent): 1,600 nouns
  (each of one of two genders), 1,200 verbs (transitive or not), 500
  adjectives, 250 adverbs and 400 capitalized names, plus function words;
* agreement: a determiner agrees with its noun's gender and number, an
  adjective with both, a plural noun takes its gender's suffix, a numeral
  (2 to 99) makes its noun plural;
* long-range agreement: a verb agrees in number with its subject across a
  relative clause between them (``ki`` + verb phrase, or centre-embedded
  ``ki`` + subject + verb), nested up to two deep;
* paragraph-level structure: a paragraph keeps one of three tenses (each
  with a singular and a plural verb ending; quoted speech is in the present),
  draws 60% of its content words from one of 64 topics, and comes back to
  its two protagonists by name;
* matching delimiters: a question starts with ``Ku`` and ends with ``?``;
  quoted speech opens and closes ``"``; asides open and close parentheses.

A paragraph is 3 to 8 sentences and ends with a newline.

Examples:
  >>> language = Language(seed=0)
  >>> text = language.text(seed=1, num_bytes=300)
  >>> len(text.encode()) >= 300
  True
  >>> text == Language(seed=0).text(seed=1, num_bytes=300)
  True
"""

import bisect
import itertools
import random
from collections.abc import Sequence
from typing import NamedTuple

_ONSETS = ("", "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "br", "dr", "fl", "gr", "kl", "pr", "sk", "st", "tr", "sh", "th", "ch")
_NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou", "ei")
_CODAS = ("", "", "", "", "n", "r", "l", "s", "m", "k", "nd", "st")

# Function words, by (gender, plural).
_DEFINITE = {(0, False): "lo", (1, False): "la", (0, True): "lon", (1, True): "lan"}
_INDEFINITE = {(0, False): "un", (1, False): "una", (0, True): "sam", (1, True): "sam"}
_NOUN_PLURAL = ("en", "ir")  # By gender.
_ADJECTIVE_ENDINGS = {(0, False): "o", (1, False): "a", (0, True): "os", (1, True): "as"}
# Verb endings by (tense, plural): present, past, future.
_VERB_ENDINGS = {(0, False): "et", (0, True): "ent", (1, False): "ai", (1, True): "aun",
                 (2, False): "ova", (2, True): "ovan"}
_PREPOSITIONS = ("ad", "per", "sul", "vex", "ob", "tra", "kon", "ib", "dun", "zel")
_CONJUNCTIONS = ("e", "ma", "poi", "sin")
_RELATIVE = "ki"
_QUESTION = "ku"
_ADVERB_ENDING = "mi"

_NUM_NOUNS, _NUM_VERBS, _NUM_ADJECTIVES, _NUM_ADVERBS, _NUM_NAMES = 1600, 1200, 500, 250, 400
_NUM_TOPICS = 64
_TOPIC_SIZES = {"nouns": 48, "verbs": 24, "adjectives": 16}
_TOPIC_SHARE = 0.6  # Of a paragraph's content words, drawn from its topic.
_MAX_DEPTH = 2  # Relative clauses inside relative clauses.


class _Words(NamedTuple):
  """Words of one category and the cumulative Zipf weights they are drawn with."""

  words: tuple
  cumulative: tuple[float, ...]


def _zipf(words: Sequence, exponent: float = 1.0) -> _Words:
  weights = [1.0 / (rank + 2) ** exponent for rank in range(len(words))]
  return _Words(tuple(words), tuple(itertools.accumulate(weights)))


class _Paragraph(NamedTuple):
  topic: dict[str, _Words]
  tense: int
  protagonists: tuple[tuple[str, int], ...]  # (name, gender)


class Language:
  """A lexicon and its topics, fixed by ``seed``; :meth:`text` writes documents in it.

  Args:
    seed: the language: its words, their genders and frequencies, and the topics.
  """

  def __init__(self, seed: int):
    rng = random.Random(seed)
    taken = set(_DEFINITE.values()) | set(_INDEFINITE.values()) | set(_PREPOSITIONS) | set(
        _CONJUNCTIONS) | {_RELATIVE, _QUESTION}

    def new_stems(count: int) -> list[str]:
      stems = []
      while len(stems) < count:
        syllables = 1 + _pick_uniform(rng, 3)
        stem = "".join(_pick_uniform(rng, _ONSETS) + _pick_uniform(rng, _NUCLEI)
                       + _pick_uniform(rng, _CODAS) for _ in range(syllables))
        if len(stem) >= 2 and stem not in taken:
          taken.add(stem)
          stems.append(stem)
      # The shortest words are the most frequent, as in natural languages (Zipf's law of
      # abbreviation).
      return sorted(stems, key=len)

    self.nouns = _zipf([(stem, int(rng.random() < 0.5)) for stem in new_stems(_NUM_NOUNS)])
    self.verbs = _zipf([(stem, rng.random() < 0.6) for stem in new_stems(_NUM_VERBS)])
    self.adjectives = _zipf(new_stems(_NUM_ADJECTIVES))
    self.adverbs = _zipf([stem + _ADVERB_ENDING for stem in new_stems(_NUM_ADVERBS)])
    self.names = _zipf([(stem.capitalize(), int(rng.random() < 0.5))
                        for stem in new_stems(_NUM_NAMES)], exponent=0.5)
    self.topics = []
    for _ in range(_NUM_TOPICS):
      topic = {}
      for category, size in _TOPIC_SIZES.items():
        chosen = []
        while len(chosen) < size:
          word = _pick(rng, getattr(self, category))
          if word not in chosen:
            chosen.append(word)
        topic[category] = _zipf(chosen)
      self.topics.append(topic)

  def text(self, seed: int, num_bytes: int) -> str:
    """Whole paragraphs, written from ``seed``, until they hold at least ``num_bytes`` bytes."""
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < num_bytes:
      paragraph = self._paragraph(rng)
      paragraphs.append(paragraph)
      size += len(paragraph.encode())
    return "".join(paragraphs)

  def _paragraph(self, rng: random.Random) -> str:
    context = _Paragraph(
        topic=self.topics[_pick_uniform(rng, _NUM_TOPICS)],
        tense=_pick_uniform(rng, 3),
        protagonists=(_pick(rng, self.names), _pick(rng, self.names)),
    )
    sentences = [self._sentence(rng, context) for _ in range(3 + _pick_uniform(rng, 6))]
    return " ".join(sentences) + "\n"

  def _sentence(self, rng: random.Random, context: _Paragraph) -> str:
    draw = rng.random()
    if draw < 0.1:  # Speech, in the present tense whatever the paragraph's.
      name, _ = _pick_uniform(rng, context.protagonists)
      verb = self._verb(rng, context, plural=False, transitive=False)
      quoted = self._clauses(rng, context._replace(tense=0))
      return f'{name} {verb}: "{_capitalized(quoted)}."'
    if draw < 0.25:
      return f"{_capitalized(_QUESTION + ' ' + self._clause(rng, context))}?"
    return f"{_capitalized(self._clauses(rng, context))}."

  def _clauses(self, rng: random.Random, context: _Paragraph) -> str:
    clauses = [self._clause(rng, context)]
    while len(clauses) < 3 and rng.random() < 0.3:
      clauses.append(_pick_uniform(rng, _CONJUNCTIONS) + " " + self._clause(rng, context))
    return ", ".join(clauses)

  def _clause(self, rng: random.Random, context: _Paragraph) -> str:
    subject, plural = self._noun_phrase(rng, context, depth=0)
    return f"{subject} {self._verb_phrase(rng, context, plural, depth=0)}"

  def _noun_phrase(self, rng: random.Random, context: _Paragraph, depth: int) -> tuple[str, bool]:
    """A noun phrase and whether it is plural."""
    draw = rng.random()
    if draw < 0.2:
      name, _ = _pick_uniform(rng, context.protagonists)
      return name, False
    if draw < 0.25:
      name, _ = _pick(rng, self.names)
      return name, False
    stem, gender = self._content(rng, context, "nouns")
    plural = rng.random() < 0.4
    words = []
    if plural and rng.random() < 0.25:
      words.append(str(2 + _pick_uniform(rng, 98)))
    else:
      determiners = _DEFINITE if rng.random() < 0.7 else _INDEFINITE
      words.append(determiners[gender, plural])
    while len(words) < 3 and rng.random() < 0.3:
      words.append(self._content(rng, context, "adjectives")
                   + _ADJECTIVE_ENDINGS[gender, plural])
    words.append(stem + _NOUN_PLURAL[gender] if plural else stem)
    if rng.random() < 0.04:
      aside, _ = self._noun_phrase(rng, context, _MAX_DEPTH)
      words.append(f"({aside})")
    if depth < _MAX_DEPTH and rng.random() < 0.25 / (depth + 1):
      words.append(self._relative_clause(rng, context, plural, depth + 1))
    return " ".join(words), plural

  def _relative_clause(self, rng: random.Random, context: _Paragraph, plural: bool,
                       depth: int) -> str:
    """``ki`` and a verb phrase agreeing with the head, or a subject and a transitive verb."""
    if rng.random() < 0.5:
      return f"{_RELATIVE} {self._verb_phrase(rng, context, plural, depth)}"
    subject, subject_plural = self._noun_phrase(rng, context, depth)
    verb = self._verb(rng, context, subject_plural, transitive=True)
    return f"{_RELATIVE} {subject} {verb}"

  def _verb_phrase(self, rng: random.Random, context: _Paragraph, plural: bool,
                   depth: int) -> str:
    transitive = rng.random() < 0.6
    words = [self._verb(rng, context, plural, transitive)]
    if transitive:
      words.append(self._noun_phrase(rng, context, depth)[0])
    if rng.random() < 0.25:
      words.append(_pick(rng, self.adverbs))
    if rng.random() < 0.3:
      words.append(_pick_uniform(rng, _PREPOSITIONS) + " "
                   + self._noun_phrase(rng, context, _MAX_DEPTH)[0])
    return " ".join(words)

  def _verb(self, rng: random.Random, context: _Paragraph, plural: bool,
            transitive: bool) -> str:
    while True:
      stem, is_transitive = self._content(rng, context, "verbs")
      if is_transitive == transitive:
        return stem + _VERB_ENDINGS[context.tense, plural]

  def _content(self, rng: random.Random, context: _Paragraph, category: str):
    """A content word of ``category``: mostly from the paragraph's topic."""
    source = context.topic[category] if rng.random() < _TOPIC_SHARE else getattr(self, category)
    return _pick(rng, source)


def _pick(rng: random.Random, words: _Words):
  """A word drawn with the Zipf weights of ``words``."""
  index = bisect.bisect(words.cumulative, rng.random() * words.cumulative[-1])
  return words.words[min(index, len(words.words) - 1)]


def _pick_uniform(rng: random.Random, choices):
  """A uniform draw from a sequence, or from ``range(choices)`` for an int."""
  count = choices if isinstance(choices, int) else len(choices)
  index = min(int(rng.random() * count), count - 1)
  return index if isinstance(choices, int) else choices[index]


def _capitalized(text: str) -> str:
  return text[:1].upper() + text[1:]
