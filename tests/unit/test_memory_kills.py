"""The kernel's OOM-kill count of a process's memory cgroup, v1 and v2 (worker.memory_kills)."""

from elastic_trainer.worker.memory_kills import oom_kills


def test_v1_reads_the_memory_hierarchy_of_the_process(tmp_path):
    (tmp_path / "cg").write_text("12:freezer:/lab/h1\n4:memory:/lab/h1\n1:name=systemd:/x\n")
    d = tmp_path / "fs" / "memory" / "lab" / "h1"
    d.mkdir(parents=True)
    (d / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert oom_kills(str(tmp_path / "cg"), str(tmp_path / "fs")) == 3


def test_v2_reads_memory_events_of_the_unified_cgroup(tmp_path):
    (tmp_path / "cg").write_text("0::/lab/h2\n")
    d = tmp_path / "fs" / "lab" / "h2"
    d.mkdir(parents=True)
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n")
    assert oom_kills(str(tmp_path / "cg"), str(tmp_path / "fs")) == 2


def test_a_container_sees_its_own_cgroup_at_the_root(tmp_path):
    # /proc/self/cgroup names the host's path; the container mounts its own cgroup at the root.
    (tmp_path / "cg").write_text("0::/kubepods/pod123/abc\n")
    (tmp_path / "fs").mkdir()
    (tmp_path / "fs" / "memory.events").write_text("oom 1\noom_kill 1\n")
    assert oom_kills(str(tmp_path / "cg"), str(tmp_path / "fs")) == 1


def test_nothing_readable_is_none(tmp_path):
    assert oom_kills(str(tmp_path / "missing"), str(tmp_path)) is None
    (tmp_path / "cg").write_text("0::/x\n")
    assert oom_kills(str(tmp_path / "cg"), str(tmp_path / "nofs")) is None


def test_this_machine_answers_a_count_or_none():
    got = oom_kills()
    assert got is None or got >= 0


def test_the_limit_v1_v2_and_none(tmp_path):
    from elastic_trainer.worker.memory_kills import memory_limit

    (tmp_path / "cg1").write_text("4:memory:/lab/h1\n")
    d = tmp_path / "fs" / "memory" / "lab" / "h1"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text("1073741824\n")
    assert memory_limit(str(tmp_path / "cg1"), str(tmp_path / "fs")) == 1 << 30
    (d / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1's "no limit"
    assert memory_limit(str(tmp_path / "cg1"), str(tmp_path / "fs")) is None
    (tmp_path / "cg2").write_text("0::/lab/h2\n")
    d2 = tmp_path / "fs" / "lab" / "h2"
    d2.mkdir(parents=True)
    (d2 / "memory.max").write_text("max\n")
    assert memory_limit(str(tmp_path / "cg2"), str(tmp_path / "fs")) is None
    (d2 / "memory.max").write_text("536870912\n")
    assert memory_limit(str(tmp_path / "cg2"), str(tmp_path / "fs")) == 1 << 29


def test_growing_is_refused_where_nothing_limits_it(tmp_path):
    import pytest

    from elastic_trainer.worker.memory_kills import grow_until_killed

    (tmp_path / "cg").write_text("0::/x\n")
    (tmp_path / "fs" / "x").mkdir(parents=True)
    (tmp_path / "fs" / "x" / "memory.max").write_text("max\n")
    with pytest.raises(RuntimeError, match="needs a memory limit"):
        grow_until_killed(proc_cgroup=str(tmp_path / "cg"), root=str(tmp_path / "fs"))


def test_an_actor_rays_memory_monitor_killed_is_a_death_known_to_be_memorys():
    import ray

    from elastic_trainer.controller.failures.detect import diagnose
    from elastic_trainer.controller.stepping.one_step import StepOutcome

    oom = ray.exceptions.RayActorError(error_msg=(
        "The actor died unexpectedly before finishing this task.\nTask was killed due to the node running "
        "low on memory. Memory on the node was 30.1GB / 31.5GB (0.955), which exceeds the memory usage "
        "threshold of 0.95."))
    other = ray.exceptions.RayActorError(error_msg="The actor died unexpectedly before finishing this task.")
    diag = diagnose(StepOutcome(step=7, started=0.0, errors={1: oom, 2: other}), {}, 1.0)
    assert diag.kind == "death" and diag.dead == [1, 2] and diag.memory == [1]
    assert "killed by Ray for its node's memory" in diag.detail


def test_a_count_that_rose_on_the_dead_workers_node_is_a_memory_kill_and_avoids_that_node():
    import ray
    from types import SimpleNamespace

    from elastic_trainer.controller.failures.memory_kills import MemoryKills
    from elastic_trainer.controller.run.workers import WorkerHandle

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    try:
        node = ray.get_runtime_context().get_node_id()
        now = oom_kills()
        if now is None:
            import pytest
            pytest.skip("this machine's memory cgroup cannot be read")
        avoided = []
        memory = MemoryKills(SimpleNamespace(avoid=lambda n: avoided.append(n) or [9]))
        # Worker 1 joined when the count was one lower: it rose since, on its node. Worker 2
        # joined at today's count; worker 3 had no limit (never asked).
        memory.watch([WorkerHandle(1, None, node, 11, "127.0.0.1", rank=3, oom_kills=now - 1, memory_limit=1 << 30),
                      WorkerHandle(2, None, node, 12, "127.0.0.1", rank=2, oom_kills=now, memory_limit=1 << 30),
                      WorkerHandle(3, None, node, 13, "127.0.0.1", rank=1, oom_kills=now - 1)], step=6, failure=2)
        found = memory.poll(wait_s=60)
        assert [(e["worker"], e["step"], e["failure"], e["oom_kills"], e["let_go"]) for e in found] == \
            [(1, 6, 2, 1, [9])]
        assert avoided == [node] and "OOM killer" in found[0]["detail"] and memory.poll() == []
    finally:
        if started:
            ray.shutdown()
