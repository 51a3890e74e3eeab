"""Write the bundled vision-language sample and processor (recipes/quickstart-vl.yaml).

* ``ligertune/assets/vl_sample.jsonl`` and ``ligertune/assets/vl_images/*.png``: 50 conversations,
  each a 56×56 PNG of one coloured shape on a white ground and the question what it shows; the
  answer names the colour and the shape ("A red circle."), so a tiny model can learn it from the
  pixels. Drawn with a seeded generator: rerunning the script reproduces the committed files.
* ``ligertune/assets/vl_processor/``: the bundled text tokenizer (ligertune/assets/tokenizer) with
  Qwen2.5-VL's four vision tokens added (ids 2048–2051), a chat template that writes
  ``<|vision_start|><|image_pad|><|vision_end|>`` for each image part, and Qwen2-VL's image
  processor config with small pixel bounds (56×56 to 112×112: 4 to 16 image tokens).
* ``ligertune/assets/vl_processor_gemma3/``: the same text tokenizer with Gemma 3's turn and image
  tokens added (ids 2048–2052), a chat template with Gemma's turn markers (the assistant is
  ``model``, a system message opens the first user turn) that writes ``<start_of_image>`` for
  each image part, and Gemma 3's image processor at a fixed 56×56 (tiny-gemma3-vl).
* ``ligertune/assets/vl_processor_mllama/``: the same text tokenizer with Llama 3's header and
  end-of-turn tokens (ids 2048–2050) and ``<|image|>`` (2051, one past the tiny model's text
  vocabulary, as in the checkpoints: never predicted), a Llama-3-style chat template that writes
  ``<|image|>`` for each image part, and Llama 3.2 Vision's image processor with 56×56 tiles, at
  most 2 per image (tiny-mllama).

    python scripts/make_vl_sample.py [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import random
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw

ASSETS = Path(__file__).resolve().parent.parent / "ligertune" / "assets"
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = ("What is in the image?", "Describe the picture.", "What do you see?")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SIZE, ROWS = 56, 50

# The bundled template, with content that may be a list of parts (text, image).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ ': use system, user or assistant') }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


GEMMA3_TOKENS = [
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

# Gemma's turn markers, content as text or parts. The system message goes at the head of the first
# user turn (Gemma has no system role); earlier turns render the same whatever follows them, so
# the assistant turns are found by prefix (ligertune.data.chat).
GEMMA3_CHAT_TEMPLATE = (
    "{% macro content(message) %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ ': use system, user or assistant') }}"
    "{% endif %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message must come first') }}"
    "{% endif %}"
    "{% if message['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.index0 == 1 and messages[0]['role'] == 'system' %}{{ content(messages[0]) }}\n\n{% endif %}"
    "{{ content(message) }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


MLLAMA_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|image|>"]
# Llama 3's turn headers, content as text or parts; earlier turns render the same whatever follows
# them, so the assistant turns are found by prefix (ligertune.data.chat).
MLLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ ': use system, user or assistant') }}"
    "{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def draw(shape: str, colour: tuple[int, int, int], rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    size = rng.randint(24, 40)
    x, y = rng.randint(2, SIZE - size - 2), rng.randint(2, SIZE - size - 2)
    if shape == "square":
        pen.rectangle((x, y, x + size, y + size), fill=colour)
    elif shape == "circle":
        pen.ellipse((x, y, x + size, y + size), fill=colour)
    else:
        pen.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=colour)
    return image


def write_sample(out: Path) -> None:
    rng = random.Random(0)
    images = out / "vl_images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(ROWS):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        name = f"vl_images/{i:02d}.png"
        draw(shape, COLOURS[colour], rng).save(out / name, optimize=True)
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "path": name},
                            {"type": "text", "text": rng.choice(QUESTIONS)},
                        ],
                    },
                    {"role": "assistant", "content": f"A {colour} {shape}."},
                ]
            }
        )
    with open(out / "vl_sample.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_processor(out: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out / "vl_processor")
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": SIZE * SIZE, "longest_edge": 4 * SIZE * SIZE}, patch_size=14, merge_size=2
    )
    processor.save_pretrained(out / "vl_processor")


def write_gemma3_processor(out: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(out / "vl_processor_gemma3")
    Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE}).save_pretrained(out / "vl_processor_gemma3")


def write_mllama_processor(out: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": MLLAMA_TOKENS})
    tokenizer.chat_template = MLLAMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(out / "vl_processor_mllama")
    MllamaImageProcessorPil(size={"height": SIZE, "width": SIZE}, max_image_tiles=2).save_pretrained(
        out / "vl_processor_mllama"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="rebuild in a temporary folder and compare")
    args = parser.parse_args()
    if not args.check:
        write_sample(ASSETS)
        write_processor(ASSETS)
        write_gemma3_processor(ASSETS)
        write_mllama_processor(ASSETS)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write_sample(Path(tmp))
        write_processor(Path(tmp))
        write_gemma3_processor(Path(tmp))
        write_mllama_processor(Path(tmp))
        names = [p.relative_to(tmp) for p in Path(tmp).rglob("*") if p.is_file()]
        differ = [str(n) for n in names if not filecmp.cmp(Path(tmp) / n, ASSETS / n, shallow=False)]
    print("differs: " + ", ".join(differ) if differ else f"{len(names)} files as committed")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
