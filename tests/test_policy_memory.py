"""Memory decisions as pure functions over snapshots: placement by bytes, budgets, watermarks,
KV modes (auto, adaptive down and back up). The same code runs in the daemon on measured
numbers (tests/test_memory.py)."""

from corral.supervisor.memory.view import MIB, DeviceView, MemoryView
from corral.supervisor.policy import FixedAppliance, Generic, KvCache, ModelView, Snapshot

LADDER = (KvCache("f16", "f16"), KvCache("q8_0", "q8_0"), KvCache("q4_0", "q4_0"))
# What each model takes per KV step, MiB on gpu0: weights + KV that halves per step.
SIZES = {name: (1000, 700, 550) for name in ("a", "b", "c", "k")}
SIZES["big"] = (6000, 5000, 4500)


def estimate(name: str, kv: KvCache | None) -> dict[str, int]:
    base = name.split("#")[0].removesuffix(" (new)")
    step = 0 if kv is None else next(i for i, s in enumerate(LADDER) if s == kv)
    return {"gpu0": SIZES[base][step] * MIB}


def view(name, mib=0, last_used=0.0, stoppable=True, loaded=True, **kv):
    return ModelView(name, loaded, stoppable, last_used, 300.0, ready=loaded,
                     footprint={"gpu0": mib * MIB} if loaded else {}, **kv)


def memory(total=8000, used=0, ours=0, budget=None, low=85, critical=95, calm=0.0, budgets=None):
    device = DeviceView("gpu0", "gpu", total * MIB, used * MIB, ours * MIB, 0,
                        budget * MIB if budget else None)
    return MemoryView({"gpu0": device}, low, critical,
                      {g: mb * MIB for g, mb in (budgets or {}).items()}, calm)


def snap(views, mem, max_loaded=8, groups=None, pinned=()):
    return Snapshot(tuple(views), groups or {}, max_loaded, 100.0, frozenset(pinned),
                    memory=mem, estimate=estimate)


def test_a_load_that_fits_in_bytes_starts():
    assert Generic().place(snap([view("a", 1000)], memory(budget=2500)), "b").fits


def test_a_load_that_does_not_fit_evicts_the_least_recently_used_idle_model():
    views = [view("a", 1000, last_used=5), view("b", 1000, last_used=1)]
    placement = Generic().place(snap(views, memory(budget=2500)), "c")
    assert not placement.fits and placement.evict == "b"  # max_loaded 8 would allow it


def test_never_evicts_a_model_with_work_in_flight_and_says_what_is_missing():
    views = [view("a", 1000, stoppable=False), view("b", 1000, stoppable=False)]
    placement = Generic().place(snap(views, memory(budget=2500)), "c")
    assert not placement.fits and placement.evict is None and placement.retry
    assert placement.blocked_by == ("a", "b")
    assert "c needs 1000 MiB on gpu0 where the shared budget has 500 MiB free (500 MiB " \
        "missing)" in placement.reason
    assert "a (1000 MiB, busy)" in placement.reason


def test_a_model_bigger_than_the_budget_is_refused_at_once():
    placement = Generic().place(snap([], memory(budget=4000)), "big")
    assert not placement.fits and not placement.retry
    assert "big needs 6000 MiB on gpu0" in placement.reason
    assert "budget 4000 MiB" in placement.reason


def test_what_other_processes_use_the_reserve_and_the_low_watermark_shrink_the_room():
    mem = MemoryView({"gpu0": DeviceView("gpu0", "gpu", 8000 * MIB, 5000 * MIB, 1000 * MIB,
                                         512 * MIB, None)}, 85, 95)
    # Others use 4000. Hard room: 8000 - 512 - 4000 = 3488 MiB; new loads stop at the low
    # watermark, 6800 - 4000 = 2800 MiB, so the watermark does not evict what just loaded.
    assert Generic().place(snap([view("a", 1000)], mem), "b").fits
    views = [view("a", 1000, last_used=1), view("b", 1000, last_used=5)]
    assert Generic().place(snap(views, mem), "c").evict == "a"
    # A restart at another KV step is not a new load: it may use the hard room.
    views = [view("a", 1000, last_used=1), view("b", 1000, last_used=5),
             view("c", loaded=False, kv_changing=True)]
    assert Generic().place(snap(views, mem), "c").fits


