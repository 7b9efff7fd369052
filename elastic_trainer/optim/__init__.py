"""The optimizer a run steps with (``train.optimizer``): any ``torch.optim`` class or a user's,
with parameter groups by name pattern (``build``), and what sharding, state and the planner
need to know of it (``choice``). See docs/config.md, "Optimizer"."""

from .build import build_optimizer, check_patterns  # noqa: F401
from .choice import check_spec, is_elementwise, resolve, state_floats  # noqa: F401
