"""The typed names configs use (`Literal`s, which a CLI can list) equal the registries."""

from typing import get_args

from molt_algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AggregationName,
    EstimatorName,
    KLConfig,
    PolicyLossName,
)


def test_literal_names_equal_the_registries():
    assert set(get_args(EstimatorName)) == set(ADVANTAGE_ESTIMATORS)
    assert set(get_args(PolicyLossName)) == set(POLICY_LOSSES)
    assert set(get_args(AggregationName)) == set(AGGREGATIONS)
    kl_names = get_args(KLConfig.__dataclass_fields__["estimator"].type)
    assert set(kl_names) == set(KL_ESTIMATORS)
