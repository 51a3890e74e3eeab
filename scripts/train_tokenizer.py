"""Train the bundled tokenizer (ligertune/assets/tokenizer) on the bundled sample data.

A byte-level BPE: text is first mapped to bytes, so any UTF-8 input encodes without an unknown
token, and 2048 - 256 - 5 merges are learned from the Alpaca and chat samples rendered exactly
as the pipeline renders them (Alpaca prompt, chat template), so the template text becomes a
handful of tokens. 2048 is the vocabulary of the shipped ``tiny-llama`` config; a test checks
they agree. Special tokens take ids 0–4 (pad, bos, eos, im_start, im_end); the tokenizer adds
BOS in front of plain text, and the chat template writes its own.

Training is deterministic (single-threaded, fixed input order), so rerunning the script on the
committed samples reproduces the committed files:

    python scripts/make_alpaca_sample.py && python scripts/train_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# Before `tokenizers` starts its thread pool: parallel merge counting can reorder ties.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from ligertune.catalog.architectures import SHIPPED_CONFIGS  # noqa: E402
from ligertune.data.formats import alpaca_prompt  # noqa: E402
from ligertune.data.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "ligertune" / "assets"
VOCAB_SIZE = SHIPPED_CONFIGS["tiny-llama"]["vocab_size"]


def corpus() -> list[str]:
    """The bundled samples as the pipeline renders them, in file order."""
    texts = []
    for line in (ASSETS / "alpaca_sample.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        texts.append(alpaca_prompt(row["instruction"], row["input"]) + row["output"])
    for line in (ASSETS / "chat_sample.jsonl").read_text(encoding="utf-8").splitlines():
        for message in json.loads(line)["messages"]:
            texts.append(f"{message['role']}\n{message['content']}")
    return texts


def train() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=SHIPPED_CONFIGS["tiny-llama"]["max_position_embeddings"],
    )


def files_of(tokenizer: PreTrainedTokenizerFast) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}
    # save_pretrained indents tokenizer.json; without the whitespace it is half the size.
    compact = json.dumps(json.loads(files["tokenizer.json"]), ensure_ascii=False, separators=(",", ":"))
    files["tokenizer.json"] = compact.encode("utf-8")
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Fail if the committed tokenizer differs.")
    args = parser.parse_args()
    files = files_of(train())
    target = ASSETS / "tokenizer"
    if args.check:
        committed = {p.name: p.read_bytes() for p in sorted(target.iterdir())} if target.is_dir() else {}
        if committed != files:
            print(f"stale: {target} (run python scripts/train_tokenizer.py)")
            return 1
        return 0
    target.mkdir(parents=True, exist_ok=True)
    for stale in set(p.name for p in target.iterdir()) - set(files):
        (target / stale).unlink()
    for name, content in files.items():
        (target / name).write_bytes(content)
    size = sum(len(c) for c in files.values()) / 1024
    print(f"wrote {target}: {', '.join(files)} ({size:.0f} KiB, vocab {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
