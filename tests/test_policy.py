"""Strategies as pure decisions over snapshots: one test per decision and strategy, and the
config checks that guard each strategy's settings."""

import dataclasses
from pathlib import Path

import pytest

from corral.supervisor.config import ConfigError, parse_config
from corral.supervisor.policy import (
    FixedAppliance,
    Generic,
    KvCache,
    ModelView,
    MultiGroup,
    PinnedGroup,
    Snapshot,
    StrategyError,
    load_strategy,
)
from corral.supervisor.runtime import Runtime, build_runtime


def view(name, loaded=True, stoppable=True, last_used=0.0, ttl=300.0, size=0):
    return ModelView(name, loaded, stoppable, last_used, ttl, size_bytes=size)


def snap(views, max_loaded, now=0.0, groups=None, pinned=()):
    return Snapshot(tuple(views), groups or {}, max_loaded, now, frozenset(pinned))


# -- generic ---------------------------------------------------------------------------------

def test_fits_under_max_loaded():
    assert Generic().place(snap([view("a"), view("b", loaded=False)], 2), "b").fits


def test_evicts_least_recently_used_idle_model():
    views = [view("a", last_used=5), view("b", last_used=1), view("c", last_used=3)]
    assert Generic().place(snap(views, 3), "d").evict == "b"


def test_never_evicts_a_sibling_replica_to_start_a_replica():
    """Stopping r to start r#2 grows nothing: the idle x goes, though r was used longer ago."""
    views = [dataclasses.replace(view("r", last_used=1), model="r"),
             dataclasses.replace(view("x", last_used=5), model="x"),
             dataclasses.replace(view("r#2", loaded=False), model="r")]
    assert Generic().place(snap(views, 2), "r#2").evict == "x"
    blocked = Generic().place(snap([views[0], views[2]], 1), "r#2")
    assert not blocked.fits and blocked.evict is None


def test_never_evicts_busy_or_pinned_models():
    views = [view("a", last_used=1, stoppable=False), view("b", last_used=2),
             view("c", last_used=3)]
    assert Generic().place(snap(views, 3, pinned={"b"}), "d").evict == "c"
    blocked = Generic().place(snap(views[:2], 2, pinned={"b"}), "d")
    assert not blocked.fits and blocked.evict is None and blocked.blocked_by == ("a", "b")


def test_the_incoming_model_does_not_count_against_itself():
    assert Generic().place(snap([view("a"), view("b")], 2), "b").fits


def test_ttl_expiry_skips_busy_pinned_and_disabled():
    views = [view("idle", last_used=0, ttl=10), view("busy", stoppable=False, ttl=10),
             view("pinned", ttl=10), view("forever", ttl=0),
             view("fresh", last_used=8, ttl=10)]
    s = snap(views, 5, now=10, pinned={"pinned"})
    assert Generic().expired(s) == ["idle"]
    assert Generic().next_expiry(s) == 0.0
    assert Generic().next_expiry(snap(views[1:], 5, now=10, pinned={"pinned"})) == 8.0
    assert Generic().next_expiry(snap([view("forever", ttl=0)], 5, now=10)) is None


def test_generic_keeps_pinned_groups_and_loads_everything_on_demand():
    s = snap([view("a", loaded=False), view("b", loaded=False)], 2, pinned={"a"})
    assert Generic().keep_loaded(s) == {"a"}
    assert Generic().refuse(s, "b") is None
    assert Generic().kv_cache(s, "b") is None


def test_room_for_counts_kept_models():
    s = snap([view(n, loaded=False) for n in "abcd"], 3, pinned={"a"})
    assert Generic().room_for(s, frozenset("bc")) is None
    assert "max_loaded is 3" in Generic().room_for(s, frozenset("bcd"))


# -- pinned-group ------------------------------------------------------------------------------

GROUPS = {"council": ("a", "b", "c"), "core2": ("d", "e", "f")}


def test_pinned_group_keeps_its_groups_and_swaps_the_rest_in_what_is_left():
    strategy = PinnedGroup({"groups": ["council"]})
    views = [view("a", last_used=0), view("b", last_used=0), view("c", last_used=0),
             view("x", last_used=5), view("y", loaded=False)]
    s = snap(views, 4, groups=GROUPS)
    assert strategy.keep_loaded(s) == {"a", "b", "c"}
    # The council members are the least recently used, yet only x may make room.
    assert strategy.place(s, "y").evict == "x"
    assert strategy.expired(snap(views, 4, now=1000, groups=GROUPS)) == ["x"]


# -- multi-group -------------------------------------------------------------------------------

