"""Trainer configs the operator accepts but the reference trainer must refuse, clearly."""

from __future__ import annotations

import re

import pytest
from tardigrade_trainer.config import ConfigError, TrainerConfig

from tests.conftest import corpus_cases

CASES = corpus_cases("unrunnable_trainingjobs.yaml")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reference_trainer_refuses_with_a_reason(case):
    raw = case["document"]["spec"]["trainer"]
    with pytest.raises(ConfigError, match=re.escape(case["says"])):
        config = TrainerConfig.from_mapping(raw)
        config.check_devices(case["devices"])  # only reached by cases that parse
