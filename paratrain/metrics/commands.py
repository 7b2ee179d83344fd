"""``paratrain plot RUN_DIR [RUN_DIR ...] [--out DIR]`` and ``paratrain summary RUN_DIR`` (see ``report``)."""
from __future__ import annotations

from pathlib import Path


def cmd_plot(args) -> int:
    from paratrain.metrics.report import plot

    for path in plot([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None):
        print(path)
    return 0


def cmd_summary(args) -> int:
    from paratrain.metrics.report import summary

    summary(Path(args.run_dir))
    return 0


def register(sub) -> None:
    """Add ``plot`` and ``summary`` to the ``paratrain`` subcommands."""
    plot_parser = sub.add_parser("plot", help="PNG figures (loss, throughput, time breakdown) of one or more runs")
    plot_parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot_parser.add_argument("--out", help="folder for the PNGs (default: the first RUN_DIR)")
    plot_parser.set_defaults(func=cmd_plot)
    summary_parser = sub.add_parser("summary", help="a table of one run's metrics")
    summary_parser.add_argument("run_dir", metavar="RUN_DIR")
    summary_parser.set_defaults(func=cmd_summary)
