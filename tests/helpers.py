"""A user model factory for tests: a tiny token MLP as blocks (imported by path from configs)."""

import functools
import sys
import threading
import time

from torch import nn

from elastic_trainer.models.gpt import TokenCrossEntropy


def build_mlp(vocab_size: int = 256, width: int = 16, depth: int = 3):
    blocks = [nn.Embedding(vocab_size, width)]
    blocks += [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    blocks.append(nn.Linear(width, vocab_size))
    return blocks, TokenCrossEntropy()


def build_mlp_parts(vocab_size: int = 256, width: int = 16, depth: int = 3, only_blocks=None):
    """``build_mlp``'s shape, opted in to rank-local builds: only the blocks asked for are built
    (None elsewhere), each from a seed of its own, so any set of blocks gets the same values."""
    import torch

    base = torch.initial_seed()  # the run's seed: the trainer seeds torch before the call
    n = depth + 2
    wanted = range(n) if only_blocks is None else only_blocks

    def make(i):
        torch.manual_seed(base * 1000 + i)
        if i == 0:
            return nn.Embedding(vocab_size, width)
        if i == n - 1:
            return nn.Linear(width, vocab_size)
        return nn.Sequential(nn.Linear(width, width), nn.GELU())

    return [make(i) if i in wanted else None for i in range(n)], TokenCrossEntropy()


def not_a_pair():
    return [nn.Linear(2, 2)]


def reference_run(cfg, steps: int, micro_batches: int = 1, replicas: int = 1):
    """Plain single-process torch on the same blocks, data and seed: (per-step losses, final state).

    ``cfg.train.precision`` bf16 / fp16 runs forward and loss under autocast, as torch's guide has it;
    fp16 with torch's ``GradScaler`` at the config's initial scale and growth interval.
    ``micro_batches``: accumulate gradients over that many equal chunks of the global batch
    (with bf16, the same matrix shapes as the workers' micro-batches round the same way).
    ``replicas``: sum the gradients as that many DP replicas do: each replica's consecutive
    share of the micro-batches on its own, then the replicas' sums (an fp32 sum's order).
    """
    import torch
    from torch import nn

    from elastic_trainer.data.dataset import TokenDataset
    from elastic_trainer.data.splits import make_sampler
    from elastic_trainer.models import build_model
    from elastic_trainer.worker.stage import build_optimizer

    blocks, loss_fn = build_model(cfg.model, cfg.train.seed)
    model = nn.Sequential(*blocks)
    # By global name, as the ranks name them: train.optimizer's param groups match on it.
    opt = build_optimizer([(f"blocks.{n}", p) for n, p in model.named_parameters()], cfg.train)
    data = TokenDataset.open(cfg.data)
    sampler = make_sampler(cfg, data)
    gb = cfg.train.global_batch_size
    t = cfg.train
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    scaler = (torch.amp.GradScaler("cpu", init_scale=t.loss_scale_init, growth_interval=t.loss_scale_growth_interval)
              if t.precision == "fp16" else None)
    out = []
    for step in range(steps):
        x, y = data.sample(sampler.rows(step * gb, gb))
        opt.zero_grad()
        total = 0.0
        sums = []   # each replica's gradients (replicas > 1)
        for i, (xm, ym) in enumerate(zip(torch.from_numpy(x).chunk(micro_batches),
                                         torch.from_numpy(y).chunk(micro_batches))):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model(xm), ym)
            part = loss / micro_batches
            (scaler.scale(part) if scaler else part).backward()
            total += loss.item() / micro_batches
            if replicas > 1 and (i + 1) % (micro_batches // replicas) == 0:
                sums.append([p.grad for p in model.parameters()])
                opt.zero_grad(set_to_none=True)   # the next replica's start afresh
        if sums:
            for p, *grads in zip(model.parameters(), *sums):
                grads = [g for g in grads if g is not None]
                p.grad = functools.reduce(torch.add, grads) if grads else None
        loss = torch.tensor(total)
        if scaler:
            scaler.unscale_(opt)
        if cfg.train.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        if scaler:
            scaler.step(opt)  # skipped where unscale_ found an inf or NaN
            scaler.update()
        else:
            opt.step()
        out.append(loss.item())
    state = {f"blocks.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    return out, state


def reference_losses(cfg, steps: int) -> list[float]:
    return reference_run(cfg, steps)[0]


def blocked_in_wait(thread: threading.Thread, wait_s: float = 30.0) -> bool:
    """Whether ``thread`` is blocked in a condition's wait (its innermost frame is
    ``threading``'s ``wait``), polled until it is or ``wait_s`` has passed: the event a test
    acts on, instead of a guess at how long the thread takes to get there."""
    deadline = time.monotonic() + wait_s
    while thread.is_alive():
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return False


def spawn_ranks(target, nprocs: int, *args, timeout_s: float = 240.0) -> dict:
    """Run ``target(rank, port, *args, queue)`` in ``nprocs`` spawned processes (a gloo world on a
    free loopback port) and collect one ``(rank, status, value)`` from each: ``{rank: (status, value)}``."""
    import multiprocessing as mp

    from elastic_trainer.worker.process_group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=target, args=(r, port, *args, q)) for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        return dict((r, (status, val)) for r, status, val in (q.get(timeout=timeout_s) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def spawn_rank_cases(target, nprocs: int, ncases: int, expected: int, *args, timeout_s: float = 300.0) -> dict:
    """Run ``target(rank, ports, *args, queue)`` in ``nprocs`` spawned processes, ``ports`` a free
    loopback port per case (each case a gloo world of its own), and collect ``expected``
    ``(case, rank, status, value)`` reports, stopping at the first error: ``{case: {rank: (status, value)}}``."""
    import multiprocessing as mp

    from elastic_trainer.worker.process_group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [free_port("127.0.0.1") for _ in range(ncases)]
    procs = [ctx.Process(target=target, args=(r, ports, *args, q)) for r in range(nprocs)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        for _ in range(expected):
            i, rank, status, val = q.get(timeout=timeout_s)
            got.setdefault(i, {})[rank] = (status, val)
            if status == "error":
                break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def assert_ranks_match(ranks: dict, world: int, dp: int, reference) -> None:
    """The ranks of one case (``{rank: (status, (losses, state))}``) trained as the single-process
    ``reference`` (losses, state) did: the step's loss (the mean of the last stage's replicas') to
    1e-5, every parameter to 1e-4."""
    import numpy as np
    import pytest

    bad = {r: v for r, (s, v) in ranks.items() if s != "ok"}
    assert not bad and len(ranks) == world, bad or f"ranks reported: {sorted(ranks)}"
    ref_losses, ref_state = reference
    per_replica = [v[0] for s, v in ranks.values() if v[0][0] is not None]
    assert len(per_replica) == dp
    losses = np.mean(np.array(per_replica), axis=0)
    assert losses.tolist() == pytest.approx(ref_losses, rel=1e-5)
    state = {n: w for _, (_, st) in ranks.values() for n, w in st.items()}
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        np.testing.assert_allclose(state[name], ref.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)

