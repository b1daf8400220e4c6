"""The two Corral dashboards, a fleet overview and a per-deployment drill-down, by the file name each
is written to under charts/corral/dashboards/."""

from __future__ import annotations

from corral_cli.chartgen.dashboards.deployment import deployment_drilldown
from corral_cli.chartgen.dashboards.fleet import fleet_overview

# file name under charts/corral/dashboards/ -> dashboard
DASHBOARDS = {
    "corral-fleet.json": fleet_overview,
    "corral-deployment.json": deployment_drilldown,
}
