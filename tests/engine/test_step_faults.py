"""``--debug-step-fault STAGE:PREFIX[@N]``: parsed strictly, naming the flag; off by default."""

from __future__ import annotations

import pytest

from kvreuse.engine.llm_engine import EngineConfig
from kvreuse.engine.step_faults import InjectedFault, StepFaults


def test_parse_groups_prefixes_by_stage():
    faults = StepFaults.parse(["forward:a-", "sample:b-@7", "forward:c@d"])
    assert (faults.forward, faults.sample) == ((("a-", 0), ("c@d", 0)), (("b-", 7),))
    assert bool(faults) and not bool(StepFaults.parse([]))


@pytest.mark.parametrize("spec", ["forward", "forward:", "decode:x", ":x", "sample:@3"])
def test_a_malformed_spec_is_refused_naming_the_flag(spec):
    with pytest.raises(ValueError, match=r"--debug-step-fault must be STAGE:REQUEST_ID_PREFIX\[@N\]"):
        StepFaults.parse([spec])
    with pytest.raises(ValueError, match="--debug-step-fault"):
        EngineConfig(debug_step_faults=(spec,))


def test_checks_raise_only_for_marked_ids_from_their_nth_token():
    faults = StepFaults.parse(["forward:bad-", "sample:worse-@5"])
    faults.check_forward([("ok-1", 9), ("worse-1", 9)])
    faults.check_sample("bad-1", 0)
    faults.check_sample("worse-1", 4)
    with pytest.raises(InjectedFault, match=r"injected forward fault \(request bad-2\)"):
        faults.check_forward([("ok-1", 0), ("bad-2", 0)])
    with pytest.raises(InjectedFault, match=r"injected post-processing fault \(request worse-1\)"):
        faults.check_sample("worse-1", 5)
    StepFaults().check_forward([("bad-1", 0)])  # the default: nothing injected
    assert EngineConfig().debug_step_faults == ()
