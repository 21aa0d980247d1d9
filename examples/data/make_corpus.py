"""Writes tiny_corpus.txt: a small synthetic English corpus (about 120 KB) for examples/train_moe.py.

Sentences come from a small grammar with a fixed seed, so the file is reproducible and carries no one's
copyright; it has enough structure (agreement, fixed phrases, counting rhymes) for a byte-level model to
learn something visible in a few hundred steps. Run `python examples/data/make_corpus.py` to rewrite it.
"""

from __future__ import annotations

import argparse
import pathlib
import random

NOUNS = ["fox", "miller", "river", "lantern", "sparrow", "baker", "ship", "garden", "owl", "tailor",
         "mountain", "child", "clock", "wolf", "island", "farmer", "bell", "queen", "road", "cat"]
ADJECTIVES = ["old", "small", "quiet", "bright", "hungry", "patient", "silver", "tired", "clever", "cold"]
VERBS = [("sees", "saw"), ("follows", "followed"), ("finds", "found"), ("calls", "called"),
         ("carries", "carried"), ("watches", "watched"), ("remembers", "remembered"), ("greets", "greeted")]
PLACES = ["by the mill", "under the bridge", "near the market", "at the edge of the wood", "on the hill",
          "beside the well", "in the harbour", "behind the church"]
TIMES = ["In the morning", "At dusk", "Long ago", "One winter", "Every spring", "Before the rain", "At noon"]
IRREGULAR_PLURALS = {"fox": "foxes", "wolf": "wolves", "child": "children", "church": "churches"}
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def plural(noun: str) -> str:
    return IRREGULAR_PLURALS.get(noun, noun + "s")


def noun_phrase(rng: random.Random) -> str:
    article = rng.choice(["the", "a"])
    if rng.random() < 0.5:
        phrase = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    else:
        phrase = rng.choice(NOUNS)
    if article == "a" and phrase[0] in "aeiou":
        article = "an"
    return f"{article} {phrase}"


def sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.45:
        present, past = rng.choice(VERBS)
        verb = past if rng.random() < 0.5 else present
        text = f"{noun_phrase(rng)} {verb} {noun_phrase(rng)} {rng.choice(PLACES)}"
        if rng.random() < 0.4:
            text = f"{rng.choice(TIMES)}, {text}"
    elif kind < 0.7:
        text = f"{noun_phrase(rng)} was {rng.choice(ADJECTIVES)}, and {noun_phrase(rng)} was {rng.choice(ADJECTIVES)}"
    elif kind < 0.85:
        n = rng.randrange(len(NUMBERS) - 1)
        noun = rng.choice(NOUNS)
        text = f"{NUMBERS[n]} {plural(noun)} and one more make {NUMBERS[n + 1]} {plural(noun)}"
    else:
        first, second = rng.sample(NOUNS, 2)
        text = f"\"Where is the {first}?\" asked the {second}. \"It is {rng.choice(PLACES)},\" said the {first}"
    return text[0].upper() + text[1:] + "."


def corpus(num_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < num_bytes:
        paragraph = " ".join(sentence(rng) for _ in range(rng.randint(3, 6)))
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=120_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).with_name("tiny_corpus.txt"))
    args = parser.parse_args()
    args.out.write_text(corpus(args.bytes, args.seed), encoding="ascii")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
