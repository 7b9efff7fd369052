"""The run's worker actors as the controller holds them: starting, joining, asking, dropping.

Workers are pinned to nodes the controller picks (``placement``), so the
same code starts the first workers, replacements after a loss and new
workers when nodes join. A worker keeps its process across re-plans; only
its rank changes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...config import TrainerConfig
from ...errors import error_line
from ...naming import NAMESPACE, spare_name
from ...planning.node_share import snapshot_host_budget
from ...storage.credentials import storage_env
from ...secrets import split_env
from ...worker.actor import TrainWorker
from ...worker.allocator import allocator_env, inherited
from ...worker.device import SHARE_GPUS_ENV
from ...worker.liveness import kill_marked
from .asking import ask_all, failed
from .placement import pick_nodes

log = logging.getLogger(__name__)

# Threads of train_step's group (see worker.actor): the call running, and a lease granted
# behind it (control.renew_early), which waits for it on the worker: calls to a threaded actor
# may start in any order, so the worker orders them itself (TrainWorker.train_lease).
_TRAIN_CONCURRENCY = 2


@dataclass
class WorkerHandle:
    """One worker actor: its id for the run, where it runs, and the rank it holds (None: a spare)."""

    wid: int
    actor: object
    node: str
    pid: int
    ip: str
    rank: int | None = None
    mark: str | None = None   # its process's start time (worker.liveness): a node-mate can vouch for it
    oom_kills: int | None = None   # its memory cgroup's OOM kills when it joined (controller.memory_kills)
    memory_limit: int | None = None   # and that cgroup's limit, bytes (None: none)
    allocator: str | None = None      # the malloc it runs on (worker.allocator)


# The pid with its start time: a worker that ended meanwhile leaves its pid free for another
# process on that node, which a bare kill would take.
_sigkill = ray.remote(num_cpus=0, max_retries=0)(kill_marked)


class WorkerPool:
    """The run's live workers (``workers``: id -> handle) and those still starting (``joining``).

    The controller's loop thread adds and drops workers while its callers' threads (``status``,
    ``worker_handles``: Ray runs a threaded actor's calls at once) read them, so every change to
    ``workers`` is made under ``lock`` and a reader on another thread walks ``handles()``, a copy
    taken under it, never the dict itself."""

    def __init__(self, cfg: TrainerConfig, run_name: str):
        self.cfg = cfg
        self.run_name = run_name
        self.workers: dict[int, WorkerHandle] = {}
        self.joining: dict[int, tuple] = {}   # worker id -> (actor, info ref, node)
        self.bare_nodes: set[str] = set()    # alive (a dropped worker answered there), no worker of ours
        self.avoided: set[str] = set()       # nodes where no worker is started again (a memory kill there)
        self.draining: dict[str, float | None] = {}   # node -> its drain's deadline (epoch s; None: none given)
        self.quarantined: dict[str, str] = {}   # node -> why no plan may use it again (silent data corruption)
        self.quarantined_workers: set[int] = set()   # the same for a worker, where its node is all the run has
        self.lock = threading.Lock()
        self._next_wid = 0
        # A preload of the run's own (scaling.env_vars) replaces this one, and is not checked.
        # This process was started by the cluster as its workers will be: where it runs on what
        # the run asks for, so will they, with no environment of their own (worker.allocator).
        here = inherited()
        self._allocator_env = allocator_env(cfg.scaling.cpu_allocator, cfg.scaling.uses_gpu, inherited=here)
        # Checked where jemalloc is to be had: preloaded by us, or by the cluster's start.
        self._expect_jemalloc = (cfg.scaling.cpu_allocator == "jemalloc" and not cfg.scaling.uses_gpu
                                 and (here == "jemalloc" or bool(self._allocator_env.get("LD_PRELOAD"))))
        self._allocator_warned = "LD_PRELOAD" in cfg.scaling.env_vars
        # Groups: "train" runs steps one at a time (a lock), with a thread for a lease queued behind
        # the one running; "control" (ping, queries) never waits
        # behind the default pool, where a set-up may sit in a rendezvous for a while;
        # "snapshot" hands over snapshot parts, whose object-store writes overlap the next step.
        self._actor_cls = ray.remote(
            max_concurrency=16,
            concurrency_groups={"train": _TRAIN_CONCURRENCY, "control": 4, "snapshot": 2, "restore": 2,
                                "storage": 1})(TrainWorker)

    def __len__(self) -> int:
        return len(self.workers)

    def __getitem__(self, wid: int) -> WorkerHandle:
        return self.workers[wid]

    def __contains__(self, wid: int) -> bool:
        return wid in self.workers

    def nodes(self) -> set[str]:
        """Nodes known alive: those with a live worker of ours, and those whose worker was
        dropped while it still answered (``drop(..., answered=True)``). Ray's own view of a
        node lags its death by seconds, and reading an object from a dead node blocks, so a
        node counts only on such evidence; it stops counting once Ray declares it dead."""
        with self.lock:
            return {w.node for w in self.workers.values()} | self.bare_nodes

    def handles(self) -> list[WorkerHandle]:
        """The live workers' handles as they are now, in id order: a copy any thread may walk."""
        with self.lock:
            return [self.workers[w] for w in sorted(self.workers)]

    def spawn(self, nodes: list[str], names: list[str] | None = None) -> None:
        """Start a worker on each node given (without waiting for it)."""
        res = dict(self.cfg.scaling.resources_per_worker)
        node_res = {n["NodeID"]: n.get("Resources") or {} for n in ray.nodes()}
        for i, node in enumerate(nodes):
            wid = self._next_wid
            self._next_wid += 1
            opts = dict(
                name=names[i] if names else spare_name(self.run_name, wid), namespace=NAMESPACE,
                num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                resources={k: v for k, v in res.items() if k not in ("CPU", "GPU", "memory")} or None,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            if "memory" in res:
                opts["memory"] = res["memory"]
            env = dict(SHARE_GPUS_ENV) if self.cfg.scaling.uses_gpu else {}
            env.update(self._allocator_env)
            env.update(storage_env())   # the storage's credentials, as the driver passed them here
            env.update(self.cfg.scaling.env_vars)   # the run's own settings win
            # Secret-named variables go as a constructor argument (Ray lists a runtime_env to every
            # client, never an argument); what must be there at the process's start cannot be secret.
            env, secret = split_env(env, self.cfg.run.secret_names)
            if env:
                opts["runtime_env"] = {"env_vars": env}
            actor = self._actor_cls.options(**opts).remote(self.run_name, wid, self.cfg.scaling.torch_threads,
                                                         self.cfg.failure.allow_fault_injection,
                                                         snapshot_host_budget(node_res.get(node, {}), self.cfg),
                                                         env=secret)
            self.joining[wid] = (actor, actor.info.remote(), node)

    def staying(self) -> int:
        """Live workers not on a draining or quarantined node (those are leaving: their places are
        free to fill)."""
        return sum(1 for w in self.handles() if not self.leaving(w.node, w.wid))

    def spawn_on_free_nodes(self) -> None:
        """Start workers where the cluster has room, up to the run's ``max_workers``."""
        want = self.cfg.max_workers - self.staying() - len(self.joining)
        if want <= 0:
            return
        occupied = collections.Counter(w.node for w in self.workers.values())
        occupied.update(node for _, _, node in self.joining.values())
        occupied.update({node: 1 << 20 for node in self.avoided | set(self.draining) | set(self.quarantined)})   # full, however large
        nodes = pick_nodes(self.cfg.scaling, want, occupied)   # as the start placed them
        if nodes:
            log.info("[%s] starting %d worker(s) on free nodes", self.run_name, len(nodes))
            self.spawn(nodes)

    def drain(self, node: str, deadline: float | None) -> list[int]:
        """``node`` is draining (it goes at ``deadline``): start no worker there, and let go of
        the spares there and those still starting; the ids let go. Its ranked workers keep
        their ranks until the re-plan that moves them (``usable`` leaves them out)."""
        self.draining[node] = deadline
        return self._let_go_spares(node)

    def undrain(self, node: str) -> None:
        """``node``'s drain was cancelled (or the node is gone): it may be placed on again."""
        self.draining.pop(node, None)

    def quarantine(self, node: str, why: str) -> list[int]:
        """No plan uses ``node`` again (proven to corrupt data): as ``avoid``, and its ranked
        workers are left out of the next plan (``Bench.usable``)."""
        self.quarantined[node] = why
        return self.avoid(node)

    def leaving(self, node: str | None, wid: int | None = None) -> bool:
        """Whether the worker ``wid`` on ``node`` is on its way out of the plan (its node draining
        or quarantined, or itself quarantined)."""
        return node in self.draining or node in self.quarantined or wid in self.quarantined_workers

    def avoid(self, node: str) -> list[int]:
        """Start no worker on ``node`` again, and let go of the spares there and those still
        starting (a re-plan or growth would put the load that did not fit back on it); the ids
        of the workers let go. Workers holding a rank there keep it until a re-plan."""
        self.avoided.add(node)
        return self._let_go_spares(node)

    def _let_go_spares(self, node: str) -> list[int]:
        """Kill the workers still starting on ``node`` and drop the spares there; their ids."""
        gone = [wid for wid, (_, _, n) in self.joining.items() if n == node]
        for wid in gone:
            kill_actor(self.joining.pop(wid)[0])
        spares = [w.wid for w in self.handles() if w.node == node and w.rank is None]
        self.drop(spares)
        return gone + spares

    def await_joining(self, timeout: float, required: bool) -> list[tuple[int, str, str]]:
        """Move workers that joined within ``timeout`` into ``workers``; (worker id, node, why) of
        those that failed to start (and, with ``required``, of those still starting, which are
        then killed). Without ``required`` the ones still starting stay in ``joining``."""
        if not self.joining:
            return []
        refs = {info: wid for wid, (_, info, _) in self.joining.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        lost = []
        for ref in ready:
            wid = refs[ref]
            actor, _, node = self.joining.pop(wid)
            try:
                info = ray.get(ref)
            except ray.exceptions.RayError as e:
                log.warning("[%s] worker %d failed to start on node %s: %s", self.run_name, wid, node[:12],
                            error_line(e))
                lost.append((wid, node, error_line(e)))
                continue
            with self.lock:
                self.workers[wid] = WorkerHandle(wid, actor, info["node_id"], info["pid"], info["ip"],
                                                 mark=info.get("mark"), oom_kills=info.get("oom_kills"),
                                                 memory_limit=info.get("memory_limit"), allocator=info.get("allocator"))
            log.info("[%s] worker %d joined on node %s (pid %d)", self.run_name, wid, info["node_id"][:12],
                     info["pid"])
            self._check_allocator(wid, info.get("allocator"))
        if required:
            for wid, (actor, _, node) in list(self.joining.items()):
                lost.append((wid, node, f"did not start within {timeout:g}s"))
                kill_actor(actor)
            self.joining = {}
        return lost

    def _check_allocator(self, wid: int, got: str | None) -> None:
        """Say once when a worker runs on another allocator than the run asked for (``worker.allocator``)."""
        if not self._expect_jemalloc or got in (None, "jemalloc") or self._allocator_warned:
            return
        self._allocator_warned = True
        how = (f"{self._allocator_env['LD_PRELOAD']} was not loaded on its node" if self._allocator_env else
               "its node's environment lacks the jemalloc preload this controller's node has")
        log.warning("[%s] worker %d runs on the system allocator, not jemalloc (scaling.cpu_allocator): %s; its "
                    "resident memory may grow with freed memory glibc keeps", self.run_name, wid, how)

    def table(self) -> list[dict]:
        """One row per live worker, off a copy of the pool taken at once: ``status`` reads it on a
        call's thread while the loop thread drops and adds workers."""
        return [{"worker_id": w.wid, "rank": w.rank, "node_id": w.node, "pid": w.pid, "ip": w.ip,
                 "allocator": w.allocator, "mark": w.mark}
                for w in self.handles()]

    def starting(self) -> list[dict]:
        """One row per worker still starting: its node, and whether it is up and waits only for
        the run to take it in (at its next look for workers, ``scaling.grow_check_s``)."""
        rows = list(self.joining.items())   # a copy at once: the loop thread adds and takes
        ready = set()
        if rows:
            refs = [info for _, (_, info, _) in rows]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        return [{"worker_id": wid, "node_id": node, "ready": info in ready} for wid, (_, info, node) in rows]

    def ask(self, method: str, wids, timeout: float, *args) -> dict:
        """``{wid: answer}`` of ``method(*args)`` on each live worker of ``wids`` (see :func:`ask_all`)."""
        return ask_all({w: getattr(self.workers[w].actor, method).remote(*args)
                        for w in wids if w in self.workers}, timeout)

    def dead_or_silent(self, wids) -> tuple[list[int], list[int]]:
        """Those of ``wids`` whose ping failed (dead), and those that did not answer it within
        ``failure.ping_timeout_s`` (silent: paused, or cut off; see ``fences``)."""
        answers = self.ask("ping", wids, self.cfg.failure.ping_timeout_s)
        silent = [w for w, a in answers.items() if isinstance(a, TimeoutError)]
        return [w for w, a in answers.items() if failed(a) and w not in silent], silent

    def dead_among(self, wids) -> list[int]:
        """Those of ``wids`` that do not answer a ping within ``failure.ping_timeout_s``."""
        dead, silent = self.dead_or_silent(wids)
        return dead + silent

    def kill_hung(self, wids) -> None:
        """SIGKILL hung workers from their own nodes: a hung process does not answer Ray's
        polite kill for seconds, and its sockets must close so ranks blocked on it fail now."""
        for wid in wids:
            w = self.workers.get(wid)
            if w is not None:
                _sigkill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(w.node, soft=False)).remote(w.pid, w.mark)

    def drop(self, wids, answered: bool = False) -> None:
        """Kill and forget workers. ``answered``: they answered a ping just now (dropped for
        staying inside a failed step, not lost), so their nodes live on: the snapshot parts
        those nodes hold can still be read (``nodes``)."""
        for wid in wids:
            with self.lock:
                w = self.workers.pop(wid, None)
                if w is not None and answered:
                    self.bare_nodes.add(w.node)
            if w is not None:
                log.info("[%s] dropping worker %d (rank %s, node %s)", self.run_name, wid, w.rank, w.node[:12])
                kill_actor(w.actor)

    def take(self, wids) -> list[WorkerHandle]:
        """Take workers out of the pool without killing them (``fences``); their handles."""
        out = []
        with self.lock:
            for wid in wids:
                w = self.workers.pop(wid, None)
                if w is not None:
                    out.append(w)
        return out

    def readmit(self, handle: WorkerHandle) -> None:
        """Take a worker back into the pool, as a spare (no rank)."""
        handle.rank = None
        with self.lock:
            self.workers[handle.wid] = handle

    def forget_dead_nodes(self, dead: set[str]) -> None:
        """Nodes Ray has declared dead no longer count as alive (``nodes``)."""
        with self.lock:
            self.bare_nodes -= dead

    def teardown(self, leave_s: float = 0.0) -> None:
        """End every worker. ``leave_s`` > 0 (a run that ended well): each is asked to leave
        through its own path (``TrainWorker.leave``) and waited for up to that long, so none is
        still there when the driver ends its cluster; one that has not ended by then is killed,
        as every one is at once with 0 (a failed run's may hang in a collective)."""
        with self.lock:
            workers, self.workers = self.workers, {}
        actors = [w.actor for w in workers.values()]
        if leave_s > 0 and actors and ray.is_initialized():
            calls = {a.leave.remote(): a for a in actors}
            ready, pending = ray.wait(list(calls), num_returns=len(calls), timeout=leave_s)
            # Left: the call failed as its actor ended (exit_actor). One that answered or raised is
            # still there, and is killed with those that have not answered.
            actors = [calls[r] for r in calls if r in pending or not _ended(r)]
            if pending:
                log.warning("[%s] %d worker(s) did not leave within %gs of the run's end: killed", self.run_name,
                            len(pending), leave_s)
        for actor in actors:
            kill_actor(actor)
        for actor, _, _ in self.joining.values():
            kill_actor(actor)
        self.joining = {}


def _ended(ref) -> bool:
    """Whether a ready call's actor has ended (its call failed with the actor)."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - raised in the actor, which is still there
        return False
    return False


def kill_actor(actor) -> None:
    """``ray.kill`` without restart; nothing where it is gone, or where Ray is not running."""
    if not ray.is_initialized():
        return   # no cluster, no actor to kill (and ray.kill would start or join a Ray to find out)
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
