"""Progress lines on the driver: step, loss, tokens/s, step time and plan."""

from __future__ import annotations

import collections
import statistics
from typing import TextIO

from ..config import TrainerConfig
from ..integrity.anomaly import describe


class ProgressPrinter:
    """Step lines and events on the driver.

    On a terminal a live bar (step, loss, tokens/s, ETA) redraws in place and a
    full line is kept every ``run.log_every`` steps; elsewhere (job logs,
    pipes) only the periodic lines are written, since a redrawn line would
    fill a log with carriage returns.
    """

    def __init__(self, cfg: TrainerConfig, stream: TextIO, live: bool | None = None):
        self.cfg = cfg
        self.stream = stream
        self.every = cfg.run.log_every
        self.total = cfg.train.steps
        self.live = stream.isatty() if live is None else live
        self._recent: collections.deque = collections.deque(maxlen=20)  # step times for the ETA
        self._bar_shown = False

    def eta_s(self, step: int) -> float | None:
        if not self._recent:
            return None
        return (self.total - step) * statistics.median(self._recent)

    def bar(self, rec: dict, width: int = 24) -> str:
        s = rec["step"]
        filled = int(width * s / max(1, self.total))
        eta = self.eta_s(s)
        return (f"[{'#' * filled}{'.' * (width - filled)}] {s}/{self.total} | loss {rec['loss']:.4f} | "
                f"{rec['tokens_per_s']:,.0f} tok/s | ETA {_clock(eta) if eta is not None else '?'}")

    def step(self, rec: dict) -> None:
        s = rec["step"]
        self._recent.append(rec["step_time_s"])
        if s == 1 or s % self.every == 0 or s == self.total:
            eta = self.eta_s(s)
            self._line(
                f"step {s:>5}/{self.total} | loss {rec['loss']:.4f} | {rec['tokens_per_s']:>9,.0f} tok/s"
                f" | {rec['step_time_s'] * 1000:7.1f} ms/step | comm {rec['exposed_comm_s'] * 1000:6.1f} ms exposed"
                f" | dp={rec['dp']} pp={rec['pp']} | ETA {_clock(eta) if eta is not None else '?'}"
            )
        if self.live:
            self.stream.write("\r\x1b[2K" + self.bar(rec))
            self.stream.flush()
            self._bar_shown = True

    def _line(self, text: str) -> None:
        if self._bar_shown:  # clear the live bar; it is redrawn after the next step
            self.stream.write("\r\x1b[2K")
            self._bar_shown = False
        print(text, file=self.stream, flush=True)

    def event(self, ev: dict) -> None:
        kind = ev["kind"]
        if kind == "failure":
            where = f" (rank {ev['rank']}, node {str(ev['node'])[:8]})" if ev.get("rank") is not None else ""
            self._line(f"!! failure at step {ev['step']}: {ev['failure']} of worker {ev['worker']}{where}")
        elif kind == "recovery":
            a, b = ev["plan_before"] or {}, ev["plan_after"]
            srcs = ", ".join(f"{n} blocks from {t}" for t, n in ev["sources"].items()) or "fresh start"
            self._line(f"-> {'grew' if ev['reason'] == 'grow' else 'recovered'}: dp={a.get('dp')} pp={a.get('pp')} -> "
                            f"dp={b['dp']} pp={b['pp']}, restored step {ev['restored_step']} ({srcs}), "
                       f"{ev['steps_redone']} step(s) redone; detect {ev['detect_s']:.2f}s, re-plan "
                       f"{ev['replan_s']:.2f}s, restore {ev['restore_s']:.2f}s"
                       + (f", {ev['attempts'] - 1} failed attempt(s) {ev['failed_attempts_s']:.2f}s"
                          if ev.get("attempts", 1) > 1 else ""))
        elif kind == "anomaly":
            self._line(f"!! step {ev['step']} anomalous: {describe(ev)}; {ev.get('action')}"
                       + (f", samples {ev['samples'][0]}..{ev['samples'][1] - 1} left out" if ev.get("samples") else "")
                       + (f", back to step {ev['restored_step']}" if ev.get("restored_step") is not None else ""))
        elif kind == "corruption":
            self._line(f"!! silent data corruption at step {ev['step']}: "
                       + (f"ranks {ev['suspects']} proven at fault ({ev['proof']}); quarantined: "
                          f"{', '.join(n[:8] for n in ev['quarantined']) or 'workers ' + str(ev.get('quarantined_workers'))}"
                          if ev.get("suspects") else f"nobody proven at fault ({ev['proof']})"))
        elif kind == "memory_kill":
            self._line(f"!! out of memory: {ev['detail']}")
        elif kind == "eval":
            self._line(f"   eval after step {ev['step']}: loss {ev['loss']:.4f} ({ev['seconds']:.2f}s, "
                       f"dp={ev['dp']} pp={ev['pp']})")
        elif kind == "placement":
            self._line(f"placement: {ev['detail']}")
        elif kind == "fence":
            self._line(f"{'->' if ev['outcome'] == 'readmitted' else '!!'} worker {ev['worker']}, fenced out for "
                       f"silence {ev['fenced_s']:.1f}s ago: {ev['outcome']} ({ev['detail']})")
        elif kind == "start_smaller":
            a, b = ev["plan_after"], ev["plan_before"]
            self._line(f"!! room for {ev['room']} of {b['world_size']} workers after {ev['waited_s']:g}s: started on "
                       f"dp={a['dp']} x pp={a['pp']}, growing as nodes join ({ev['policy']})")
        elif kind == "snapshot_dropped":
            self._line(f"!! snapshot of step {ev['step']} dropped: {ev['reason']}")
        elif kind == "emergency_checkpoint":
            self._line(f"!! emergency checkpoint at {ev['path']}")
        elif kind == "resume":
            self._line(f"-> resumed from step {ev.get('step', 0)} of {ev.get('source', '')}")
        elif kind == "checkpoint_problem":
            self._line(f"!! checkpoint: {ev['detail']}")
        elif kind == "durable_failed":
            self._line(f"!! durable checkpoint of step {ev['step']} failed ({_durable_role(ev)}): {ev['error']}")
        elif kind == "stop_requested":
            self._line(f"!! stop requested at step {ev['step']}"
                       + (f" ({ev['reason']})" if ev.get("reason") else "")
                       + ": the run ends after the steps in flight and saves what it has")
        elif kind == "straggler":
            self._line(f"!! straggler: rank {ev['rank']} (worker {ev.get('worker')}, node {str(ev.get('node'))[:8]}) "
                       f"computes {ev['compute_s'] / ev['reference_s']:.1f}x its {ev['against']} since step "
                       f"{ev['since_step']} (pace {ev['pace']:.2f} over balance.window)")
        elif kind == "straggler_recovered":
            self._line(f"-> rank {ev['rank']} is back to pace {ev['pace']:.2f} after {ev['slow_steps']} slow steps")
        elif kind == "rebalance" and ev.get("action") == "spare":
            self._line(f"-> rebalance: leaving rank {ev['rank']} out as a spare (pace {ev['pace']:.2f}): dp="
                       f"{ev['plan_after']['dp']} x pp={ev['plan_after']['pp']} predicted "
                       f"{ev['predicted_step_s'] * 1e3:.1f} ms/step against {ev['step_s_before'] * 1e3:.1f}")
        elif kind == "rebalance" and ev.get("action") == "recut":
            self._line(f"-> rebalance: re-cutting the stages {ev['stages_before']} -> {ev['stages']} for rank(s) "
                       f"{ev['ranks']} (stage paces {ev['stage_pace']}), predicted {ev['step_s_before'] * 1e3:.1f} -> "
                       f"{ev['predicted_step_s'] * 1e3:.1f} ms/step (repays in {ev['payback_steps']:.0f} steps)")
        elif kind == "rebalance" and ev.get("action") == "balanced cut":
            self._line(f"-> rebalance: the balanced cut {ev['stages']} again ({ev.get('reason')})")
        elif kind == "rebalance" and ev.get("action") == "readmit":
            why = (f"is back to pace {ev['pace']:.2f}" if ev.get("pace") is not None
                   else f"is let back in ({ev.get('reason')})")
            self._line(f"-> rebalance: worker {ev['worker']} {why} after {ev['benched_steps']} steps benched; "
                       "it may be grown onto")
        elif kind == "rebalance":
            if ev.get("shares"):
                self._line(f"-> rebalance: micro-batches per replica {ev['shares_before'] or 'equal'} -> "
                           f"{ev['shares']}, predicted {ev['step_s_before'] * 1e3:.1f} -> "
                           f"{ev['predicted_step_s'] * 1e3:.1f} ms/step (repays in {ev['payback_steps']:.0f} steps)")
            else:
                self._line(f"-> rebalance: equal micro-batches again ({ev.get('reason') or 'the paces evened out'})")
        elif kind == "durable_checkpoint":
            self._line(f"   durable checkpoint of step {ev['step']} written to {ev['path']} in {ev['seconds']:.2f}s")

    def done(self, history: list[dict], state: str = "FINISHED") -> None:
        """The run's last line: ``done`` for a run that finished, ``stopped at step N of T`` for
        one ended by a stop (``state`` STOPPED), with the loss and the steady throughput."""
        if not history:
            if state == "STOPPED":
                self._line(f"stopped at step 0 of {self.total} (not finished): no step run")
            return
        first, last = history[0]["loss"], history[-1]["loss"]
        steady = history[len(history) // 2:]
        tps = sum(r["tokens_per_s"] for r in steady) / len(steady)
        head = (f"stopped at step {history[-1]['step']} of {self.total} (not finished): " if state == "STOPPED"
                else "done: ")
        self._line(
            f"{head}{len(history)} steps, loss {first:.4f} -> {last:.4f} "
            f"({(1 - last / first) * 100:.1f}% lower), {tps:,.0f} tok/s steady"
        )


def _durable_role(ev: dict) -> str:
    """What a failed durable write means for the run, by its role."""
    role = ev.get("role", "periodic")
    if role == "final":
        return "the final one: the run fails without it"
    if role == "emergency":
        return "the emergency copy"
    last = ev.get("last_written")
    return "the run goes on from memory; " + (f"the newest on storage is of step {last}" if last is not None
                                               else "none written since the run started")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
