"""`python -m bench.experiments NAME`: run one experiment (or `all`), write JSON + Markdown + PNG.

    .venv/bin/python -m bench.experiments rate-x-seqs          # ~4 min on 2 cores
    .venv/bin/python -m bench.experiments all --quick          # every experiment, tiny sizes
    .venv/bin/python -m bench.experiments render bench/results/experiments/policy/result.json

Results go to OUT/NAME/: result.json, table.md, experiments-NAME.png, and the engines' logs.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from bench.experiments import specs

log = logging.getLogger("experiments")
DEFAULT_OUT = Path("bench/results/experiments")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.experiments",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=(*specs.EXPERIMENTS, "all", "render"), help="experiment to run, or render")
    p.add_argument("result", nargs="?", type=Path, help="render: the result.json to draw and tabulate")
    p.add_argument("--quick", action="store_true", help="tiny sizes: each experiment in well under a minute")
    p.add_argument("--out", type=Path, help=f"results root (default: {DEFAULT_OUT}, or {DEFAULT_OUT}-quick)")
    p.add_argument(
        "--preset", choices=("tiny", "small"), default="tiny", help="demo model preset (default: tiny)"
    )
    p.add_argument(
        "--model", type=Path, help="model directory (default: OUT/model-PRESET, written if missing)"
    )
    p.add_argument(
        "--engine-rev",
        metavar="REV",
        help="run the engine code of this git revision (e.g. HEAD), unpacked aside, so edits to the "
        "working tree during a long run do not change it (default: the working tree)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logging only)")
    return p.parse_args(argv)


def _write_outputs(doc: dict, out_dir: Path) -> str:
    from corral_cli.bench.report import write_result_file

    from bench.experiments import plots, tables

    meta = {k: v for k, v in doc.items() if k != "runs"}
    write_result_file(out_dir / "result.json", meta, doc["runs"])
    text = tables.render(doc)
    (out_dir / "table.md").write_text(text + "\n", encoding="utf-8")
    png = out_dir / f"experiments-{doc['experiment']}.png"
    plots.plot(doc, png)
    log.info("wrote %s, table.md and %s", out_dir / "result.json", png.name)
    return text


def _render(path: Path) -> int:
    from bench.experiments import tables

    try:
        doc = tables.load_result(path)
    except (OSError, ValueError) as e:
        log.error("cannot read %s: %s", path, e)
        return 1
    sys.stdout.write(_write_outputs(doc, path.parent) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.name == "render":
        if args.result is None:
            log.error("render needs a result.json path")
            return 2
        return _render(args.result)
    # SIGTERM unwinds like Ctrl-C, so the engine processes of the current run are stopped; the
    # caller's handler comes back after (main runs inside pytest too, where ours outlived the test
    # and turned a later SIGTERM to pytest into a SystemExit failing whichever test was running).
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    from bench.experiments import source as engine_source
    from bench.experiments.execute import ensure_model, run_experiment

    root = args.out or (Path(f"{DEFAULT_OUT}-quick") if args.quick else DEFAULT_OUT)
    model_dir = ensure_model(args.model or root / f"model-{args.preset}", args.preset)
    try:
        source = (
            engine_source.from_revision(args.engine_rev, root)
            if args.engine_rev
            else engine_source.working_tree()
        )
    except ValueError as e:
        log.error("%s", e)
        return 1
    log.info("engine code: %s", source.description)
    names = specs.EXPERIMENTS if args.name == "all" else (args.name,)
    texts = []
    for name in names:
        out_dir = root / name
        out_dir.mkdir(parents=True, exist_ok=True)
        experiment = specs.build(name, args.quick)
        log.info("%s: %d runs -> %s", name, len(experiment.runs), out_dir)
        doc = run_experiment(
            experiment,
            model_dir,
            args.preset,
            out_dir,
            source=source,
            quick=args.quick,
            show_progress=not args.no_progress,
        )
        texts.append(_write_outputs(doc, out_dir))
    sys.stdout.write("\n\n".join(texts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
