"""Synthetic tasks of clearly different kinds, written as JSONL prompt/completion pairs.

Each task draws its examples from its own seeded generator, uses its own vocabulary (digits, invented
words, English templates, single letters), and so exercises different experts of a MoE model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from esftctl.jsonl import Example

_ENGLISH = ("cat dog bird fish tree river stone fire water sun moon star red blue green big small old new "
            "house road king queen bread milk day night").split()


def _invented_words(rng: random.Random, n: int) -> list[str]:
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(2)))
    return sorted(words)


# A fixed lexicon: the same English word always maps to the same invented word.
_LEXICON = dict(zip(_ENGLISH, _invented_words(random.Random(1234), len(_ENGLISH))))

_INTENTS = {
    "weather": ["what is the weather in {city}", "will it rain in {city} {when}", "is it cold in {city} {when}"],
    "music": ["play some {genre} music", "put on a {genre} song", "i want to hear {genre} {when}"],
    "alarm": ["wake me up at {hour}", "set an alarm for {hour} {when}", "remind me at {hour}"],
    "booking": ["book a table for {n} {when}", "reserve a room for {n} people", "get me a table at {hour}"],
}
_SLOTS = {
    "city": ["paris", "tokyo", "lima", "oslo", "cairo", "delhi"],
    "when": ["today", "tomorrow", "tonight", "on monday", "this weekend"],
    "genre": ["jazz", "rock", "folk", "piano", "techno"],
    "hour": ["six", "seven", "eight", "nine", "noon"],
    "n": ["two", "three", "four", "five"],
}


def _arithmetic(rng: random.Random) -> Example:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if rng.random() < 0.5:
        return {"prompt": f"calc {a} + {b} =", "completion": f" {a + b}"}
    a, b = max(a, b), min(a, b)
    return {"prompt": f"calc {a} - {b} =", "completion": f" {a - b}"}


def _translation(rng: random.Random) -> Example:
    words = rng.choices(_ENGLISH, k=rng.randint(2, 5))
    return {"prompt": f"translate: {' '.join(words)} =>", "completion": " " + " ".join(_LEXICON[w] for w in words)}


def _intent(rng: random.Random) -> Example:
    label = rng.choice(sorted(_INTENTS))
    template = rng.choice(_INTENTS[label])
    text = template.format(**{k: rng.choice(v) for k, v in _SLOTS.items()})
    return {"prompt": f"intent: {text} ->", "completion": f" {label}"}


def _reversal(rng: random.Random) -> Example:
    letters = rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 6))
    return {"prompt": f"reverse: {' '.join(letters)} ->", "completion": " " + " ".join(reversed(letters))}


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    generate: Callable[[random.Random], Example]

    def examples(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(f"{self.name}-{seed}")
        return [self.generate(rng) for _ in range(n)]


TASKS: tuple[Task, ...] = (
    Task("arithmetic", "two-digit addition and subtraction", _arithmetic),
    Task("translation", "word-by-word translation into an invented language", _translation),
    Task("intent", "intent labels of templated requests", _intent),
    Task("reversal", "reverse a sequence of letters", _reversal),
)

