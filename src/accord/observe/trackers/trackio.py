"""Trackio, local: its SQLite database in TRACKIO_DIR, else output.dir/trackio (`TRACKIO_DIR=... trackio
show` opens the dashboard). A Space or server only when the user sets TRACKIO_SPACE_ID or
TRACKIO_SERVER_URL, as trackio itself reads them. Project observe.project, else `accord`. A resumed
run continues its Trackio run (found by name, as trackio resumes)."""

from __future__ import annotations

import contextlib
import io
import os
import sys

from accord.observe.trackers import Tracker, TrackerStart


class Trackio(Tracker):
    name = "trackio"

    def __init__(self, context: TrackerStart):
        # trackio reads TRACKIO_DIR once, when imported.
        os.environ.setdefault("TRACKIO_DIR", str((context.out_dir / "trackio").resolve()))
        import trackio

        self._remote = bool(os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL"))
        with self._prints():
            self._run = trackio.init(
                project=context.project or "accord",
                name=context.run_name,
                config=context.config,
                resume="allow" if context.resume_id else "never",
                embed=False,
            )
        self.run_id = self._run.id

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def finish(self, final: dict[str, float], status: str) -> None:
        with self._prints():
            self._run.log(final, step=int(final.get("final/step", 0)))
            self._run.finish()

    def _prints(self):
        """trackio prints on stdout, which accord keeps empty. Local, what it says (where its
        data is, `trackio show` without the TRACKIO_DIR it needs) is left out: the run's last
        line says where; a Space's or server's address goes to stderr. Its warnings are warnings."""
        return contextlib.redirect_stdout(sys.stderr if self._remote else io.StringIO())


def start(context: TrackerStart) -> Trackio:
    return Trackio(context)
