"""Write the bundled instruction data: ligertune/assets/alpaca_sample.jsonl and chat_sample.jsonl.

Every record is assembled from the templates and fact tables in this file with a seeded RNG,
so the output is byte-for-byte reproducible: run the script and `git diff` shows nothing.
The text is ours; no public dataset is copied.

The mix is chosen to look like real instruction-tuning data to the pipeline: short answers (a
number, a word, one sentence), medium answers of a few sentences or a worked calculation, and
multi-paragraph explanations; a good share of records carry an ``input`` field. The chat file
strings the same tasks into one- to three-turn conversations, some with a system message.

    python scripts/make_alpaca_sample.py            # rewrite both files
    python scripts/make_alpaca_sample.py --check    # exit 1 if the committed files are stale
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "ligertune" / "assets"
NUM_RECORDS = 400
NUM_CONVERSATIONS = 120
SEED = 2024

Record = tuple[str, str, str]  # instruction, input, output

# --------------------------------------------------------------------------------------------
# Fact tables (our own wording)
# --------------------------------------------------------------------------------------------
# fmt: off

NAMES = ["Ana", "Bilal", "Chen", "Dara", "Emeka", "Freya", "Goran", "Hana", "Ines", "Jonas", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Rosa", "Sven", "Tariq", "Yuki"]
ITEMS = [("apples", "crate"), ("pencils", "box"), ("eggs", "carton"), ("stickers", "sheet"),
         ("bottles of water", "pack"), ("tea bags", "tin"), ("batteries", "pack"), ("cupcakes", "tray")]

# (unit, plural, target unit, target plural, factor, symbol pair)
CONVERSIONS = [
    ("kilometre", "kilometres", "mile", "miles", 0.621371),
    ("mile", "miles", "kilometre", "kilometres", 1.609344),
    ("kilogram", "kilograms", "pound", "pounds", 2.204623),
    ("pound", "pounds", "kilogram", "kilograms", 0.453592),
    ("litre", "litres", "US gallon", "US gallons", 0.264172),
    ("metre", "metres", "foot", "feet", 3.280840),
    ("inch", "inches", "centimetre", "centimetres", 2.54),
    ("hour", "hours", "minute", "minutes", 60),
    ("day", "days", "hour", "hours", 24),
    ("cup", "cups", "millilitre", "millilitres", 240),
]

WORD_POOLS = {
    "fruits": ["apple", "banana", "cherry", "date", "fig", "grape", "kiwi", "lemon", "mango", "melon",
               "orange", "papaya", "peach", "pear", "plum", "quince"],
    "animals": ["badger", "camel", "dolphin", "eagle", "ferret", "gecko", "heron", "ibis", "jaguar",
                "koala", "lynx", "marmot", "newt", "otter", "panda", "raven", "walrus", "zebra"],
    "colours": ["amber", "azure", "beige", "crimson", "cyan", "indigo", "ivory", "lilac", "maroon",
                "ochre", "olive", "teal", "violet"],
    "tools": ["chisel", "clamp", "drill", "file", "hammer", "level", "mallet", "pliers", "rasp", "saw",
              "spanner", "trowel", "wrench"],
}

SUBJECTS = ["the gardener", "my neighbour", "the new intern", "our teacher", "the pilot", "the baker",
            "the night guard", "my aunt", "the librarian", "the coach"]
# verb forms: base, third person, past, participle; then objects that make sense with the verb
VERBS = [
    (("paint", "paints", "painted", "painted"), ["the fence", "the kitchen door", "a small boat"]),
    (("repair", "repairs", "repaired", "repaired"), ["the old radio", "a broken chair", "the bicycle"]),
    (("water", "waters", "watered", "watered"), ["the tomato plants", "the lawn", "the window boxes"]),
    (("write", "writes", "wrote", "written"), ["a long letter", "the weekly report", "a short poem"]),
    (("bake", "bakes", "baked", "baked"), ["a loaf of rye bread", "the birthday cake", "a tray of scones"]),
    (("clean", "cleans", "cleaned", "cleaned"), ["the garage", "the whiteboard", "the fish tank"]),
    (("read", "reads", "read", "read"), ["the morning paper", "a mystery novel", "the safety manual"]),
    (("check", "checks", "checked", "checked"), ["the front gate", "the fuel gauge", "every invoice"]),
    (("build", "builds", "built", "built"), ["a bird house", "a wooden shelf", "a sandcastle"]),
    (("sweep", "sweeps", "swept", "swept"), ["the porch", "the courtyard", "the back stairs"]),
    (("carry", "carries", "carried", "carried"), ["the heavy boxes", "a basket of laundry", "the ladder"]),
    (("open", "opens", "opened", "opened"), ["the shop", "the meeting", "the gallery"]),
]
PLURAL_OBJECTS = ("the tomato plants", "the window boxes", "the heavy boxes", "the back stairs")
ADVERBIALS = ["every Saturday", "before breakfast", "with great care", "in the afternoon", "after work",
              "on Mondays", "twice a week", ""]

# name, definition, how it works, example, why it matters
CONCEPTS = [
    ("photosynthesis",
     "Photosynthesis is the process plants, algae and some bacteria use to turn light into chemical energy.",
     "Inside the leaves, chlorophyll captures sunlight. The plant uses that energy to combine carbon dioxide "
     "from the air with water from the soil, producing glucose and releasing oxygen as a by-product.",
     "A sunflower growing in a field is doing this all day: the sugar it makes feeds its stem, leaves and seeds.",
     "Nearly every food chain starts with it, and it produces much of the oxygen animals breathe."),
    ("compound interest",
     "Compound interest is interest calculated on both the original amount and the interest already earned.",
     "Each period the interest is added to the balance, so the next period's interest is computed on a "
     "larger number. The growth speeds up over time instead of staying constant.",
     "If you save 1,000 dollars at 5% a year, you have 1,050 after one year and 1,102.50 after two, because "
     "the second year's interest is paid on 1,050.",
     "It rewards saving early and makes long-term debt expensive, so it shapes almost every money decision."),
    ("binary search",
     "Binary search is a method for finding a value in a sorted list by repeatedly halving the search range.",
     "You compare the target with the middle element. If they differ, you throw away the half that cannot "
     "contain the target and repeat on the other half until you find it or the range is empty.",
     "To find 37 in a sorted list of 1,000 numbers, you need at most ten comparisons instead of up to a "
     "thousand.",
     "It turns slow searches into fast ones, which is why databases and dictionaries keep data sorted."),
    ("the water cycle",
     "The water cycle is the continuous movement of water between the oceans, the air and the land.",
     "The sun warms surface water so that it evaporates. The vapour rises, cools and condenses into clouds, "
     "then falls as rain or snow. The water flows through rivers and soil back to the sea, and it starts "
     "again.",
     "A puddle that disappears on a sunny afternoon has become part of the air and may fall as rain far away.",
     "It delivers fresh water to every living thing on land and moves heat around the planet."),
    ("a leap year",
     "A leap year is a year with 366 days instead of 365, with the extra day added as 29 February.",
     "Earth takes about 365.24 days to orbit the Sun. Adding a day every fourth year keeps the calendar in "
     "step, except for century years, which are leap years only when divisible by 400.",
     "The year 2000 was a leap year because it is divisible by 400, but 1900 was not.",
     "Without it, the seasons would drift by about a day every four years."),
    ("inflation",
     "Inflation is the general rise in prices over time, which means money buys less than it used to.",
     "It happens when demand grows faster than the supply of goods, when production becomes more expensive, "
     "or when much more money circulates. Economists track it with a price index for a typical basket of "
     "goods.",
     "If a loaf of bread costs 2 dollars this year and 2.10 next year, its price rose by 5%.",
     "It erodes savings that earn no interest, so central banks try to keep it low and stable."),
    ("a prime number",
     "A prime number is a whole number greater than 1 whose only divisors are 1 and itself.",
     "To test a number, you only need to try dividing it by primes up to its square root: if none divides "
     "it evenly, it is prime.",
     "The number 29 is prime, while 27 is not, because 27 = 3 × 9.",
     "Primes are the building blocks of all whole numbers, and large ones keep online payments secure."),
    ("gravity",
     "Gravity is the force by which objects with mass attract one another.",
     "The pull grows with the masses involved and weakens with the square of the distance between them. "
     "On Earth it gives everything weight and makes dropped objects speed up by about 9.8 metres per "
     "second every second.",
     "The Moon stays in orbit because Earth's gravity keeps bending its path into a circle-like loop.",
     "It holds planets in orbit, keeps our atmosphere in place and shapes how stars and galaxies form."),
    ("a hash table",
     "A hash table is a data structure that stores key-value pairs and finds a value by its key in about "
     "constant time.",
     "A hash function turns each key into a number that picks a slot in an array. When two keys land in the "
     "same slot, the table resolves the collision, for example by keeping a short list in that slot.",
     "A phone book program can map the name 'Lena' straight to her number without scanning every entry.",
     "Caches, databases and programming-language dictionaries all rely on it for fast lookups."),
    ("the Pythagorean theorem",
     "The Pythagorean theorem says that in a right triangle the square of the longest side equals the sum "
     "of the squares of the other two sides.",
     "If the two short sides are a and b and the long side is c, then a² + b² = c². Knowing any two sides "
     "lets you compute the third.",
     "A ladder 5 metres long whose foot stands 3 metres from a wall reaches 4 metres up, since 9 + 16 = 25.",
     "Builders, map makers and game programmers use it every day to compute distances."),
    ("evaporation",
     "Evaporation is the change of a liquid into a gas at its surface, below its boiling point.",
     "Molecules at the surface that move fast enough escape into the air. Heat, wind and dry air all speed "
     "it up, and it cools what is left behind because the fastest molecules leave first.",
     "Wet clothes on a line dry faster on a warm, breezy day than on a cold, still one.",
     "It drives the water cycle and explains why sweating cools the body."),
    ("recursion",
     "Recursion is a way of solving a problem by having a function call itself on a smaller version of the "
     "same problem.",
     "Every recursive function needs a base case that is answered directly, and a rule that reduces larger "
     "cases towards it. Without a base case, the calls never stop.",
     "The factorial of 5 can be computed as 5 times the factorial of 4, down to the factorial of 1, which "
     "is simply 1.",
     "It gives short, clear solutions for nested structures such as folders, family trees and expressions."),
    ("erosion",
     "Erosion is the wearing away and carrying off of rock and soil by water, wind or ice.",
     "Rain loosens particles, rivers carry them downstream, waves pound coastlines and glaciers scrape "
     "valleys. The material is eventually dropped somewhere else as sediment.",
     "A river canyon is the result of a river cutting down through rock for millions of years.",
     "It shapes landscapes and can strip farmland of its fertile top layer if the ground is left bare."),
    ("an electric circuit",
     "An electric circuit is a closed loop through which electric current can flow.",
     "A source such as a battery pushes charge around the loop. Wires carry it, and components such as bulbs "
     "or motors turn its energy into light or motion. Opening a switch breaks the loop and stops the current.",
     "A torch is a simple circuit: battery, switch and bulb joined in one loop.",
     "Every electrical device, from a doorbell to a computer, is built from circuits."),
    ("friction",
     "Friction is the force that resists two surfaces sliding or rolling over each other.",
     "Tiny bumps on each surface catch on one another. Rougher surfaces and larger forces pressing them "
     "together produce more friction, and the lost motion is turned into heat.",
     "Rubbing your hands together on a cold day warms them because of friction.",
     "It lets us walk and lets car tyres grip the road, but it also wears out machine parts."),
    ("the greenhouse effect",
     "The greenhouse effect is the warming of a planet's surface by gases in its atmosphere that trap heat.",
     "Sunlight passes through the air and warms the ground. The ground gives off infrared heat, and gases "
     "such as carbon dioxide and water vapour absorb part of it and send some back down.",
     "Venus has so much carbon dioxide that its surface is hotter than Mercury's, although it is farther "
     "from the Sun.",
     "A natural greenhouse effect keeps Earth habitable; strengthening it raises global temperatures."),
    ("supply and demand",
     "Supply and demand is the idea that prices settle where the amount sellers offer matches the amount "
     "buyers want.",
     "When a good is scarce and many people want it, its price tends to rise. When there is more of it than "
     "people want, sellers lower the price to clear their stock.",
     "Strawberries are cheap in early summer, when farms harvest plenty, and expensive in winter.",
     "It explains most price movements and helps businesses decide how much to produce."),
    ("a food chain",
     "A food chain shows who eats whom in an ecosystem, from plants up to top predators.",
     "Energy passes along the chain, but most of it is used up at each step, so there are fewer animals at "
     "each higher level. Many chains link together into a food web.",
     "Grass is eaten by a rabbit, the rabbit by a fox, and the fox may be eaten by an eagle.",
     "Removing one link can upset the whole ecosystem, which is why protecting single species matters."),
]

# name, order from the Sun, distance in AU, diameter in km, orbit in Earth days, kind, feature
PLANETS = [
    ("Mercury", 1, 0.39, 4879, 88, "rocky planet",
     "it has almost no atmosphere, so its surface swings from scorching days to freezing nights"),
    ("Venus", 2, 0.72, 12104, 225, "rocky planet",
     "its thick carbon dioxide atmosphere traps so much heat that it is the hottest planet"),
    ("Earth", 3, 1.00, 12742, 365, "rocky planet",
     "it is the only planet known to have liquid water on its surface and to support life"),
    ("Mars", 4, 1.52, 6779, 687, "rocky planet",
     "its reddish colour comes from iron oxide dust, and it has the tallest known volcano in the solar system"),
    ("Jupiter", 5, 5.20, 139820, 4333, "gas giant",
     "it has a storm called the Great Red Spot that is wider than Earth"),
    ("Saturn", 6, 9.54, 116460, 10759, "gas giant",
     "it is circled by bright rings made mostly of pieces of ice"),
    ("Uranus", 7, 19.2, 50724, 30687, "ice giant",
     "it is tipped over on its side, so it seems to roll around the Sun"),
    ("Neptune", 8, 30.1, 49244, 60190, "ice giant",
     "it has the fastest winds measured on any planet"),
]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]

# name, class, reason
ANIMALS = [
    ("dolphin", "mammal", "it breathes air through a blowhole and feeds its calves on milk"),
    ("bat", "mammal", "it has fur and nurses its young, even though it flies"),
    ("penguin", "bird", "it has feathers and lays eggs, even though it cannot fly"),
    ("ostrich", "bird", "it has feathers, a beak and lays the largest eggs of any living bird"),
    ("salamander", "amphibian", "its larvae live in water and it has moist skin without scales"),
    ("frog", "amphibian", "it starts life as a tadpole in water and breathes partly through its skin"),
    ("gecko", "reptile", "it has dry, scaly skin and lays eggs with shells on land"),
    ("crocodile", "reptile", "it is covered in tough scales and relies on the sun for warmth"),
    ("shark", "fish", "it breathes through gills and lives its whole life in water"),
    ("salmon", "fish", "it has gills and fins and swims upriver to lay its eggs"),
    ("whale", "mammal", "it breathes air and its calves drink milk"),
    ("tortoise", "reptile", "it has scales, a shell and lays eggs on land"),
]

# activity, tips
TIPS = [
    ("studying for an exam", [
        "Start a week ahead and spread the work over short daily sessions.",
        "Test yourself with practice questions instead of only rereading notes.",
        "Explain each topic out loud as if teaching a friend.",
        "Sleep well the night before; tired brains recall less.",
        "Put your phone in another room while you work.",
        "Mark the topics you find hardest and review them first each day."]),
    ("saving water at home", [
        "Fix dripping taps, since a slow drip wastes many litres a week.",
        "Take shorter showers and turn the tap off while brushing your teeth.",
        "Run the washing machine and dishwasher only when they are full.",
        "Water the garden in the early morning so less evaporates.",
        "Collect rainwater in a barrel for the plants.",
        "Keep a jug of cold water in the fridge instead of running the tap."]),
    ("keeping a houseplant alive", [
        "Check the soil with a finger and water only when the top few centimetres are dry.",
        "Put the plant where it gets the kind of light its label asks for.",
        "Use a pot with drainage holes so roots do not sit in water.",
        "Wipe dust off the leaves so they can take in light.",
        "Feed it a little fertiliser in spring and summer, not in winter.",
        "Turn the pot every week so it grows evenly."]),
    ("running your first 5 kilometres", [
        "Alternate running and walking at first, and shrink the walking breaks each week.",
        "Run at a pace where you can still speak in short sentences.",
        "Rest at least one day between runs so your legs can recover.",
        "Wear shoes that fit well and suit the surface you run on.",
        "Warm up with five minutes of brisk walking.",
        "Pick a date for your 5 km and plan backwards from it."]),
    ("writing a clear email", [
        "Say what you need in the first two sentences.",
        "Use a subject line that names the topic and any deadline.",
        "Keep paragraphs short, one idea each.",
        "List questions separately so each one gets an answer.",
        "Read it once more and delete every sentence that adds nothing.",
        "End with the next step and who takes it."]),
    ("packing for a weekend trip", [
        "Check the weather forecast before choosing clothes.",
        "Pick clothes that all go together so you can mix them.",
        "Roll soft items instead of folding them to save space.",
        "Keep documents, charger and medicine in one small bag you carry.",
        "Pack toiletries in small refillable bottles.",
        "Leave a little room for anything you buy on the way."]),
    ("cooking rice on the stove", [
        "Rinse the rice until the water runs almost clear.",
        "Use about one and a half cups of water for each cup of long-grain rice.",
        "Bring it to a boil, then cover and turn the heat down low.",
        "Do not lift the lid while it simmers.",
        "Let it rest, covered, for ten minutes off the heat.",
        "Fluff it with a fork before serving."]),
]

NUMBER_SENTENCES = [
    "The shop sold {a} chairs, {b} tables and {c} lamps in May.",
    "Our team walked {a} kilometres on Monday, {b} on Tuesday and {c} on Friday.",
    "The library received {a} new novels, {b} atlases and {c} cookbooks this year.",
    "There were {a} cars, {b} vans and {c} bicycles in the car park at noon.",
    "The recipe needs {a} grams of flour, {b} grams of sugar and {c} eggs.",
]

SYSTEM_PROMPTS = [
    "You are a careful assistant. Show your working when you calculate.",
    "You are a friendly tutor who explains things simply.",
    "You are a concise assistant. Keep answers short.",
]
# fmt: on

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def number(x: float) -> str:
    """2 decimals at most, no trailing zeros, thousands separated: 1,234.5."""
    text = f"{x:,.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def sentence_case(text: str) -> str:
    return text[0].upper() + text[1:]


def pick(rng: random.Random, options: list):
    return options[rng.randrange(len(options))]


def a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def date_text(day: datetime.date) -> str:
    return f"{day.day} {day:%B %Y}"


def join_words(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]


# --------------------------------------------------------------------------------------------
# Tasks: each returns (instruction, input, output)
# --------------------------------------------------------------------------------------------


def quick_arithmetic(rng: random.Random) -> Record:
    a, b = rng.randint(12, 999), rng.randint(2, 99)
    op, result = pick(rng, [("+", a + b), ("-", a - b), ("×", a * b)])
    instruction = pick(rng, ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Work out {a} {op} {b}."])
    return instruction.format(a=a, op=op, b=b), "", number(result)


def expression(rng: random.Random) -> Record:
    a, b, c = rng.randint(3, 25), rng.randint(3, 25), rng.randint(2, 60)
    ab = a * b
    return (
        pick(rng, ["Evaluate the expression.", "Calculate the value of this expression step by step."]),
        f"{a} × {b} − {c}",
        f"Multiplication comes before subtraction: {a} × {b} = {ab}. Then {ab} − {c} = {ab - c}.\n\n"
        f"The value is {ab - c}.",
    )


def word_problem(rng: random.Random) -> Record:
    name = pick(rng, NAMES)
    kind = rng.randrange(5)
    if kind == 0:
        (item, pack), k, n = pick(rng, ITEMS), rng.randint(4, 12), rng.randint(3, 9)
        given = rng.randint(1, k * n - 1)
        question = (
            f"{name} buys {n} {pack}s of {item}. Each {pack} holds {k}. {name} gives away {given} of "
            f"them. How many are left?"
        )
        answer = (
            f"{name} starts with {n} × {k} = {n * k} {item}. After giving away {given}, "
            f"{n * k} − {given} = {n * k - given} remain.\n\nAnswer: {n * k - given}"
        )
    elif kind == 1:
        speed, hours = rng.randint(40, 120), rng.randint(2, 7)
        minutes = pick(rng, [0, 15, 30, 45])
        time = hours + minutes / 60
        duration = f"{hours} hours and {minutes} minutes" if minutes else f"{hours} hours"
        in_hours = f"{duration} is {number(time)} hours, so " if minutes else ""
        question = f"A train travels at a steady {speed} km/h for {duration}. How far does it go?"
        answer = (
            f"Distance is speed times time. {in_hours}{speed} × {number(time)} = "
            f"{number(speed * time)} km.\n\nThe train covers {number(speed * time)} kilometres."
        )
    elif kind == 2:
        children, total = rng.randint(3, 9), rng.randint(20, 150)
        each, left = divmod(total, children)
        question = f"{total} marbles are shared equally among {children} children. How many does each child get, and how many are left over?"
        answer = (
            f"Divide {total} by {children}: {children} × {each} = {children * each}, which leaves "
            f"{total} − {children * each} = {left}.\n\nEach child gets {each} marbles and {left} "
            f"{'is' if left == 1 else 'are'} left over."
        )
    elif kind == 3:
        price, pct = rng.randint(20, 400), pick(rng, [10, 15, 20, 25, 30, 40, 50])
        off = price * pct / 100
        question = f"A jacket costs {price} dollars and is on sale at {pct}% off. What is the sale price?"
        answer = (
            f"The discount is {pct}% of {price} = {number(off)} dollars. The sale price is "
            f"{price} − {number(off)} = {number(price - off)} dollars."
        )
    else:
        other = pick(rng, [n for n in NAMES if n != name])
        age, gap, years = rng.randint(12, 40), rng.randint(2, 9), rng.randint(3, 15)
        question = (
            f"{name} is {age} years old and {other} is {gap} years younger. What will the sum of "
            f"their ages be in {years} years?"
        )
        answer = (
            f"{other} is {age} − {gap} = {age - gap} now. In {years} years {name} will be "
            f"{age + years} and {other} will be {age - gap + years}.\n\n"
            f"The sum will be {age + years} + {age - gap + years} = {2 * age - gap + 2 * years}."
        )
    if rng.random() < 0.4:
        return (
            pick(rng, ["Solve the following word problem.", "Answer the question and show your steps."]),
            question,
            answer,
        )
    return question, "", answer


def conversion(rng: random.Random) -> Record:
    if rng.random() < 0.25:
        if rng.random() < 0.5:
            c = rng.randint(-20, 45)
            f = c * 9 / 5 + 32
            return (
                f"Convert {c} °C to Fahrenheit.",
                "",
                f"Multiply by 9/5 and add 32: {c} × 9/5 + 32 = {number(f)}. So {c} °C is {number(f)} °F.",
            )
        f = rng.randint(-4, 110)
        c = (f - 32) * 5 / 9
        return (
            "Convert this temperature from Fahrenheit to Celsius.",
            f"{f} °F",
            f"Subtract 32 and multiply by 5/9: ({f} − 32) × 5/9 = {number(c)}. So {f} °F is about "
            f"{number(c)} °C.",
        )
    unit, units, target, targets, factor = pick(rng, CONVERSIONS)
    value = rng.randint(2, 250) if factor < 10 else rng.randint(2, 30)
    result = value * factor
    short = f"{value} {units} is about {number(result)} {targets}."
    if rng.random() < 0.5:
        return f"How many {targets} are in {value} {units}?", "", short
    return (
        pick(rng, [f"Convert the quantity from {units} to {targets}.", f"Express this in {targets}."]),
        f"{value} {units}",
        f"One {unit} is {factor} {targets}, so multiply: {value} × {factor} = {number(result)}.\n\n{short}",
    )


def sorting(rng: random.Random) -> Record:
    if rng.random() < 0.4:
        values = rng.sample(range(1, 500), rng.randint(5, 10))
        descending = rng.random() < 0.4
        order = "descending" if descending else "ascending"
        return (
            f"Sort these numbers in {order} order.",
            ", ".join(map(str, values)),
            ", ".join(map(str, sorted(values, reverse=descending))),
        )
    pool = pick(rng, sorted(WORD_POOLS))
    words = rng.sample(WORD_POOLS[pool], rng.randint(4, 8))
    if rng.random() < 0.6:
        return ("Put these words in alphabetical order.", ", ".join(words), ", ".join(sorted(words)))
    by_length = sorted(words, key=lambda w: (len(w), w))
    return (
        "Sort the words from shortest to longest. Break ties alphabetically.",
        ", ".join(words),
        ", ".join(by_length),
    )


def make_clause(rng: random.Random) -> tuple[str, tuple[str, str, str, str], str, str]:
    forms, objects = pick(rng, VERBS)
    return pick(rng, SUBJECTS), forms, pick(rng, objects), pick(rng, ADVERBIALS)


def rewrite(rng: random.Random) -> Record:
    subject, (base, third, past, participle), obj, adverbial = make_clause(rng)
    tail = f" {adverbial}" if adverbial else ""
    present = sentence_case(f"{subject} {third} {obj}{tail}.")
    kind = rng.randrange(4)
    if kind == 0:
        return (
            "Rewrite the sentence in the past tense.",
            present,
            sentence_case(f"{subject} {past} {obj}{tail}."),
        )
    if kind == 1:
        aux = "were" if obj in PLURAL_OBJECTS else "was"
        active = sentence_case(f"{subject} {past} {obj}{tail}.")
        return (
            "Rewrite this sentence in the passive voice.",
            active,
            sentence_case(f"{obj} {aux} {participle} by {subject}{tail}."),
        )
    if kind == 2:
        return (
            "Turn the statement into a yes/no question.",
            present,
            sentence_case(f"does {subject} {base} {obj}{tail}?"),
        )
    return ("Make the sentence negative.", present, sentence_case(f"{subject} does not {base} {obj}{tail}."))


def explain(rng: random.Random) -> Record:
    name, definition, how, example, why = pick(rng, CONCEPTS)
    kind = rng.randrange(5)
    if kind == 0:
        return (
            pick(
                rng,
                [
                    f"Explain {name} in simple terms.",
                    f"Can you explain {name}?",
                    f"Write a short explanation of {name} for a curious teenager.",
                ],
            ),
            "",
            f"{definition}\n\n{how}\n\nFor example: {example}\n\n{why}",
        )
    if kind == 1:
        return f"What is {name}? Answer in one sentence.", "", definition
    if kind == 2:
        return f"Give a concrete example of {name}.", "", f"{example}\n\n{definition}"
    if kind == 3:
        return f"Why does {name} matter?", "", f"{why}\n\n{how}"
    return ("Summarise the following paragraph in one sentence.", f"{how} {example} {why}", definition)


def planet(rng: random.Random) -> Record:
    name, order, au, diameter, orbit, kind_, feature = pick(rng, PLANETS)
    kind = rng.randrange(4)
    years = f"{number(orbit / 365.25)} Earth years" if orbit > 1000 else f"{orbit} Earth days"
    if kind == 0:
        return (
            f"Describe the planet {name}.",
            "",
            f"{name} is the {ORDINALS[order - 1]} planet from the Sun, about {number(au)} astronomical "
            f"units away. It is {a(kind_)} roughly {diameter:,} km across, and one trip around "
            f"the Sun takes it {years}.\n\nWhat stands out about {name} is that {feature}.",
        )
    if kind == 1:
        other = pick(rng, [p for p in PLANETS if p[0] != name])
        big, small = sorted([(diameter, name), (other[3], other[0])], reverse=True)
        return (
            f"Which is larger, {name} or {other[0]}?",
            "",
            f"{big[1]} is larger: about {big[0]:,} km across, compared with {small[0]:,} km for {small[1]}.",
        )
    if kind == 2:
        return (
            f"How far is {name} from the Sun?",
            "",
            (
                f"On average {name} is about {number(au)} astronomical units from the Sun, which is roughly "
                f"{number(au * 149.6)} million kilometres."
            ),
        )
    other = pick(rng, [p for p in PLANETS if p[0] != name])
    o_name, o_order, o_au, o_diameter, o_orbit, o_kind, o_feature = other
    ratio = max(diameter, o_diameter) / min(diameter, o_diameter)
    bigger, smaller = (name, o_name) if diameter > o_diameter else (o_name, name)
    closer = name if order < o_order else o_name
    kinds = (
        f"Both are {kind_}s." if kind_ == o_kind else f"{name} is {a(kind_)}, while {o_name} is {a(o_kind)}."
    )
    return (
        f"Compare {name} and {o_name}.",
        "",
        f"{kinds} {closer} is the closer of the two to the Sun "
        f"({number(min(au, o_au))} AU against {number(max(au, o_au))} AU), so it also has the shorter year.\n\n"
        f"In size, {bigger} is about {number(ratio)} times as wide as {smaller} "
        f"({max(diameter, o_diameter):,} km against {min(diameter, o_diameter):,} km).\n\n"
        f"Each has its own character: on {name}, {feature}; on {o_name}, {o_feature}.",
    )


def number_facts(rng: random.Random) -> Record:
    kind = rng.randrange(4)
    if kind == 0:
        n = rng.randint(2, 250)
        divisor = next((d for d in range(2, math.isqrt(n) + 1) if n % d == 0), None)
        if divisor is None:
            checked = [str(p) for p in range(2, math.isqrt(n) + 1) if all(p % q for q in range(2, p))]
            tried = (
                f"None of the primes up to its square root ({join_words(checked)}) divides it"
                if checked
                else "It has no divisors other than 1 and itself"
            )
            return f"Is {n} a prime number?", "", f"Yes. {tried}, so {n} is prime."
        return f"Is {n} a prime number?", "", f"No. {n} = {divisor} × {n // divisor}, so it is not prime."
    if kind == 1:
        a, b = rng.randint(12, 400), rng.randint(12, 400)
        steps, x, y = [], max(a, b), min(a, b)
        while y:
            steps.append(f"{x} = {x // y} × {y} + {x % y}")
            x, y = y, x % y
        return (
            f"Find the greatest common divisor of {a} and {b} using Euclid's algorithm.",
            "",
            "Divide and keep the remainder until it reaches zero:\n"
            + "\n".join(steps)
            + f"\n\nThe last non-zero remainder is {x}, so gcd({a}, {b}) = {x}.",
        )
    if kind == 2:
        n = rng.randint(6, 120)
        factors = [d for d in range(1, n + 1) if n % d == 0]
        return f"List all the factors of {n}.", "", ", ".join(map(str, factors))
    n = rng.randint(101, 9999)
    place = pick(rng, [10, 100])
    return (
        f"Round {n} to the nearest {'ten' if place == 10 else 'hundred'}.",
        "",
        str(int(math.floor(n / place + 0.5)) * place),
    )


def text_ops(rng: random.Random) -> Record:
    kind = rng.randrange(5)
    subject, (_, third, _, _), obj, adverbial = make_clause(rng)
    sentence = sentence_case(f"{subject} {third} {obj}{' ' + adverbial if adverbial else ''}.")
    words = sentence.rstrip(".").split()
    if kind == 0:
        return (
            "Count the words in the following sentence.",
            sentence,
            f"The sentence has {len(words)} words.",
        )
    if kind == 1:
        return ("Reverse the order of the words in this sentence.", sentence, " ".join(reversed(words)))
    if kind == 2:
        return (
            "Convert the text to title case.",
            sentence.rstrip("."),
            " ".join(w.capitalize() for w in words),
        )
    if kind == 3:
        a, b, c = rng.randint(2, 90), rng.randint(2, 90), rng.randint(2, 90)
        text = pick(rng, NUMBER_SENTENCES).format(a=a, b=b, c=c)
        return (
            "Extract every number from the text and give their total.",
            text,
            f"The numbers are {a}, {b} and {c}. Their total is {a + b + c}.",
        )
    word = pick(rng, pick(rng, list(WORD_POOLS.values())))
    vowels = sum(ch in "aeiou" for ch in word)
    return f'How many vowels are in the word "{word}"?', "", f"{vowels}"


def classify_animal(rng: random.Random) -> Record:
    animal, cls, reason = pick(rng, ANIMALS)
    if rng.random() < 0.5:
        return (
            f"Is {a(animal)} a mammal, bird, reptile, amphibian or fish?",
            "",
            f"{sentence_case(a(animal))} is {a(cls)}: {reason}.",
        )
    return ("Classify the animal as a mammal, bird, reptile, amphibian or fish.", animal, cls)


def tips(rng: random.Random) -> Record:
    activity, all_tips = pick(rng, TIPS)
    k = rng.randint(3, 5)
    chosen = rng.sample(all_tips, k)
    body = "\n".join(f"{i}. {tip}" for i, tip in enumerate(chosen, 1))
    intro = pick(rng, ["Here are some tips:", f"A few habits make {activity} much easier:", ""])
    return f"Give {k} tips for {activity}.", "", (f"{intro}\n\n" if intro else "") + body


def dates(rng: random.Random) -> Record:
    start = datetime.date(1990, 1, 1) + datetime.timedelta(days=rng.randrange(15000))
    if rng.random() < 0.5:
        return (f"What day of the week was {date_text(start)}?", "", f"{date_text(start)} was a {start:%A}.")
    end = start + datetime.timedelta(days=rng.randint(10, 400))
    gap = (end - start).days
    return (
        "How many days are there between these two dates?",
        f"{date_text(start)} and {date_text(end)}",
        f"Counting from {date_text(start)} to {date_text(end)} gives {gap} days "
        f"(about {number(gap / 7)} weeks).",
    )


def long_form(rng: random.Random) -> Record:
    """The long tail: 150–300 word answers assembled from several table entries."""
    kind = rng.randrange(3)
    if kind == 0:
        inner = rng.random() < 0.5
        group = PLANETS[:4] if inner else PLANETS[4:]
        parts = [
            f"The {'inner' if inner else 'outer'} planets are {join_words([p[0] for p in group])}. "
            + (
                "They are small, dense worlds of rock and metal, packed close to the Sun."
                if inner
                else "They are huge worlds made mostly of gas and ice, spread far out from the Sun."
            )
        ]
        for name, order, au, diameter, _, _, feature in group:
            parts.append(
                f"{name}, the {ORDINALS[order - 1]} planet, orbits about {number(au)} AU from the "
                f"Sun and is roughly {diameter:,} km wide. Notably, {feature}."
            )
        biggest = max(group, key=lambda p: p[3])
        parts.append(
            f"Of the four, {biggest[0]} is the largest, and a year grows longer the farther out a "
            f"planet is: from {group[0][4]:,} Earth days for {group[0][0]} to {group[-1][4]:,} for "
            f"{group[-1][0]}."
        )
        return (
            f"Write a short overview of the {'inner' if inner else 'outer'} planets.",
            "",
            "\n\n".join(parts),
        )
    if kind == 1:
        first, second = rng.sample(CONCEPTS, 2)
        sections = [f"{c[1]} {c[2]}\n\nFor example: {c[3]}" for c in (first, second)]
        return (
            f"Explain {first[0]} and {second[0]}, then say why each one matters.",
            "",
            f"{sections[0]}\n\n{sections[1]}\n\nWhy they matter: {first[4]} As for {second[0]}: "
            f"{second[4][0].lower()}{second[4][1:]}",
        )
    activity, all_tips = pick(rng, TIPS)
    steps = "\n".join(f"{i}. {tip}" for i, tip in enumerate(rng.sample(all_tips, len(all_tips)), 1))
    return (
        pick(
            rng,
            [f"Write a beginner's guide to {activity}.", f"I have never tried {activity}. Where do I start?"],
        ),
        "",
        f"Everyone starts somewhere, and {activity} is easier than it looks once you have a routine. The "
        f"steps below are ordered loosely; pick the ones that fit your situation and add the rest later.\n\n"
        f"{steps}\n\nDo not try to get everything right in the first week. Choose two habits, repeat them "
        f"until they feel automatic, then add another. Small, steady changes last longer than a big effort "
        f"that fades after a few days.",
    )


# Weights set the length mix: explanations and comparisons are the long tail.
TASKS: list[tuple[float, Callable[[random.Random], Record]]] = [
    (1.0, quick_arithmetic),
    (0.8, expression),
    (2.0, word_problem),
    (1.4, conversion),
    (1.2, sorting),
    (1.4, rewrite),
    (2.2, explain),
    (1.4, planet),
    (1.4, number_facts),
    (1.2, text_ops),
    (0.8, classify_animal),
    (1.0, tips),
    (0.8, dates),
    (0.9, long_form),
]


def generate_records(n: int, seed: int) -> list[dict]:
    """`n` distinct Alpaca records, the same for the same seed."""
    rng = random.Random(seed)
    weights = [w for w, _ in TASKS]
    records, seen = [], set()
    while len(records) < n:
        task = rng.choices(TASKS, weights)[0][1]
        instruction, input_, output = task(rng)
        if (instruction, input_) in seen:
            continue
        seen.add((instruction, input_))
        records.append({"instruction": instruction, "input": input_, "output": output})
    return records


def generate_conversations(n: int, seed: int) -> list[dict]:
    """`n` chats of 1–3 user/assistant turns built from fresh records, some with a system message."""
    rng = random.Random(seed)
    pool = generate_records(n * 3, seed + 1)
    conversations = []
    for i in range(n):
        messages = [{"role": "system", "content": pick(rng, SYSTEM_PROMPTS)}] if rng.random() < 0.35 else []
        for record in pool[3 * i : 3 * i + rng.randint(1, 3)]:
            user = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": record["output"]},
            ]
        conversations.append({"messages": messages})
    return conversations


def to_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Fail if the committed files differ.")
    args = parser.parse_args()
    outputs = {
        ASSETS / "alpaca_sample.jsonl": to_jsonl(generate_records(NUM_RECORDS, SEED)),
        ASSETS / "chat_sample.jsonl": to_jsonl(generate_conversations(NUM_CONVERSATIONS, SEED)),
    }
    stale = [p for p, text in outputs.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"stale: {path} (run python scripts/make_alpaca_sample.py)")
        return 1 if stale else 0
    ASSETS.mkdir(parents=True, exist_ok=True)
    for path, text in outputs.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path} ({len(text.splitlines())} records, {len(text.encode()) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
