"""One torchft replica group of ``benchmarks/_spot_torchft.py``: a single process (group rank 0
of 1) that trains the demo GPT with torchft's ``Manager``, ``DistributedDataParallel`` and
``OptimizerWrapper`` over torchft's reconfigurable ``ProcessGroupGloo``, as torchft's
``train_ddp.py`` does, and logs every step attempt as a JSON line.

- Its own ``TCPStore`` (127.0.0.1) serves the group's rendezvous; the quorum's primary's store
  hosts the gloo rendezvous of each new quorum.
- Quorum is synchronous (``use_async_quorum=False``): each step waits for the lighthouse's
  quorum before its forward pass, because the batch split depends on it (a joining group heals,
  synchronously, from a live peer over the process group, ``PGTransport``, before it computes).
- The global batch stays ``train.global_batch_size`` at any number of live groups: of the step's
  samples (cursor ``step * global_batch``, the same order as ``_ray_train_recovery.py``) the
  group of participating rank ``r`` of ``n`` takes share ``r`` of ``n`` near-equal shares, and
  scales its loss by ``share * n / global_batch`` so that torchft's average of the ``n``
  gradients is the gradient of the mean loss over the whole global batch.
- ``init_sync=False``: every group builds the same weights from ``train.seed``.

Run by the driver: ``python _spot_torchft_worker.py ARGS_JSON`` (a group) or
``python _spot_torchft_worker.py --lighthouse ARGS_JSON`` (torchft's Rust lighthouse, started
through its Python API ``torchft.coordination.LighthouseServer``). Both exit when the driver
does (a watchdog on the parent's pid), so that a driver killed without its ``finally`` leaves
nothing behind.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path


def _loopback_manager_server() -> None:
    """torchft's Manager binds its gRPC server on ``[::]``; keep it on 127.0.0.1 (it advertises
    ``hostname``, which we set to 127.0.0.1 too)."""
    import torchft.manager as tm

    real = tm.ManagerServer

    def server(**kw):
        kw["bind"] = "127.0.0.1:" + kw["bind"].rsplit(":", 1)[1]
        return real(**kw)

    tm.ManagerServer = server


def _ddp_class():
    """torchft 0.2.0's ``DistributedDataParallel`` with its comm hook fixed for failed all-reduces.

    Its hook does ``work.wait(); return work.get_future()._fut``; when the all-reduce fails (a
    peer died: gloo's "Connection closed by peer") ``_ManagedWork.wait`` reports the error to the
    Manager and returns False without building the future chain, so ``_fut`` is None and the hook
    raises AssertionError (AttributeError once the Manager has errored and hands out a
    ``_DummyWork``) out of ``backward()``: every surviving group crashed on the first peer
    loss. Here the hook returns the bucket as it is instead: the Manager has the error, so
    ``should_commit()`` is False and the step is discarded, as torchft intends."""
    import torch
    from torchft import DistributedDataParallel

    class FixedDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if inner is not None:
                return inner
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

    return FixedDDP


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def lighthouse(args: dict) -> None:
    """torchft's lighthouse on 127.0.0.1; writes its port to ``args["port_file"]``, runs until
    the driver kills it (or exits)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", **args["options"])
    port = server.address().rsplit(":", 1)[1]
    tmp = args["port_file"] + ".tmp"
    Path(tmp).write_text(port)
    os.replace(tmp, args["port_file"])
    while True:
        time.sleep(3600)


def main(args: dict) -> None:
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.data.dataset import TokenDataset
    from elastic_trainer.data.splits import make_sampler
    from elastic_trainer.models import build_model
    from elastic_trainer.worker.stage import build_optimizer

    torch.set_num_threads(1)
    slot, log_path, steps = args["slot"], args["log"], args["steps"]
    cfg = TrainerConfig.model_validate(args["cfg"])
    gb, mb = cfg.train.global_batch_size, cfg.train.micro_batch_size
    blocks, loss_fn = build_model(cfg.model, cfg.train.seed)
    module = nn.Sequential(*blocks)
    data = TokenDataset.open(cfg.data)
    sampler = make_sampler(cfg, data)

    def log(rec: dict) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps({"group": slot, "pid": os.getpid(), **rec}) + "\n")

    _loopback_manager_server()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = args["timeouts"]
    pg = ProcessGroupGloo(timeout=timedelta(seconds=t["pg_s"]))
    opt: Optimizer | None = None

    def state_dict() -> dict:
        return {"model": module.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict) -> None:
        module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=pg, min_replica_size=args["min_replicas"], load_state_dict=load_state_dict,
        state_dict=state_dict, use_async_quorum=False, init_sync=False,
        timeout=timedelta(seconds=t["manager_s"]), quorum_timeout=timedelta(seconds=t["quorum_s"]),
        connect_timeout=timedelta(seconds=t["connect_s"]), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args["lighthouse"],
        replica_id=f"spot_{slot}", hostname="127.0.0.1",
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=t["manager_s"]),
                                         device=torch.device("cpu")),
    )
    model = _ddp_class()(manager, module)
    opt = Optimizer(manager, build_optimizer(model.parameters(), cfg.train))
    log({"event": "ready", "time": time.time(), "join": args["join"]})

    if not args["join"]:  # the first groups enter the first quorum together
        ready = Path(args["ready_dir"])
        (ready / str(slot)).touch()
        deadline = time.time() + t["quorum_s"]
        while len(list(ready.iterdir())) < args["initial"] and time.time() < deadline:
            time.sleep(0.05)

    last_qid = None
    while manager.current_step() < steps:
        before = manager.current_step()
        t0 = time.time()
        opt.zero_grad()  # start_quorum: lighthouse quorum, PG reconfigure, heal (synchronous)
        n, r = manager.num_participants(), manager.participating_rank()
        t1 = time.time()
        step = manager.current_step()
        qid = getattr(manager, "_quorum_id", None)
        if step > before:
            log({"event": "heal", "from_step": before, "to_step": step, "time": t1, "heal_s": t1 - t0,
                 "quorum_id": qid, "world": n})
        if step >= steps:
            break
        shares = [gb // n + (1 if i < gb % n else 0) for i in range(n)]
        rank = r if r is not None else 0  # a non-participant's gradient is zeroed by torchft
        share = shares[rank]
        x, y = data.sample(sampler.replica_rows(step * gb, gb, n, rank, shares))
        xs, ys = torch.from_numpy(x).split(mb), torch.from_numpy(y).split(mb)
        loss_sum = 0.0
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with model.no_sync() if i < len(xs) - 1 else nullcontext():
                loss = loss_fn(model(xm), ym)
                (loss * (len(xm) * n / gb)).backward()
            loss_sum += loss.item() * len(xm)
        if cfg.train.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()  # should_commit(): steps the optimizer only if this group saw no error
        committed = manager.current_step() == step + 1
        err = manager.errored()
        log({"event": "step", "step": step + 1, "committed": committed, "t_quorum": t0, "quorum_s": t1 - t0,
             "start_compute": t1, "end": time.time(), "quorum_id": qid, "quorum_changed": qid != last_qid,
             "world": n, "rank": r, "share": share, "loss": loss_sum / share,
             "error": None if err is None else str(err.original_exception)[:300]})
        last_qid = qid
    log({"event": "done", "time": time.time(), "step": manager.current_step()})
    manager.shutdown(wait=False)


if __name__ == "__main__":
    rc = 0
    _watch_parent(os.getppid())
    try:
        if sys.argv[1] == "--lighthouse":
            lighthouse(json.loads(sys.argv[2]))
        else:
            main(json.loads(Path(sys.argv[1]).read_text()))
    except BaseException:  # noqa: BLE001 - reported, then the exit code says so
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip the interpreter's teardown, which can wait on torchft's threads
