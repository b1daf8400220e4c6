"""The routing benchmark's workload: policies compared in a round see the same traffic shape with
different words (cold prefix caches for each), and shared documents really are shared."""

from __future__ import annotations

from bench.routing.workload import WorkloadSpec, build_requests


def count_words(text: str) -> int:
    return len(text.split())


def test_same_seed_same_shape_new_text_seed_new_words() -> None:
    spec = WorkloadSpec(num_requests=80, num_documents=4, document_tokens=40, unique_prompt_tokens=16)
    a = build_requests(spec, 3, count_words, text_seed=100)
    b = build_requests(spec, 3, count_words, text_seed=101)
    assert [r.output_len for r in a] == [r.output_len for r in b]
    assert [r.prompt.startswith("Document") for r in a] == [r.prompt.startswith("Document") for r in b]
    assert not {r.prompt for r in a} & {r.prompt for r in b}  # no prefix in common across runs
    heads = {r.prompt.split("\n")[0] for r in a if r.prompt.startswith("Document")}
    assert 1 < len(heads) <= 4  # requests share a few document heads
    assert build_requests(spec, 3, count_words) == build_requests(spec, 3, count_words, text_seed=3)


def test_paired_ratios_compare_policies_within_each_round() -> None:
    from bench.routing.routing_bench import add_paired_ratios, table

    rounds = {
        "round-robin": [
            {"ttft_p99_ms": 1000.0, "output_tok_s": 100.0},
            {"ttft_p99_ms": 4000.0, "output_tok_s": 50.0},
        ],
        "kv-aware": [
            {"ttft_p99_ms": 400.0, "output_tok_s": 100.0},
            {"ttft_p99_ms": 2000.0, "output_tok_s": 55.0},
        ],
    }
    base = {"ttft_p50_ms": 1.0, "output_tok_s": 1.0, "req_s": 1.0, "num_shed": 0, "num_failed": 0}
    rows = {
        name: base | {"prefix_hit_rate": 0.5, "ttft_p99_ms": pooled_p99, "preemptions": 3.0}
        for name, pooled_p99 in (("round-robin", 3900.0), ("kv-aware", 1950.0))
    }
    add_paired_ratios(rows, rounds)
    assert rows["kv-aware"]["p99_vs_baseline_pooled"] == 0.5  # p99 over all rounds' requests
    assert rows["kv-aware"]["p99_vs_baseline_per_round"] == [0.4, 0.5]
    assert rows["kv-aware"]["p99_vs_baseline_median"] == 0.45  # pooled p99 would say 2000 / 4000
    assert rows["kv-aware"]["tput_vs_baseline_median"] == 1.05
    assert "| kv-aware |" in table(rows) and "| 0.50 | 3 | 0.50x | 0.45x | 1.05x |" in table(rows)


def test_policy_order_rotates_so_each_policy_runs_in_every_position() -> None:
    from bench.routing.routing_bench import policy_order

    policies = ["a", "b", "c"]
    orders = [policy_order(policies, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert policy_order(policies, 3) == orders[0]
    assert policies == ["a", "b", "c"]  # not rotated in place
    for name in policies:
        assert sorted(order.index(name) for order in orders) == [0, 1, 2]
