"""``trainguard report RUN_DIR``: print the report (text or JSON) and write the timeline picture."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from .build import build_report
from .load import ReportError, describe_skipped, read_event_lines
from .plot import render_png
from .text import render_text

PNG_NAME = "report.png"


def main(run_dir: Path, as_json: bool = False, png: Optional[Path] = None) -> int:
    """Report on ``run_dir``: the text report (or ``json.dumps(report, indent=1)`` with ``as_json``)
    on stdout, the picture at ``png`` (default ``RUN_DIR/report.png``), warnings on stderr.

    Returns 0; 2 with ``trainguard: error: ...`` on stderr when the run cannot be reported on (no
    run directory, no readable ``events.jsonl``, no events, an explicit ``png`` that cannot be
    written or drawn because matplotlib is missing). A default picture that cannot be written or
    drawn (no matplotlib: the ``trainguard[report]`` extra) is a warning only.
    """
    run_dir = Path(run_dir)
    try:
        events, bad = read_event_lines(run_dir)
        if bad:
            print(f"trainguard: warning: {describe_skipped(bad)}", file=sys.stderr)
        try:
            report = build_report(events)
        except ReportError as e:
            raise ReportError(f"{run_dir / 'events.jsonl'}: {e}") from None
        report["malformed_lines"] = len(bad)
        target = Path(png) if png is not None else run_dir / PNG_NAME
        try:
            render_png(events, report, target)
        except ReportError as e:  # matplotlib (the trainguard[report] extra) is not installed
            if png is not None:
                raise
            print(f"trainguard: warning: {e}", file=sys.stderr)
        except (OSError, ValueError) as e:
            message = f"cannot write the picture {target}: {getattr(e, 'strerror', None) or e}"
            if png is not None:
                raise ReportError(message) from None
            print(f"trainguard: warning: {message}", file=sys.stderr)
        if as_json:
            print(json.dumps(report, indent=1))
        else:
            print(render_text(report), end="")
            print(f"Picture: {target}" if target.exists() else "Picture: not written")
    except ReportError as e:
        print(f"trainguard: error: {e}", file=sys.stderr)
        return 2
    return 0
