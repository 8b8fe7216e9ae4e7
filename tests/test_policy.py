"""Pure policy decisions: LRU placement and TTL expiry over snapshots."""

from corral.supervisor.policy import ModelView, expired, next_expiry, place


def view(name, loaded=True, stoppable=True, last_used=0.0, ttl=300.0, pinned=False):
    return ModelView(name, loaded, stoppable, last_used, ttl, pinned)


def test_fits_under_max_loaded():
    assert place([view("a"), view("b", loaded=False)], "b", 2).fits


def test_evicts_least_recently_used_idle_model():
    views = [view("a", last_used=5), view("b", last_used=1), view("c", last_used=3)]
    assert place(views, "d", 3).evict == "b"


def test_never_evicts_busy_or_pinned_models():
    views = [view("a", last_used=1, stoppable=False), view("b", last_used=2, pinned=True),
             view("c", last_used=3)]
    assert place(views, "d", 3).evict == "c"
    blocked = place(views[:2], "d", 2)
    assert not blocked.fits and blocked.evict is None and blocked.blocked_by == ("a", "b")


def test_the_incoming_model_does_not_count_against_itself():
    assert place([view("a"), view("b")], "b", 2).fits


def test_ttl_expiry_skips_busy_pinned_and_disabled():
    views = [view("idle", last_used=0, ttl=10), view("busy", stoppable=False, ttl=10),
             view("pinned", pinned=True, ttl=10), view("forever", ttl=0),
             view("fresh", last_used=8, ttl=10)]
    assert expired(views, now=10) == ["idle"]
    assert next_expiry(views, now=10) == 0.0
    assert next_expiry(views[1:], now=10) == 8.0
    assert next_expiry([view("forever", ttl=0)], now=10) is None
