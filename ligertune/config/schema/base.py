"""The base of every recipe section (strict types, no unknown keys) and the small shared types."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every section. Strict types: YAML already says what type a value is, so ``lr: true``
    or ``packing: 1`` are mistakes to report, not values to coerce (pydantic's default would read
    them as 1.0 and True). An int is still a valid float (``lr: 1``). Infinity and NaN are refused
    wherever a float is expected: no key means anything with them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


# An Adam beta: a decay rate in [0, 1). A YAML list is accepted for the pair (hence not strict on
# the tuple itself), each element strictly a number.
AdamBeta = Annotated[float, Field(strict=True, ge=0.0, lt=1.0)]

# A run name becomes a folder under runs/: one plain path component.
RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")
# A hub repository id: owner/name, each a plain name.
HUB_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


# Short names accepted in `plugins`, and the function each stands for.
BUILTIN_PLUGINS = {"liger": "ligertune.patching.liger:apply_liger"}
