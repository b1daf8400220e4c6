"""`python -m corral_cli.chartgen [--check] [--root DIR]`: regenerate the chart's derived files and
the docs' generated tables."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from corral_cli.chartgen.files import generated_files, stale_files

log = logging.getLogger("corral_cli.chartgen")
DEFAULT_ROOT = Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corral_cli.chartgen", description=__doc__)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="repository root")
    parser.add_argument("--check", action="store_true", help="only report files that are out of date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        stale = stale_files(args.root)
        for path in stale:
            log.error("out of date: %s", path)
        return 1 if stale else 0
    for rel, text in generated_files(args.root).items():
        path = args.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            log.info("wrote %s", rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
