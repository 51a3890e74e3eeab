"""Print the commands of README.md's "Start here" block, one per line, as a user would type them.

CI's main job (`.ci/run`) runs exactly these, so what README tells a new user to run is what CI
tests: a change to the block changes CI, and a block CI cannot run fails CI.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def start_here_commands(text: str) -> list[str]:
    """The non-comment lines of the first ```bash block after the "## Start here" heading."""
    section = text.split("## Start here", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    if block is None:
        raise SystemExit("README.md: no ```bash block under '## Start here'")
    return [
        line.strip()
        for line in block.group(1).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


if __name__ == "__main__":
    commands = start_here_commands(README.read_text(encoding="utf-8"))
    if len(sys.argv) > 1:  # the n-th command only (1-based), for CI's log
        commands = [commands[int(sys.argv[1]) - 1]]
    print("\n".join(commands))
