"""Progress lines on the driver: step, loss, tokens/s, step time and plan."""

from __future__ import annotations

from typing import TextIO

from .config import TrainerConfig


class ProgressPrinter:
    def __init__(self, cfg: TrainerConfig, stream: TextIO):
        self.cfg = cfg
        self.stream = stream
        self.every = cfg.run.log_every
        self.total = cfg.train.steps

    def step(self, rec: dict) -> None:
        s = rec["step"]
        if s == 1 or s % self.every == 0 or s == self.total:
            print(
                f"step {s:>5}/{self.total} | loss {rec['loss']:.4f} | {rec['tokens_per_s']:>9,.0f} tok/s"
                f" | {rec['step_time_s'] * 1000:7.1f} ms/step | comm {rec['comm_s'] * 1000:6.1f} ms"
                f" | dp={rec['dp']} pp={rec['pp']}",
                file=self.stream, flush=True,
            )

    def event(self, ev: dict) -> None:
        kind = ev["kind"]
        if kind == "failure":
            where = f" (rank {ev['rank']}, node {str(ev['node'])[:8]})" if ev.get("rank") is not None else ""
            print(f"!! failure at step {ev['step']}: {ev['failure']} of worker {ev['worker']}{where}",
                  file=self.stream, flush=True)
        elif kind == "recovery":
            a, b = ev["plan_before"] or {}, ev["plan_after"]
            srcs = ", ".join(f"{n} blocks from {t}" for t, n in ev["sources"].items()) or "fresh start"
            print(f"-> {'grew' if ev['reason'] == 'grow' else 'recovered'}: dp={a.get('dp')} pp={a.get('pp')} -> "
                  f"dp={b['dp']} pp={b['pp']}, restored step {ev['restored_step']} ({srcs}), "
                  f"{ev['steps_redone']} step(s) redone; detect {ev['detect_s']:.2f}s, re-plan "
                  f"{ev['replan_s']:.2f}s, restore {ev['restore_s']:.2f}s"
                  + (f", {ev['attempts'] - 1} failed attempt(s) {ev['failed_attempts_s']:.2f}s"
                     if ev.get("attempts", 1) > 1 else ""), file=self.stream, flush=True)
        elif kind == "resume":
            print(f"-> resumed from step {ev.get('step', 0)} of {ev.get('source', '')}", file=self.stream, flush=True)
        elif kind == "checkpoint_problem":
            print(f"!! checkpoint: {ev['detail']}", file=self.stream, flush=True)
        elif kind == "durable_checkpoint":
            print(f"   durable checkpoint of step {ev['step']} written to {ev['path']} in {ev['seconds']:.2f}s",
                  file=self.stream, flush=True)

    def done(self, history: list[dict]) -> None:
        if not history:
            return
        first, last = history[0]["loss"], history[-1]["loss"]
        steady = history[len(history) // 2:]
        tps = sum(r["tokens_per_s"] for r in steady) / len(steady)
        print(
            f"done: {len(history)} steps, loss {first:.4f} -> {last:.4f} "
            f"({(1 - last / first) * 100:.1f}% lower), {tps:,.0f} tok/s steady",
            file=self.stream, flush=True,
        )
