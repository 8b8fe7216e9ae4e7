"""An example strategy plugin: when room is needed, stop the biggest idle model (it frees the
most memory) instead of the least recently used one, and start big models with a quantized KV
cache (V quantized, K f16 unless told) so they fit beside the others.

Use it from a config (the path is relative to the config file):

    policy:
      strategy: plugin:contrib/biggest_first.py:BiggestFirst
      options: {big_model_bytes: 4000000000, cache_type_k: f16, cache_type_v: q8_0}

A strategy subclasses BaseStrategy and overrides the decisions it changes; each gets a Snapshot
(every model's view, the groups, max_loaded, the time, these options) and must answer at once,
with no I/O: corral asks on its event loop.
"""

from __future__ import annotations

from corral.supervisor.policy import BaseStrategy, KvCache, Placement, Snapshot


class BiggestFirst(BaseStrategy):
    name = "biggest-first"

    def place(self, snap: Snapshot, incoming: str) -> Placement:
        answer = super().place(snap, incoming)
        if answer.evict is None:
            return answer
        kept = self.kept_views(snap)
        idle = [v for v in snap.loaded
                if v.stoppable and v.name != incoming and v.name not in kept]
        biggest = max(idle, key=lambda v: (v.size_bytes, -v.last_used))
        return Placement(fits=False, evict=biggest.name)

    def kv_cache(self, snap: Snapshot, model: str) -> KvCache | None:
        threshold = int(self.options.get("big_model_bytes", 4_000_000_000))
        # `kv_cache_type` sets both; `cache_type_k` / `cache_type_v` one each. K stays f16 by
        # default: a quantized K cache moves a small model's greedy answer with the CPU's
        # numerics (SmolLM2-135M with K q8_0 answered French nonsense on an AMD EPYC and
        # Paris on Intel); a quantized V cache saves as much and did not.
        both = self.options.get("kv_cache_type")
        type_k = str(self.options.get("cache_type_k", both or "f16"))
        type_v = str(self.options.get("cache_type_v", both or "q8_0"))
        view = snap.view(model)
        if view is None or view.size_bytes < threshold:
            return None
        return KvCache(type_k, type_v)
