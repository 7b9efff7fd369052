"""Every metric name in one place (``names``) and the recorder built from them (``recorder``).

Importing this package does not import Ray; ``RunMetrics`` does nothing until
Ray is initialized in the recording process.
"""

from .names import (
    COUNTER,
    GAUGE,
    GROUPS,
    HISTOGRAM,
    METRICS,
    PREFIX,
    RECOVERY_PHASES,
    STATES,
    MetricSpec,
    metric,
    prometheus_names,
)
from .recorder import RunMetrics

__all__ = [
    "COUNTER", "GAUGE", "GROUPS", "HISTOGRAM", "METRICS", "PREFIX", "RECOVERY_PHASES", "STATES",
    "MetricSpec", "RunMetrics", "metric", "prometheus_names",
]