def test_multi_group_loads_within_each_groups_share_and_never_evicts_another_group():
    strategy = MultiGroup({"shares": {"council": 2, "core2": 2}})
    views = [view("a", last_used=9), view("b", last_used=1),
             view("d", last_used=0), view("e", last_used=0),  # older, but another group's
             view("c", loaded=False)]
    s = snap(views, 4, groups=GROUPS)
    assert strategy.place(s, "c").evict == "b"  # council's share is full: its own LRU
    # A share smaller than its group swaps; one as big as its group keeps every member up.
    assert strategy.keep_loaded(s) == frozenset()
    assert MultiGroup({"shares": {"council": 3}}).keep_loaded(s) == {"a", "b", "c"}


def test_multi_group_gives_models_in_no_group_what_the_shares_leave():
    strategy = MultiGroup({"shares": {"council": 2, "core2": 2}})
    s = snap([view("z", loaded=False)], 5, groups=GROUPS)
    assert strategy.refuse(s, "z") is None and strategy.place(s, "z").fits
    full = snap([view("z", loaded=False)], 4, groups=GROUPS)
    assert "holds 0" in strategy.refuse(full, "z")


def test_multi_group_room_for_a_group_is_its_share():
    strategy = MultiGroup({"shares": {"council": 2, "core2": 2}})
    s = snap([view(n, loaded=False) for n in "abcdef"], 4, groups=GROUPS)
    assert strategy.room_for(s, frozenset("ab")) is None
    assert "in pool council" in strategy.room_for(s, frozenset("abc"))


# -- fixed-appliance ---------------------------------------------------------------------------

def test_fixed_appliance_keeps_its_set_refuses_the_rest_and_never_expires():
    strategy = FixedAppliance({"models": ["a", "b"]})
    views = [view("a", last_used=0, ttl=1), view("b", last_used=0, ttl=1),
             view("c", loaded=False)]
    s = snap(views, 3, now=1000)
    assert strategy.keep_loaded(s) == {"a", "b"}
    assert strategy.refuse(s, "a") is None
    assert "fixed set of models (a, b)" in strategy.refuse(s, "c")
    assert strategy.expired(s) == [] and strategy.next_expiry(s) is None


def test_fixed_appliance_defaults_to_every_model():
    s = snap([view("a", loaded=False), view("b", loaded=False)], 2)
    assert FixedAppliance({}).keep_loaded(s) == {"a", "b"}


# -- plugins -----------------------------------------------------------------------------------

CONTRIB = Path(__file__).resolve().parent.parent / "presets" / "contrib"


def test_the_contrib_plugin_evicts_the_biggest_idle_model_and_quantizes_big_kv_caches():
    strategy = load_strategy("plugin:biggest_first.py:BiggestFirst",
                             {"big_model_bytes": 1000, "kv_cache_type": "q8_0"}, CONTRIB)
    views = [view("small", last_used=0, size=10), view("big", last_used=9, size=5000),
             view("new", loaded=False, size=2000)]
    s = snap(views, 2)
    assert strategy.place(s, "new").evict == "big"  # LRU would have said "small"
    assert strategy.kv_cache(s, "new") == KvCache("q8_0", "q8_0")
    assert strategy.kv_cache(s, "small") is None


