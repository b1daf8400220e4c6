def test_a_model_at_zero_replicas_stays_known() -> None:
    from corral_gateway.k8s_discovery import replicas_from_slices

    empty = {"metadata": {"labels": {"corral.dev/model": "tiny"}}, "ports": None, "endpoints": None}
    assert replicas_from_slices([empty], "corral.dev/model", "http") == {"tiny": []}
