"""Write the bundled preference data: ligertune/assets/preference_sample.jsonl (prompt, chosen,
rejected) and kto_sample.jsonl (prompt, completion, label), for the offline quickstarts of the
preference objectives (recipes/quickstart-{dpo,orpo,simpo,kto}.yaml).

Every record comes from the small tables below with a seeded RNG, so the output is
byte-for-byte reproducible. The text is ours. The chosen answer is correct, polite and
complete; the rejected one is wrong, curt or off-topic, so a tiny model can learn the
difference in a few dozen steps. The records are plain text (a column holds one type in
Arrow: chat-message records go in a file of their own; tests/test_preference_data.py makes one).

    python scripts/make_preference_sample.py            # rewrite both files
    python scripts/make_preference_sample.py --check    # exit 1 if the committed files are stale
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "ligertune" / "assets"
SEED = 7
NUM_PAIRS = 200
NUM_KTO = 200

CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Chile", "Santiago"),
    ("Spain", "Madrid"),
    ("India", "New Delhi"),
]
COLOURS = [
    ("grass", "green"),
    ("the clear sky", "blue"),
    ("snow", "white"),
    ("a ripe banana", "yellow"),
    ("coal", "black"),
]
CURT = ["No idea.", "Look it up yourself.", "Why would I know that?", "Whatever.", "Not my problem."]


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    wrong = a + b + rng.choice([-3, -1, 1, 2, 10])
    return (
        f"What is {a} plus {b}?",
        f"{a} plus {b} is {a + b}.",
        f"{a} plus {b} is {wrong}.",
    )


def _capital(rng: random.Random) -> tuple[str, str, str]:
    country, city = rng.choice(CAPITALS)
    other = rng.choice([c for _, c in CAPITALS if c != city])
    return (
        f"What is the capital of {country}?",
        f"The capital of {country} is {city}.",
        rng.choice([f"The capital of {country} is {other}.", rng.choice(CURT)]),
    )


def _colour(rng: random.Random) -> tuple[str, str, str]:
    thing, colour = rng.choice(COLOURS)
    other = rng.choice([c for _, c in COLOURS if c != colour])
    return (
        f"What colour is {thing}?",
        f"{thing[0].upper()}{thing[1:]} is usually {colour}.",
        rng.choice([f"It is {other}.", rng.choice(CURT)]),
    )


def _polite(rng: random.Random) -> tuple[str, str, str]:
    task = rng.choice(
        ["write a thank-you note", "plan a short walk", "start a vegetable garden", "learn to juggle"]
    )
    return (
        f"Can you help me {task}?",
        f"Of course. To {task}, start small, set aside a little time each day, and ask for help when you need it.",
        rng.choice(CURT),
    )


MAKERS = [_arithmetic, _capital, _colour, _polite]


def preference_records(rng: random.Random) -> list[dict]:
    records = []
    for _ in range(NUM_PAIRS):
        prompt, chosen, rejected = rng.choice(MAKERS)(rng)
        records.append({"prompt": f"Question: {prompt}\nAnswer: ", "chosen": chosen, "rejected": rejected})
    return records


def kto_records(rng: random.Random) -> list[dict]:
    records = []
    for _ in range(NUM_KTO):
        prompt, chosen, rejected = rng.choice(MAKERS)(rng)
        good = rng.random() < 0.5
        records.append(
            {
                "prompt": f"Question: {prompt}\nAnswer: ",
                "completion": chosen if good else rejected,
                "label": good,
            }
        )
    return records


def render() -> dict[str, str]:
    rng = random.Random(SEED)
    files = {}
    for name, records in (
        ("preference_sample.jsonl", preference_records(rng)),
        ("kto_sample.jsonl", kto_records(rng)),
    ):
        files[name] = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed files differ")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = ASSETS / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python scripts/make_preference_sample.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
