"""Autoscaling decisions on synthetic metric series: up on a deep queue, hold, down, to zero, back."""

from __future__ import annotations

from dataclasses import replace

from corral_operator.autoscaler import Load, Policy, State, decide, recommend

POLICY = Policy(
    min_replicas=1,
    max_replicas=8,
    target_waiting_per_replica=4,
    target_kv_usage_ratio=0.8,
    scale_up_window_s=30,
    scale_down_window_s=120,
    idle_to_zero_s=300,
)


def busy(waiting: float, kv: float, replicas: int) -> Load:
    return Load(num_waiting=waiting, num_running=4 * replicas, kv_usage_ratio=kv, num_reporting=replicas)


IDLE = Load(num_waiting=0, num_running=0, kv_usage_ratio=0.0, num_reporting=1)


def run(policy: Policy, series: list[tuple[float, Load | None]], replicas: int, state: State | None = None):
    """Feed (time, load) samples; return the replica count after each tick, and the final state."""
    state = state or State()
    out = []
    for now_s, load in series:
        decision = decide(policy, state, replicas, load, now_s)
        state, replicas = decision.state, decision.replicas
        out.append(replicas)
    return out, state


def test_recommendation_follows_queue_and_kv() -> None:
    assert recommend(POLICY, 2, busy(waiting=40, kv=0.5, replicas=2)) == 10
    assert recommend(POLICY, 2, busy(waiting=0, kv=0.95, replicas=2)) == 3
    assert recommend(POLICY, 4, busy(waiting=0, kv=0.1, replicas=4)) == 1
    assert recommend(POLICY, 3, busy(waiting=0, kv=0.78, replicas=3)) == 3  # within tolerance


def test_deep_queue_scales_up_immediately_without_an_up_window() -> None:
    policy = Policy(1, 8, 4, 0.8, 0, 120, 300)
    replicas, _ = run(policy, [(0, busy(40, 0.9, 2))], replicas=2)
    assert replicas == [8]  # 40 waiting / 4 per replica = 10, capped at max 8


def test_scale_up_waits_for_the_load_to_last_the_up_window() -> None:
    quiet = [(t, busy(0, 0.5, 2)) for t in (0, 10, 20)]
    spike = [(t, busy(40, 0.9, 2)) for t in (30, 40, 50, 60)]
    replicas, _ = run(POLICY, quiet + spike, replicas=2)
    # the quiet samples (t <= 20) stay in the 30 s up window until t = 60
    assert replicas[:6] == [2, 2, 2, 2, 2, 2]
    assert replicas[6] == 8


def test_scale_down_holds_within_the_down_window_then_drops() -> None:
    high = [(t, busy(20, 0.9, 4)) for t in (0, 10)]
    low = [(t, busy(0, 0.1, 4)) for t in range(20, 160, 10)]
    replicas, _ = run(POLICY, high + low, replicas=4)
    assert replicas[0] >= 4
    # held while a high recommendation remains in the 120 s window (until t = 130)
    assert all(r >= 4 for r in replicas[: 2 + 11])
    assert replicas[-1] == 1


def test_bounds_hold() -> None:
    replicas, _ = run(POLICY, [(0, busy(0, 0.0, 9))], replicas=9)
    assert replicas == [8]  # above max: pulled back in
    policy = Policy(2, 8, 4, 0.8, 0, 0, 300)
    replicas, _ = run(policy, [(0, IDLE)], replicas=3)
    assert replicas == [2]  # never below min


def test_a_fresh_autoscaler_waits_a_full_down_window_before_shrinking() -> None:
    low = [(float(t), busy(0, 0.1, 4)) for t in range(0, 130, 10)]
    replicas, _ = run(POLICY, low, replicas=4)
    assert replicas[:12] == [4] * 12  # t < 120: the unknown past counts as "4 were needed"
    assert replicas[-1] == 1


def test_replicas_that_do_not_report_count_as_loaded_on_the_way_down() -> None:
    # 4 replicas each at the targets (4 waiting, 80% KV); 3 too busy to answer the scrape in time
    one_answers = Load(num_waiting=4, num_running=4, kv_usage_ratio=0.8, num_reporting=1, num_unreported=3)
    assert recommend(POLICY, 4, one_answers) == 4
    replicas, _ = run(POLICY, [(float(t), one_answers) for t in range(0, 400, 10)], replicas=4)
    assert set(replicas) == {4}
    # a silent replica may be busy: the reporting ones being idle is no reason to go to zero
    policy = Policy(0, 4, 4, 0.8, 0, 0, 60)
    quiet = Load(num_waiting=0, num_running=0, kv_usage_ratio=0.0, num_reporting=1, num_unreported=1)
    replicas, _ = run(policy, [(float(t), quiet) for t in range(0, 400, 10)], replicas=2)
    assert 0 not in replicas
    # ... but they count as idle on the way up (the load seen is enough to scale up on)
    deep = Load(num_waiting=40, num_running=4, kv_usage_ratio=0.9, num_reporting=1, num_unreported=1)
    assert recommend(POLICY, 2, deep) == 10


def test_no_metrics_holds_the_current_size() -> None:
    replicas, _ = run(POLICY, [(0, None), (100, None)], replicas=3)
    assert replicas == [3, 3]