def test_critical_watermark_refuses_new_loads_but_not_a_kv_restart():
    placement = Generic().place(snap([], memory(used=7700)), "a")
    assert not placement.fits and not placement.retry and "critical" in placement.reason
    restart = view("a", loaded=False, kv_ladder=LADDER, kv_adaptive=True, kv_level=1,
                   kv_changing=True)
    # (Others hold 700 of the 7700: corral's own children the rest.)
    assert Generic().place(snap([restart], memory(used=7700, ours=7000)), "a").fits


def test_group_budgets_carve_the_gpus_not_ram_on_a_gpu_box():
    mem = MemoryView({
        "gpu0": DeviceView("gpu0", "gpu", 8000 * MIB, 0, 0, 0, None),
        "cpu": DeviceView("cpu", "cpu", 16000 * MIB, 0, 0, 0, None)}, 85, 95,
        {"core": 6000 * MIB})
    assert mem.pool_capacity(mem.devices["gpu0"], None) == 800 * MIB  # 6800 - 6000
    assert mem.pool_capacity(mem.devices["cpu"], None) == 13600 * MIB  # untouched
    assert mem.pool_capacity(mem.devices["cpu"], "core") == 13600 * MIB


def test_group_budget_is_only_for_its_members_and_nobody_takes_it():
    groups = {"core": ("a", "b")}
    mem = memory(budget=4000, budgets={"core": 2000})
    # c lives in what the groups leave: 2000; core members in their 2000.
    views = [view("a", 1000), view("b", 1000), view("c", 1000, last_used=1)]
    placement = Generic().place(snap(views, mem, groups=groups), "big")
    assert not placement.fits and not placement.retry  # 6000 > the 2000 left over
    assert Generic().place(snap(views, mem, groups=groups), "a").fits
    # An outsider that does not fit in what is left evicts an outsider, never a core member
    # (both idle, and used longer ago).
    views = [view("a", 1000, last_used=0), view("b", 1000, last_used=0),
             view("c", 1000, last_used=5), view("x", 1000, last_used=9)]
    SIZES["x"] = SIZES["d"] = (1000, 700, 550)
    placement = Generic().place(snap(views, mem, groups=groups), "d")
    assert placement.evict == "c"


def test_a_pending_load_shrinks_an_adaptive_models_kv_when_nothing_is_idle():
    views = [view("a", 1000, stoppable=False, kv_ladder=LADDER, kv_adaptive=True)]
    placement = Generic().place(snap(views, memory(budget=1800)), "b")
    assert placement.shrink == "a"  # 200 short; the step down frees 300
    # A step that frees less than is missing is a restart for nothing.
    placement = Generic().place(snap(views, memory(budget=1600)), "b")
    assert placement.shrink is None and not placement.fits
    # Once it is changing, it is not asked twice.
    views = [view("a", 1000, stoppable=False, kv_ladder=LADDER, kv_adaptive=True,
                  kv_changing=True)]
    assert Generic().place(snap(views, memory(budget=1800)), "b").shrink is None


def test_auto_picks_the_best_step_that_fits_the_budget():
    a = view("a", loaded=False, kv_ladder=LADDER, kv_auto=True)
    assert Generic().kv_cache(snap([a], memory(budget=1200)), "a") == KvCache("f16", "f16")
    assert Generic().kv_cache(snap([a], memory(budget=900)), "a") == KvCache("q8_0", "q8_0")
    assert Generic().kv_cache(snap([a], memory(budget=600)), "a") == KvCache("q4_0", "q4_0")
    assert Generic().kv_cache(snap([a], memory(budget=100)), "a") == KvCache("q4_0", "q4_0")
    # ... and placement counts it at that step.
    assert Generic().place(snap([a], memory(budget=900)), "a").fits


