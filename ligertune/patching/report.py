"""`PatchReport`: what `patch_model` did to a model, per kernel, for the run log and for tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from ligertune.catalog.kernels import KERNEL_NAMES


@dataclass
class PatchReport:
    """What `patch_model` did, per kernel.

    ``patched[k]``: modules patched by this call (every kernel name is present, 0 when none).
    ``already_patched[k]``: modules found patched by an earlier call (left as they were).
    ``skipped[k]``: why kernel ``k`` was not applied, or which modules were not patched and why
    when it was applied to some. ``notes``: model-level remarks (an unknown family).
    """

    model_class: str
    model_type: str | None
    known_family: bool
    patched: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KERNEL_NAMES, 0))
    already_patched: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.patched.values())

    def __str__(self) -> str:
        family = self.model_type if self.known_family else f"{self.model_type} (not in the family table)"
        lines = [f"kernel patching: {self.model_class}, family {family}"]
        lines += [f"  note: {note}" for note in self.notes]
        width = max(map(len, KERNEL_NAMES))
        for kernel in KERNEL_NAMES:
            parts = []
            if self.patched[kernel]:
                parts.append(plural(self.patched[kernel], "module") + " patched")
            if self.already_patched.get(kernel):
                parts.append(plural(self.already_patched[kernel], "module") + " already patched")
            if kernel in self.skipped:
                parts.append(("not patched: " if not parts else "") + self.skipped[kernel])
            lines.append(f"  {kernel:<{width}}  {'; '.join(parts)}")
        return "\n".join(lines)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
