"""Relay workers: processes that serve requests beside the daemon on its port (`relay_workers`).

The daemon keeps every decision (leases, the queue, starts, evictions, the prompt cache's
slots, the books); a worker holds a snapshot of what routing reads and asks the daemon for
each lease over a Unix socket (proxy/workers/hub.py is the daemon's end, remote.py the
worker's). What a worker does not serve itself it forwards to the daemon (forward.py).
docs/performance.md, "Using more than one core", says why and what it costs.
"""