def test_auto_picks_the_step_that_fits_beside_a_pinned_model():
    # k is pinned and holds 700 of 1300: f16 (1000) and q8_0 (700) fit the budget but not
    # beside it, and placement may not evict it. auto starts a at q4_0 (550) instead of
    # picking f16 and being refused.
    k = view("k", 700, kv_ladder=LADDER)
    a = view("a", loaded=False, kv_ladder=LADDER, kv_auto=True)
    s = snap([k, a], memory(budget=1300), pinned=("k",))
    assert Generic().kv_cache(s, "a") == KvCache("q4_0", "q4_0")
    assert Generic().place(s, "a").fits
    # An idle model that is not kept is placement's to evict: auto keeps the best step.
    s = snap([view("k", 700), a], memory(budget=1300))
    assert Generic().kv_cache(s, "a") == KvCache("f16", "f16")
    assert Generic().place(s, "a").evict == "k"
    # Nothing fits beside the pinned one: the best step that fits the budget, as before
    # (placement then says what is in the way).
    s = snap([view("k", 1000), a], memory(budget=1300), pinned=("k",))
    assert Generic().kv_cache(s, "a") == KvCache("f16", "f16")
    # A model kept by the strategy itself counts the same.
    s = snap([k, a], memory(budget=1300))
    assert FixedAppliance({"models": ["k"]}).kv_cache(s, "a") == KvCache("q4_0", "q4_0")


def test_low_watermark_evicts_the_least_recently_used_idle_model_first():
    views = [view("a", 1000, last_used=3), view("b", 1000, last_used=1),
             view("k", 1000, stoppable=False, kv_ladder=LADDER, kv_adaptive=True)]
    reliefs = Generic().relieve(snap(views, memory(used=7000)))
    assert [(r.action, r.model) for r in reliefs] == [("evict", "b")]
    assert "low watermark" in reliefs[0].reason


def test_critical_watermark_evicts_as_many_idle_models_as_it_takes():
    views = [view("a", 1000, last_used=3), view("b", 1000, last_used=1), view("c", 1000, 5)]
    reliefs = Generic().relieve(snap(views, memory(used=7700)))  # 900 MiB over the low line
    assert [r.model for r in reliefs] == ["b"]
    reliefs = Generic().relieve(snap(views, memory(used=7900)))  # 1100 over: two go
    assert [r.model for r in reliefs] == ["b", "a"]


def test_kv_steps_count_from_the_step_auto_chose():
    # auto runs it at q8_0 (f16 does not fit 900): one step down is q4_0, not q8_0 again.
    k = view("k", 700, stoppable=False, kv_ladder=LADDER, kv_adaptive=True, kv_auto=True)
    reliefs = Generic().relieve(snap([k], memory(used=7000, ours=7000, budget=900)))
    assert [(r.action, r.level) for r in reliefs] == [("kv_down", 2)]


def test_pressure_with_nothing_idle_steps_an_adaptive_kv_cache_down():
    views = [view("k", 1000, stoppable=False, kv_ladder=LADDER, kv_adaptive=True)]
    reliefs = Generic().relieve(snap(views, memory(used=7000)))
    assert [(r.action, r.model, r.level) for r in reliefs] == [("kv_down", "k", 1)]
    # Kept models are never evicted, but their KV may shrink.
    views = [view("k", 1000, kv_ladder=LADDER, kv_adaptive=True)]
    reliefs = FixedAppliance({"models": ["k"]}).relieve(snap(views, memory(used=7000)))
    assert [(r.action, r.model) for r in reliefs] == [("kv_down", "k")]
    # Not adaptive: nothing to do.
    views = [view("k", 1000, stoppable=False, kv_ladder=LADDER)]
    assert Generic().relieve(snap(views, memory(used=7000))) == []


def test_steps_back_up_after_the_hold_and_only_if_it_stays_below_the_low_watermark():
    k = view("k", 700, stoppable=False, kv_ladder=LADDER, kv_adaptive=True, kv_level=1,
             kv_hold=30)
    assert Generic().relieve(snap([k], memory(used=3000, calm=10))) == []  # hold not over
    reliefs = Generic().relieve(snap([k], memory(used=3000, calm=31)))
    assert [(r.action, r.level) for r in reliefs] == [("kv_up", 0)]
    # +300 MiB would cross 85% of 8000 (6800): it stays down.
    assert Generic().relieve(snap([k], memory(used=6600, calm=31))) == []


def test_room_for_a_group_counts_memory():
    views = [view(n, loaded=False) for n in ("a", "b", "c")]
    assert Generic().room_for(snap(views, memory(budget=3500)), frozenset({"a", "b", "c"})) \
        is None
    problem = Generic().room_for(snap(views, memory(budget=2500)), frozenset({"a", "b", "c"}))
    assert problem and "3000 MiB on gpu0" in problem and "2500 MiB" in problem


def test_without_memory_nothing_changes():
    assert Generic().place(snap([view("a", 1000)], None), "b").fits
    assert Generic().relieve(snap([view("a", 1000)], None)) == []
