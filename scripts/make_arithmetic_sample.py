"""Write the bundled prompt data: ligertune/assets/arithmetic_sample.jsonl, arithmetic word problems
with their answers (columns prompt, answer, metadata), for the offline online-RL quickstart
(recipes/quickstart-grpo.yaml) and the GRPO tests.

Every problem comes from the templates below, filled with a seeded RNG, so the output is
byte-for-byte reproducible; the text is ours. One- and two-step problems of the four operations
with whole-number answers (divisions come out even, subtractions stay positive); the answer is the
number as text, the metadata names the operation(s) and the number of steps. The prompt ends with
"Answer:" so that a completion is the answer itself.

    python scripts/make_arithmetic_sample.py            # rewrite the file
    python scripts/make_arithmetic_sample.py --check    # exit 1 if the committed file is stale
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "ligertune" / "assets" / "arithmetic_sample.jsonl"
SEED = 11
NUM_PROBLEMS = 400

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emil", "Farah", "Goro", "Hana", "Ivan", "Jade", "Kofi", "Lena"]
THINGS = ["apples", "stickers", "marbles", "books", "coins", "pencils", "shells", "cards", "stamps", "beads"]
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("shelf", "shelves"), ("jar", "jars"), ("tray", "trays")]


def addition(rng: random.Random) -> tuple[str, int, str]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    text = rng.choice(
        [
            f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
            f"There are {a} {thing} on a table and {b} {thing} on a chair. How many {thing} are there in all?",
        ]
    )
    return text, a + b, "addition"


def subtraction(rng: random.Random) -> tuple[str, int, str]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    b = rng.randint(2, 40)
    a = b + rng.randint(1, 50)
    text = rng.choice(
        [
            f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?",
            f"A shop had {a} {thing}. It sold {b} of them. How many {thing} does it have left?",
        ]
    )
    return text, a - b, "subtraction"


def multiplication(rng: random.Random) -> tuple[str, int, str]:
    thing, (one, many) = rng.choice(THINGS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    text = rng.choice(
        [
            f"There are {a} {many} with {b} {thing} in each {one}. How many {thing} are there?",
            f"Each {one} holds {b} {thing}. How many {thing} do {a} {many} hold?",
        ]
    )
    return text, a * b, "multiplication"


def division(rng: random.Random) -> tuple[str, int, str]:
    name, thing, (_, many) = rng.choice(NAMES), rng.choice(THINGS), rng.choice(CONTAINERS)
    b, q = rng.randint(2, 9), rng.randint(2, 12)
    text = rng.choice(
        [
            f"{name} shares {b * q} {thing} equally among {b} friends. How many {thing} does each friend get?",
            f"{b * q} {thing} are packed equally into {b} {many}. How many {thing} go in each?",
        ]
    )
    return text, q, "division"


def two_steps(rng: random.Random) -> tuple[str, int, str]:
    name, thing, (_, many) = rng.choice(NAMES), rng.choice(THINGS), rng.choice(CONTAINERS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    if rng.random() < 0.5:
        text = (
            f"{name} buys {a} {many} of {b} {thing} and already had {c}. How many {thing} does {name} have?"
        )
        return text, a * b + c, "multiplication, addition"
    c = rng.randint(1, a * b - 1)
    text = f"{name} fills {a} {many} with {b} {thing} each, then gives away {c}. How many {thing} are left?"
    return text, a * b - c, "multiplication, subtraction"


TEMPLATES = [addition, subtraction, multiplication, division, two_steps]


def records() -> list[dict]:
    rng = random.Random(SEED)
    out, seen = [], set()
    while len(out) < NUM_PROBLEMS:
        text, answer, operation = rng.choice(TEMPLATES)(rng)
        if text in seen:
            continue
        seen.add(text)
        steps = 2 if "," in operation else 1
        out.append(
            {
                "prompt": f"Question: {text}\nAnswer:",
                "answer": str(answer),
                "metadata": {"operation": operation, "steps": steps},
            }
        )
    return out


def render() -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not OUT.is_file() or OUT.read_text() != text
        if stale:
            print(f"{OUT} is stale: run python scripts/make_arithmetic_sample.py", file=sys.stderr)
        return int(stale)
    OUT.write_text(text)
    print(f"wrote {NUM_PROBLEMS} problems to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
