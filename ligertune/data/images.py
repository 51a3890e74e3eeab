"""The image parts of a conversation (`ligertune.data.vision`), read without torch: `validate`
checks the first rows' images with it too.

A message's ``content`` is text or a list of parts, ``{"type": "text", "text": ...}`` and
``{"type": "image", ...}``; an image is a ``path`` (relative to the data file's folder, or
absolute), a base64 ``data:`` URI (in ``url`` or ``image``), or nothing, for a hub dataset row
that holds its decoded images in an ``images`` column (taken in order). ``http(s)`` URLs are
refused: runs are offline, and a fetch while tokenising would make the data depend on the network.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from ligertune.errors import DataError

ROLES = ("system", "user", "assistant")


class BadImage(Exception):
    """An image part that cannot be opened; its message names the image."""


def open_image(part: dict, base: Path | None, images: list, used: int):
    """The PIL image (RGB) an image part names; BadImage saying why not."""
    from PIL import Image, UnidentifiedImageError

    ref = _reference(part)
    try:
        if ref is None:
            if used >= len(images):
                raise BadImage(f"image {used} has no path and the row's images column has {len(images)}")
            image = images[used]
            if isinstance(image, dict) and image.get("bytes"):  # datasets' undecoded Image feature
                image = Image.open(io.BytesIO(image["bytes"]))
            return image.convert("RGB")
        if not isinstance(ref, str):
            raise BadImage(f"image {ref!r} is not a path, data: URI or URL")
        if ref.startswith("data:"):
            header, _, payload = ref.partition(",")
            if ";base64" not in header:
                raise BadImage(f"image {ref[:40]}...: only base64 data: URIs are read")
            image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        elif ref.startswith(("http://", "https://")):
            raise BadImage(
                f"image {ref}: URLs are not fetched (runs are offline); download it and give its path"
            )
        else:
            image = Image.open(_local_path(ref, base))
        image.load()
        return image.convert("RGB")
    except BadImage:
        raise
    except FileNotFoundError:
        raise BadImage(f"image {ref}: file not found") from None
    except (UnidentifiedImageError, OSError, binascii.Error, ValueError) as e:
        raise BadImage(f"image {str(ref)[:80]}: cannot be read ({type(e).__name__}: {e})") from None


def _reference(part: dict) -> Any:
    return next((part[k] for k in ("path", "url", "image") if part.get(k) is not None), None)


def _local_path(ref: str, base: Path | None) -> Path:
    return Path(ref) if Path(ref).is_absolute() or base is None else base / ref


def image_files(value: Any, base: Path | None) -> list[Path]:
    """The files a row's image parts name by path, as `open_image` would open them (not data:
    URIs, URLs or the row's images column, which the row itself holds): the vision cache keys
    a sample by their sizes and modification times without opening them."""
    files = []
    for message in value if isinstance(value, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            ref = _reference(part) if isinstance(part, dict) and part.get("type") == "image" else None
            if isinstance(ref, str) and not ref.startswith(("data:", "http://", "https://")):
                files.append(_local_path(ref, base))
    return files


def read_conversation(value: Any, where: str, base: Path | None, images: list) -> tuple[list[dict], list]:
    """The row's messages in the chat template's structured form (content: a list of text and
    image parts) and its images, in order."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}")
    messages, opened = [], []
    for turn, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            raise DataError(f"{where}: message {turn} has role {role!r}; roles are {', '.join(ROLES)}")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
            raise DataError(f"{where}: message {turn}: content must be text or a list of {{type, ...}} parts")
        parts = []
        for part in content:
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif part.get("type") == "image":
                if role == "assistant":
                    raise DataError(f"{where}: message {turn}: images belong in user or system messages")
                opened.append(open_image(part, base, images, len(opened)))
                parts.append({"type": "image"})
            else:
                raise DataError(
                    f"{where}: message {turn}: part {part!r} is neither {{type: text, text}} nor {{type: image, ...}}"
                )
        messages.append({"role": role, "content": parts})
    return messages, opened


def has_image_parts(value: Any) -> bool:
    """Whether a row's messages have content given as a list of parts (a conversation with images)."""
    return isinstance(value, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in value
    )