def test_scale_to_zero_after_idle_time_and_back_on_wake() -> None:
    policy = Policy(0, 4, 4, 0.8, 0, 60, 300)
    series = [(0.0, busy(2, 0.5, 1))] + [(float(t), IDLE) for t in range(30, 301, 30)]
    replicas, state = run(policy, series, replicas=1)
    assert replicas[:-1] == [1] * (len(series) - 1)  # idle for less than 300 s: stays
    assert replicas[-1] == 0  # idle since t = 0 for 300 s
    # at zero nothing happens without a wake request, whatever the time
    assert decide(policy, state, 0, None, now_s=1000).replicas == 0
    # a wake request older than the scale-down is ignored; a newer one brings one replica back
    assert decide(policy, state, 0, None, now_s=1000, wake_at_s=100).replicas == 0
    woken = decide(policy, state, 0, None, now_s=1000, wake_at_s=999)
    assert woken.replicas == 1
    # ... and the woken replica gets a full idle period before it may go back to zero
    later = decide(policy, woken.state, 1, IDLE, now_s=1200)
    assert later.replicas == 1
    assert decide(policy, later.state, 1, IDLE, now_s=1301).replicas == 0


def test_requests_finished_between_scrapes_count_as_activity() -> None:
    # a request every 240 s, each over before the next scrape: the gauges always read zero
    policy = Policy(0, 4, 4, 0.8, 0, 60, 300)
    series = [(float(t), replace(IDLE, num_finished=float(t // 240))) for t in range(0, 1200, 15)]
    replicas, _ = run(policy, series, replicas=1)
    assert set(replicas) == {1}
    # once they stop (the last one seen at t = 960), the idle time runs from there
    quiet = [(float(t), replace(IDLE, num_finished=4.0)) for t in range(1200, 1600, 15)]
    replicas, _ = run(policy, series + quiet, replicas=1)
    times = [t for t, _ in series + quiet]
    assert times[replicas.index(0)] == 1260.0


def test_scaled_up_from_zero_by_someone_else_counts_as_activity() -> None:
    policy = Policy(0, 4, 4, 0.8, 0, 60, 300)
    state = State(last_active_s=0, zeroed_at_s=400, last_replicas=0)
    # e.g. `kubectl scale --replicas 1` or the gateway patching the scale subresource
    assert decide(policy, state, 1, IDLE, now_s=1000).replicas == 1


def test_scaled_to_zero_by_someone_else_stays_asleep_until_a_newer_wake() -> None:
    policy = Policy(0, 4, 4, 0.8, 0, 60, 300)
    woken = decide(policy, State(zeroed_at_s=100, last_replicas=0), 0, None, now_s=500, wake_at_s=499)
    assert woken.replicas == 1
    awake = decide(policy, woken.state, 1, IDLE, now_s=520).state
    # `kubectl scale --replicas 0` at t = 600; the wake annotation still says 499
    asleep = decide(policy, awake, 0, None, now_s=600, wake_at_s=499)
    assert (asleep.replicas, asleep.state.zeroed_at_s) == (0, 600)
    assert decide(policy, asleep.state, 0, None, now_s=610, wake_at_s=499).replicas == 0
    assert decide(policy, asleep.state, 0, None, now_s=700, wake_at_s=650).replicas == 1


def test_a_wake_already_served_does_not_wake_again_after_a_zero_in_its_second() -> None:
    # woken by a stamp of t = 500 (1 s resolution), up and scaled to zero by hand, all in that second
    policy = Policy(0, 4, 4, 0.8, 0, 60, 300)
    woken = decide(policy, State(zeroed_at_s=100, last_replicas=0), 0, None, now_s=500.1, wake_at_s=500)
    awake = decide(policy, woken.state, 1, IDLE, now_s=500.5).state
    asleep = decide(policy, awake, 0, None, now_s=500.9, wake_at_s=500)
    assert asleep.replicas == 0
    assert decide(policy, asleep.state, 0, None, now_s=505, wake_at_s=500).replicas == 0
    # the gateway's next stamp for a request still waiting wakes it
    assert decide(policy, asleep.state, 0, None, now_s=511, wake_at_s=510).replicas == 1


def test_min_replicas_above_zero_lifts_from_zero() -> None:
    assert decide(POLICY, State(), 0, None, now_s=0).replicas == 1


def test_a_wake_stamped_in_the_second_of_the_scale_down_counts() -> None:
    policy = Policy(0, 4, 4, 0.8, 0, 60, 300)
    asleep = State(zeroed_at_s=1000.7, last_replicas=0)
    assert decide(policy, asleep, 0, None, now_s=1001, wake_at_s=1000.0).replicas == 1
    assert decide(policy, asleep, 0, None, now_s=1001, wake_at_s=999.0).replicas == 0


def test_a_size_outside_the_bounds_is_brought_in_and_the_reason_says_so() -> None:
    policy = Policy(1, 2, 4, 0.8, 0, 300, 300)
    held = decide(policy, State(), 8, None, now_s=0)
    assert (held.replicas, held.reason) == (2, "8 is above maxReplicas 2")
    settled = decide(policy, State(), 8, busy(0, 0.1, 8), now_s=0)
    assert (settled.replicas, settled.reason) == (2, "8 is above maxReplicas 2")
    assert decide(policy, State(), 2, None, now_s=0).reason == "no load reported; holding"
    lifted = decide(Policy(3, 5, 4, 0.8, 0, 300, 300), State(), 1, None, now_s=0)
    assert (lifted.replicas, lifted.reason) == (3, "1 is below minReplicas 3")
