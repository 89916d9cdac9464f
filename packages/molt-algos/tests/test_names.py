"""The typed names configs use (`Literal`s, which a CLI can list) equal the registries."""

from typing import get_args

from molt_algos.advantages import ADVANTAGE_ESTIMATORS, EstimatorName
from molt_algos.aggregation import AGGREGATIONS, AggregationName
from molt_algos.kl import KL_ESTIMATORS, KLConfig
from molt_algos.losses import POLICY_LOSSES, PolicyLossName


def test_literal_names_equal_the_registries():
    assert set(get_args(EstimatorName)) == set(ADVANTAGE_ESTIMATORS)
    assert set(get_args(PolicyLossName)) == set(POLICY_LOSSES)
    assert set(get_args(AggregationName)) == set(AGGREGATIONS)
    kl_names = get_args(KLConfig.__dataclass_fields__["estimator"].type)
    assert set(kl_names) == set(KL_ESTIMATORS)
