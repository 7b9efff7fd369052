"""What a running controller shows its callers: the progress the driver polls, and ``status``.

Read-only views of the controller's state, taken under its lock while
``run()`` goes on in another thread of the actor.
"""

from __future__ import annotations

import statistics


class ControllerViews:
    """Mixed into ``Controller``: it provides the attributes read here."""

    def progress(self, since: int, events_since: int = 0) -> dict:
        """Step records from index ``since`` of the history and events from ``events_since``.

        After a rollback the history is shorter than before; ``length`` tells the
        caller where it stands now.
        """
        with self._lock:
            return {"state": self.state.value, "records": self.history[since:], "length": len(self.history),
                    "events": self.events[events_since:], "n_events": len(self.events),
                    "plan": self.plan.describe() if self.plan else None}

    def status(self) -> dict:
        """What ``elastic-trainer status`` shows: plan, step, throughput, recent failures."""
        with self._lock:
            recent = self.history[-10:]
            return {"run": self.run_name, "state": self.state.value, "step": self.step,
                    "steps": self.cfg.train.steps, "last": self.history[-1] if self.history else None,
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recent) if recent else None,
                    "step_time_s": statistics.median(r["step_time_s"] for r in recent) if recent else None,
                    "plan": self.plan.describe() if self.plan else None,
                    "setting_up": self.setting_up,
                    "snapshots": self.schedule.describe(),
                    "workers": self.pool.table(),
                    "failures": [e for e in self.events if e["kind"] == "failure"][-5:],
                    "recoveries": sum(1 for e in self.events if e["kind"] == "recovery"),
                    "eval": next((e for e in reversed(self.events) if e["kind"] == "eval"), None),
                    "pace": (self.history[-1].get("pace") if self.history else None) or {},
                    "stragglers": self.balance.tracker.stragglers,
                    "shares": self.balance.shares,
                    "benched": self.bench.describe()}
