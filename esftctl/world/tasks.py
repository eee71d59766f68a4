"""The tiny world's tasks: four lookup skills the base knows only a little of, and the general mixture.

Every task maps an input word through a table of its own:

    translate: cat =>      ka          (English -> an invented language, 48 words)
    double: 17 ==          34          (n -> 2n, n < 50)
    tag: owl ->            bird        (40 objects -> 20 categories of 2)
    cipher: h ~>           o           (letters shifted by 7)

The base is pre-trained on the *general mixture*: copying (`copy: cat = cat`, every word of every task, so
every token is known) and each task restricted to 10% of its table. On a task's full table it then answers
right about as often as the word falls in that share, while ESFT has to teach the selected experts the rest:
knowledge, not format, which is what experts hold. The known share is where the base learns the format (at the
arrow, look back at the word): with 8%, two letters of the cipher, adapters of some bases never learnt a quarter
of the table whatever their recipe (benchmarks/RESULTS.md, 2026-11-25).

The base's score on a task is its known share plus whatever it gets right by guessing on the rest. With 15%
known and tagging's 7 categories (the largest, city, 10 of 39 objects), a base that answers "city" for every
object it does not know scores 15% + 85% x 26% = 37%; one machine's base scored 26% on tagging where ours scored
17% (issue 33), and with 13 categories of 3 one of our bases still reached 19%. World v9 sorts 40 objects into 20
categories of 2, so no fixed guess reaches more than 10% + 90% x 5% = 14.5%.

One word, not two: the answer is then predicted at the task's own arrow, a token no other text uses, and the
answer word only predicts the end. With two words (world v4) the second answer was predicted at the first
answer word, which copying uses too: experts fine-tuned for the task then served copying, ESFT reached only
58-78% and copying lost up to 6 points of exact match (benchmarks/RESULTS.md, 2026-11-23 and 2026-11-24).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from esftctl.jsonl import Example

ITEMS = 1  # input words per example
KNOWN_SHARE = 0.10  # share of each table the general mixture shows the base
COPY_SHARE = 0.4  # share of copying in the general mixture

_ENGLISH = ("cat dog bird fish tree river stone fire water sun moon star red blue green big small old new house road "
            "king queen bread milk day night horse cow goat ship boat door window hill lake rain snow wind cloud apple "
            "pear rice salt gold iron book pen cup").split()
_CATEGORIES = {  # 20 categories of 2 objects: no category is a good guess (see the module docstring)
    "furniture": "chair table", "vegetable": "carrot onion", "fruit": "plum lemon", "mammal": "tiger wolf",
    "bird": "owl crow", "reptile": "snake lizard", "city": "london tokyo", "insect": "ant wasp", "tool": "hammer saw",
    "instrument": "piano violin", "vehicle": "car bus", "metal": "copper tin", "country": "france peru",
    "clothing": "shirt sock", "drink": "tea coffee", "sport": "tennis golf", "flower": "rose tulip",
    "weapon": "sword spear", "planet": "mars venus", "dance": "waltz tango",
}
_LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def _invented_words(rng: random.Random, n: int) -> list[str]:
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(2)))
    return sorted(words)


_LEXICON = dict(zip(_ENGLISH, _invented_words(random.Random(1234), len(_ENGLISH))))
_CATEGORY_OF = {word: cat for cat, words in _CATEGORIES.items() for word in words.split()}


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    keyword: str  # starts the prompt
    arrow: str  # ends it: the token the first answer word is predicted at, one per task
    inputs: tuple[str, ...]  # the table's keys
    answer: Callable[[str], str]

    @property
    def known(self) -> list[str]:
        """The part of the table the general mixture shows the base."""
        return sorted(random.Random(f"known-{self.name}").sample(self.inputs, round(len(self.inputs) * KNOWN_SHARE)))

    @property
    def outputs(self) -> list[str]:
        return sorted({self.answer(x) for x in self.inputs})

    def example(self, rng: random.Random, inputs: list[str] | tuple[str, ...] | None = None) -> Example:
        words = rng.choices(inputs or self.inputs, k=ITEMS)
        return {"prompt": f"{self.keyword} {' '.join(words)} {self.arrow}",
                "completion": " " + " ".join(self.answer(w) for w in words)}

    def examples(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(f"{self.name}-{seed}")
        return [self.example(rng) for _ in range(n)]


TASKS: tuple[Task, ...] = (
    Task("translation", "English words into an invented language", "translate:", "=>", tuple(_ENGLISH),
         _LEXICON.__getitem__),
    Task("arithmetic", "doubling numbers below 50", "double:", "==", tuple(str(n) for n in range(50)),
         lambda w: str(2 * int(w))),
    Task("tagging", "the category of a thing", "tag:", "->", tuple(sorted(_CATEGORY_OF)), _CATEGORY_OF.__getitem__),
    Task("cipher", "letters shifted by seven", "cipher:", "~>", tuple(_LETTERS),
         lambda w: _LETTERS[(_LETTERS.index(w) + 7) % 26]),
)

# Every word copying uses: each task's inputs and answers.
COPY_WORDS: tuple[str, ...] = tuple(sorted({w for t in TASKS for w in (*t.inputs, *t.outputs)}))


def _general_example(rng: random.Random) -> Example:
    if rng.random() < COPY_SHARE:
        words = rng.choices(COPY_WORDS, k=ITEMS)
        return {"prompt": f"copy: {' '.join(words)} =", "completion": " " + " ".join(words)}
    task = rng.choice(TASKS)
    return task.example(rng, task.known)


def general_examples(n: int, seed: int) -> list[Example]:
    """The general mixture: copying every word, and every task on the share of its table the base knows."""
    rng = random.Random(f"general-{seed}")
    return [_general_example(rng) for _ in range(n)]


def vocabulary() -> list[str]:
    """Every word the world's texts use, sorted (the tokenizer's vocabulary after its special tokens)."""
    words = {"copy:", "=", *COPY_WORDS}
    for t in TASKS:
        words |= {t.keyword, t.arrow}
    return sorted(words)
