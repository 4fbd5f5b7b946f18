"""kvrag's test helpers (distribution ``kvrag-testing``, not part of the kvrag wheel): tiny random models per
family, the reusable ``KVStoreTests`` / ``FusionMethodTests`` suites, the equivalence oracle and a ``redis-server``
launcher. They need pytest; :mod:`kvrag_testing.fusion_suite` also needs ``kvrag-bench`` (the ablation controls)."""
