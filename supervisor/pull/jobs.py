"""Pulls the daemon runs (POST /admin/pull): each a task it owns, with its state for
GET /admin/pulls and its progress as `pull` events."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from corral.supervisor.events import EventBus
from corral.supervisor.pull.download import pull
from corral.supervisor.pull.source import (
    ModelExists,
    NoModelsDir,
    PullError,
    PullRunning,
    Source,
    TooManyPulls,
    check_sha256,
    models_dir_of,
    resolve_source,
)

if TYPE_CHECKING:
    from corral.supervisor.config import LoadedConfig

log = structlog.get_logger("corral.pull")

PULL_STATES = ("running", "done", "failed", "cancelled")
_KEEP_FINISHED = 50
# Pulls that run at once: each holds a connection, a writer thread and a file open, and they
# share one link; a client looping on POST /admin/pull gets 429s, not a thousand downloads.
MAX_RUNNING = 4


@dataclass(eq=False)
class PullJob:
    id: str
    source: str
    url: str
    file: str
    state: str = "running"
    downloaded: int = 0
    total: int | None = None
    speed: float = 0.0
    error: str | None = None
    sha256: str | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "url": self.url, "file": self.file,
                "state": self.state, "downloaded": self.downloaded, "total": self.total,
                "speed": round(self.speed), "error": self.error, "sha256": self.sha256,
                "started": self.started, "finished": self.finished}


class Puller:
    """The pulls a daemon runs: each one a task it owns (a client that hangs up does not stop
    it; DELETE /admin/pulls/{id} and shutdown do), its progress on the event bus as `pull`
    events: its start and end (kept for replay), and at most one a second while it runs
    (live only)."""

    def __init__(self, events: EventBus, loaded: Callable[[], LoadedConfig],
                 event_every: float = 1.0, max_running: int = MAX_RUNNING):
        self.events = events
        self.max_running = max_running
        self._loaded = loaded  # models_dir may change with a reload: read at each pull
        self._event_every = event_every
        self._jobs: dict[str, PullJob] = {}
        self._ids = itertools.count(1)

    def models_dir(self) -> Path | None:
        return models_dir_of(self._loaded())

    def start(self, spec: str, *, name: str | None = None, sha256: str | None = None,
              force: bool = False) -> PullJob:
        """Check the request and start the pull; raises BadSource, NoModelsDir, ModelExists,
        PullRunning or TooManyPulls before anything is downloaded."""
        source = resolve_source(spec, name)
        expected = check_sha256(sha256)
        folder = self.models_dir()
        if folder is None:
            raise NoModelsDir("the config sets no models_dir: nowhere to put the file "
                              "(set models_dir, or serve with --models-dir)")
        running = [j for j in self._jobs.values() if j.state == "running"]
        if any(j.file == source.filename for j in running):
            raise PullRunning(f"{source.filename} is being pulled already")
        if len(running) >= self.max_running:
            raise TooManyPulls(f"{len(running)} pulls are running, as many as run at once; "
                               "wait for one to finish (GET /admin/pulls) or cancel one")
        if (folder / source.filename).exists() and not force:
            raise ModelExists(f"{source.filename} exists in models_dir (force to replace it)")
        job = PullJob(f"pull-{next(self._ids)}", spec, source.url, source.filename)
        self._jobs[job.id] = job
        self._forget_old()
        job.task = asyncio.create_task(self._run(job, source, folder, expected, force),
                                       name=f"pull {source.filename}")
        self._publish(job)
        return job

    def jobs(self) -> list[PullJob]:
        return list(self._jobs.values())

    def get(self, pull_id: str) -> PullJob | None:
        return self._jobs.get(pull_id)

    def cancel(self, pull_id: str) -> PullJob | None:
        job = self._jobs.get(pull_id)
        if job is not None and job.task is not None and not job.task.done():
            job.task.cancel()
        return job

    async def wait(self, pull_id: str) -> PullJob | None:
        job = self._jobs.get(pull_id)
        if job is not None and job.task is not None:
            await asyncio.wait([job.task])
        return job

    async def close(self) -> None:
        """Cancel every running pull and wait for each to close its file (parts are kept)."""
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self, job: PullJob, source: Source, folder: Path, expected: str | None,
                   force: bool) -> None:
        last_event = 0.0

        def progress(downloaded: int, total: int | None, speed: float) -> None:
            nonlocal last_event
            job.downloaded, job.total, job.speed = downloaded, total, speed
            now = time.monotonic()
            if now - last_event >= self._event_every:
                last_event = now
                self._publish(job, history=False)

        try:
            result = await pull(source, folder, sha256=expected, force=force, progress=progress)
        except asyncio.CancelledError:
            job.state = "cancelled"
            log.info("pull.cancelled", file=job.file, id=job.id, downloaded=job.downloaded)
            raise
        except PullError as exc:
            job.state, job.error = "failed", str(exc)
            log.error("pull.failed", file=job.file, id=job.id, error=str(exc))
        except Exception as exc:  # a bug, or the disk: the pull fails, the daemon goes on
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("pull.failed", file=job.file, id=job.id)
        else:
            job.state, job.sha256 = "done", result.sha256
            job.downloaded = job.total = result.size
        finally:
            job.finished = time.time()
            job.speed = 0.0
            self._publish(job)

    def _publish(self, job: PullJob, history: bool = True) -> None:
        # Progress ticks are live only: a long download must not push the rarer events
        # (loads, reloads, this pull's start and end) out of what a reader can replay.
        self.events.publish("pull", history=history, id=job.id, file=job.file, state=job.state,
                            downloaded=job.downloaded, total=job.total, speed=round(job.speed),
                            error=job.error)

    def _forget_old(self) -> None:
        done = [j for j in self._jobs.values() if j.state != "running"]
        for job in done[:max(len(done) - _KEEP_FINISHED, 0)]:
            del self._jobs[job.id]
