"""``python -m mlxcel.native [--force]``: build or rebuild the extension and say what happened.

Exits 0 when the module is current (built now or before), 1 when it could not be built.
"""

from __future__ import annotations

import sys

from mlxcel.native.build import build


def main(argv: list[str]) -> int:
    result = build(force="--force" in argv)
    print(f"mlxcel.native: {result.message}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
