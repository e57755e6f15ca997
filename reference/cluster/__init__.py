"""The cluster layer: scenarios, a discrete-event simulator running the real scheduler, the router
(residency first, then tiers with spill, prefix affinity, token-aware load), and pipeline placement.

    from reference.cluster import load_scenario, simulate
    result = simulate(load_scenario("reference/cluster/examples/two_regions.toml"), seed=1)
    result.summary()     # TTFT/TPOT/e2e percentiles, tier shares, utilization, event-log hash, ...

See ``reference/cluster/README.md`` for the scenario format and the commands.
"""

from reference.cluster.scenario import Scenario, ScenarioError, load_scenario, scenario_from_dict
from reference.cluster.simulator import Simulator, simulate

__all__ = ["Scenario", "ScenarioError", "Simulator", "load_scenario", "scenario_from_dict",
           "simulate"]
