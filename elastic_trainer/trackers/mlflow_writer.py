"""MLflow: a run's metrics, events and config as one MLflow run.

Written through ``MlflowClient`` (the ``mlflow-skinny`` package; a database store such as
MLflow's default ``sqlite:///mlflow.db`` also needs SQLAlchemy and Alembic, in the same pip
extra). Metrics and event lines are buffered and sent in batches (``log_batch``) every few
seconds and at the end, so a remote server costs the driver one call per batch, not one per
value. A rollback re-sends steps: MLflow keeps every value logged at a step, in the order
logged (``get_metric_history``); the last one at a step is the one that counts.

The run's events go to the artifact ``events.txt`` (one line each, rewritten when new ones
came), its state to the tag ``elastic_trainer.state``, and the count of each kind of trouble
(``records.COUNTED``) to a metric ``events/<kind>``.
"""

from __future__ import annotations

import datetime
import time
from urllib.parse import quote, urlsplit, urlunsplit

from ..config import TrainerConfig
from ..storage.credentials import lookup
from ..storage.uris import mask
from .records import COUNTED, EventWords, flat_config, goodput_scalars, step_scalars

# MLflow's own batch limits (mlflow.utils.validation), fixed here for older clients.
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100
_FLUSH_S = 5.0
# MLflow's run status for each end of an elastic_trainer run.
_STATUS = {"FINISHED": "FINISHED", "STOPPED": "KILLED", "ABORTED": "KILLED", "FAILED": "FAILED"}


def tracking_uri(cfg: TrainerConfig) -> str:
    """``run.mlflow_tracking_uri``, else MLflow's own choice (``MLFLOW_TRACKING_URI``, else its default)."""
    if cfg.run.mlflow_tracking_uri:
        return _with_credentials(cfg.run.mlflow_tracking_uri)
    import mlflow

    return mlflow.get_tracking_uri()


def experiment_name(cfg: TrainerConfig, run_name: str) -> str:
    """``run.mlflow_experiment``, else the run name up to its last '.', else ``elastic_trainer``."""
    if cfg.run.mlflow_experiment:
        return cfg.run.mlflow_experiment
    head, dot, _ = run_name.rpartition(".")
    return head if dot and head else "elastic_trainer"


class MlflowTracker:
    """One MLflow run in ``experiment_name(cfg, run_name)`` at ``tracking_uri(cfg)``."""

    name = "mlflow"

    def __init__(self, cfg: TrainerConfig, run_name: str, clock=time.monotonic):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(cfg)
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = experiment_name(cfg, run_name)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                exp_id = self.client.create_experiment(experiment)
            except MlflowException:   # made meanwhile by another run
                found = self.client.get_experiment_by_name(experiment)
                if found is None:
                    raise
                exp_id = found.experiment_id
        else:
            exp_id = found.experiment_id
        run = self.client.create_run(exp_id, run_name=run_name, tags={"elastic_trainer.run": run_name})
        self.run_id = run.info.run_id
        self.where = f"mlflow: run {self.run_id} ({run_name}) in experiment {experiment!r} at {mask(self.uri)}"
        self._clock = clock
        self._words = EventWords(cfg)
        self._metrics: list = []
        self._lines: list[str] = []
        self._lines_sent = 0
        self._counts: dict[str, int] = {}
        self._last_step = 0
        self._flushed = clock()
        self._params(cfg)

    def _params(self, cfg: TrainerConfig) -> None:
        from mlflow.entities import Param

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
        except ImportError:
            limit = 500    # the oldest servers' limit
        params = [Param(k, v) for k, v in flat_config(cfg.model_dump(mode="json"), limit).items()]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _PARAMS_PER_BATCH])

    def _metric(self, key: str, value: float, step: int, when: float | None) -> None:
        from mlflow.entities import Metric

        self._metrics.append(Metric(key, value, int((when or time.time()) * 1000), step))

    def step(self, rec: dict) -> None:
        s = int(rec["step"])
        for key, value in step_scalars(rec).items():
            self._metric(key, value, s, rec.get("time"))
        self._last_step = max(self._last_step, s)
        self._due()

    def event(self, ev: dict) -> None:
        kind = str(ev.get("kind", "event"))
        own = ev.get("step")
        when = ev.get("time")
        stamp = (datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
                 if isinstance(when, (int, float)) else "")
        at = own if isinstance(own, int) else self._last_step
        self._lines.append(f"{stamp} step {at} [{kind}] {self._words.line(ev)}")
        if kind == "state" and ev.get("to"):
            self.client.set_tag(self.run_id, "elastic_trainer.state", str(ev["to"]))
        if kind == "eval" and isinstance(ev.get("loss"), (int, float)) and isinstance(own, int):
            self._metric("train/eval_loss", float(ev["loss"]), own, when)
        if kind in COUNTED:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            self._metric(f"events/{kind}", self._counts[kind], at, when)
        self._due()

    def _due(self) -> None:
        if len(self._metrics) >= _METRICS_PER_BATCH // 2 or self._clock() - self._flushed >= _FLUSH_S:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self._metrics), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=self._metrics[i:i + _METRICS_PER_BATCH])
        self._metrics = []
        if len(self._lines) > self._lines_sent:
            self.client.log_text(self.run_id, "\n".join(self._lines) + "\n", "events.txt")
            self._lines_sent = len(self._lines)
        self._flushed = self._clock()

    def close(self, state: str, goodput: dict | None) -> None:
        try:
            for key, value in goodput_scalars(goodput).items():
                self._metric(key, value, self._last_step, None)
            self.flush()
            self.client.set_tag(self.run_id, "elastic_trainer.state", state)
        finally:
            # Whatever the writes did, the MLflow run is not left RUNNING.
            self.client.set_terminated(self.run_id, _STATUS.get(state, "FAILED"))


def _with_credentials(uri: str) -> str:
    """``uri`` with the user and password the config's loading took out of it (``storage.credentials``
    keeps them out of every record) put back, for MLflow's HTTP client; as given otherwise."""
    creds = lookup(uri)
    user, password = creds.get("access_key"), creds.get("secret_key")
    parts = urlsplit(uri)
    if not user or "@" in parts.netloc or parts.scheme not in ("http", "https"):
        return uri
    userinfo = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))