def test_plugins_load_by_module_path_and_entry_point_names_fail_clearly(tmp_path, monkeypatch):
    (tmp_path / "my_strategies.py").write_text(
        "from corral.supervisor.policy import BaseStrategy\n"
        "class Quiet(BaseStrategy):\n"
        "    name = 'quiet'\n"
        "    def refuse(self, snap, model):\n"
        "        return 'quiet hours'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    strategy = load_strategy("plugin:my_strategies:Quiet", {}, tmp_path)
    assert strategy.refuse(snap([], 1), "a") == "quiet hours"
    with pytest.raises(StrategyError, match="unknown strategy 'nope'"):
        load_strategy("nope", {}, tmp_path)
    with pytest.raises(StrategyError, match="has no attribute 'Missing'"):
        load_strategy("plugin:my_strategies:Missing", {}, tmp_path)
    with pytest.raises(StrategyError, match="does not exist"):
        load_strategy("plugin:absent.py:X", {}, tmp_path)
    (tmp_path / "not_one.py").write_text("class X:\n    def __init__(self, options): pass\n")
    with pytest.raises(StrategyError, match="lacks keep_loaded"):
        load_strategy("plugin:not_one.py:X", {}, tmp_path)


# -- config ----------------------------------------------------------------------------------

BASE = """
models:
  a: {model: /m/a.gguf}
  b: {model: /m/b.gguf}
  c: {model: /m/c.gguf}
  d: {model: /m/d.gguf}
groups:
  g1: {models: [a, b]}
  g2: {models: [c, d]}
"""


def config_error(text):
    with pytest.raises(ConfigError) as caught:
        build_runtime(parse_config(BASE + text))
    return str(caught.value)


def test_the_config_builds_each_strategy_and_what_it_keeps_loaded():
    def built(text: str) -> Runtime:
        return build_runtime(parse_config(BASE + text))

    assert built("").kept == frozenset()
    assert built("policy: {strategy: pinned-group, groups: [g1]}").kept == {"a", "b"}
    multi = built("policy: {strategy: multi-group, shares: {g1: 2, g2: 1}}")
    assert isinstance(multi.strategy, MultiGroup) and multi.kept == {"a", "b"}
    assert built("policy: {strategy: fixed-appliance, models: [a, c]}").kept == {"a", "c"}


def test_loading_a_config_imports_no_plugin_the_daemon_builds_them(tmp_path):
    """Config is data: a plugin strategy and GPU reader are named by the config, imported and
    built only by build_runtime (the daemon, `corral check`, a reload)."""
    marker = tmp_path / "imported"
    (tmp_path / "noisy.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('yes')\n"
        "from corral.supervisor.policy import Generic\n"
        "class Noisy(Generic):\n    pass\n")
    loaded = parse_config(BASE + f"policy: {{strategy: 'plugin:{tmp_path}/noisy.py:Noisy'}}\n"
                                 "memory: {gpu_reader: none}\n")
    assert not marker.exists()
    assert loaded.strategy.spec.endswith("noisy.py:Noisy")
    runtime = build_runtime(loaded)
    assert marker.exists() and type(runtime.strategy).__name__ == "Noisy"
    missing = parse_config(BASE + f"policy: {{strategy: 'plugin:{tmp_path}/gone.py:X'}}\n")
    with pytest.raises(ConfigError, match=r"policy\.strategy"):
        build_runtime(missing)


def test_strategy_settings_are_checked_with_the_line_they_are_on():
    assert "policy.groups[0]: unknown group 'g9'" in config_error(
        "policy: {strategy: pinned-group, groups: [g9]}")
    assert "policy.shares applies to strategy multi-group" in config_error(
        "policy: {shares: {g1: 1}}")
    assert "shares add up to 5 but max_loaded is 4" in config_error(
        "policy: {strategy: multi-group, shares: {g1: 2, g2: 3}}")
    assert "unknown model 'zz'" in config_error(
        "policy: {strategy: fixed-appliance, models: [zz]}")
    assert "keeps 4 models loaded" in config_error(
        "policy: {strategy: fixed-appliance, max_loaded: 3}")
    assert "unknown strategy 'lru-plus'" in config_error("policy: {strategy: lru-plus}")
    assert "policy.options is read by plugin strategies only" in config_error(
        "policy: {options: {x: 1}}")
    message = config_error("policy:\n  strategy: multi-group\n  shares: {g1: 1, g3: 1}\n")
    assert "<config>:12: policy.shares.g3: unknown group 'g3'" in message


def test_a_replica_is_placed_in_its_models_pool_and_kept_with_it():
    views = [ModelView("a", True, True, 0.0, 300.0, model="a"),
             ModelView("a#2", True, True, 1.0, 300.0, model="a"),
             ModelView("c", True, True, 0.5, 300.0, model="c"),
             ModelView("a#3", False, False, 0.0, 300.0, model="a")]
    groups = {"g": ("a", "b", "x")}  # bigger than its share: members swap inside it
    multi = MultiGroup({"shares": {"g": 2}})
    s = Snapshot(tuple(views), groups, 3, 0.0)
    # a#3 belongs to group g's share (2, full with a and a#2): never room taken from c, and
    # never a sibling stopped for it (the model would not grow): it waits for the share.
    placed = multi.place(s, "a#3")
    assert not placed.fits and placed.evict is None and "c" not in placed.blocked_by
    pinned = Snapshot(tuple(views), groups, 3, 1000.0, frozenset({"a"}))
    assert Generic().kept_views(pinned) == {"a", "a#2", "a#3"}
    assert Generic().expired(pinned) == ["c"]


def test_a_strategy_named_by_an_entry_point_loads(tmp_path, monkeypatch):
    # An installed distribution that declares an entry point in the group corral.strategies.
    (tmp_path / "night_shift.py").write_text(
        "from corral.supervisor.policy import BaseStrategy\n"
        "class NightShift(BaseStrategy):\n"
        "    name = 'night-shift'\n"
        "    def refuse(self, snap, model):\n"
        "        return None if model == 'small' else 'only small at night'\n")
    dist = tmp_path / "night_shift-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: night-shift\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[corral.strategies]\nnight-shift = night_shift:NightShift\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    strategy = load_strategy("night-shift", {}, tmp_path)
    assert strategy.refuse(snap([], 1), "big") == "only small at night"
    assert strategy.refuse(snap([], 1), "small") is None
