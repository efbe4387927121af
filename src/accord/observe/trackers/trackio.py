"""Trackio, local: its SQLite database in TRACKIO_DIR, else output.dir/trackio (`TRACKIO_DIR=... trackio
show` opens the dashboard). A Space or server only when the user sets TRACKIO_SPACE_ID or
TRACKIO_SERVER_URL, as trackio itself reads them. Project observe.project, else `accord`. A resumed
run continues its Trackio run (found by name, as trackio resumes)."""

from __future__ import annotations

import contextlib
import os
import sys

from accord.observe.trackers import Tracker, TrackerStart


class Trackio(Tracker):
    name = "trackio"

    def __init__(self, context: TrackerStart):
        # trackio reads TRACKIO_DIR once, when imported.
        os.environ.setdefault("TRACKIO_DIR", str((context.out_dir / "trackio").resolve()))
        import trackio

        self._trackio = trackio
        with _to_stderr():  # trackio prints its messages on stdout, which accord keeps empty
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
        with _to_stderr():
            self._run.log(final, step=int(final.get("final/step", 0)))
            self._run.finish()


def _to_stderr():
    return contextlib.redirect_stdout(sys.stderr)


def start(context: TrackerStart) -> Trackio:
    return Trackio(context)
