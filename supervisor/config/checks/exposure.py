"""Whether a config would leave /admin open to the network, and the refusal that says so."""

from __future__ import annotations

import ipaddress

from corral.supervisor.config.schema import Config, split_listen

__all__ = ["admin_exposure_problem", "admin_is_exposed"]


def admin_is_exposed(config: Config, listen: str) -> bool:
    """Whether /admin answers without a key to anyone who can reach `listen`."""
    # Admin falls back to the API keys, and is open when there are neither (proxy/app.py).
    return not (config.admin_api_keys or config.api_keys) and not _is_loopback(listen)


def admin_exposure_problem(config: Config, listen: str) -> str | None:
    """Why corral must not serve `config` on `listen`, or None. Open admin endpoints (load,
    unload, logs) on a network address, or to every web page, are an accident far more often
    than a choice, so the choice has to be spelled out as `admin_open: true`."""
    if config.admin_open:
        return None
    if "*" in config.allowed_origins and not (config.admin_api_keys or config.api_keys):
        return ("allowed_origins: ['*'] with no api_keys or admin_api_keys lets every web page "
                "the user opens load, unload and pull models through corral; set "
                "admin_api_keys (or api_keys), list the web app's own origin, or set "
                "admin_open: true to allow it")
    if not admin_is_exposed(config, listen):
        return None
    return (f"listening on {listen} (not loopback) with no api_keys or admin_api_keys would "
            "leave /admin (load, unload, logs) open to the network; set admin_api_keys "
            "(or api_keys), listen on 127.0.0.1, or set admin_open: true to allow it")


def _is_loopback(listen: str) -> bool:
    host, _ = split_listen(listen)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other name may resolve to anything: treat it as the network
