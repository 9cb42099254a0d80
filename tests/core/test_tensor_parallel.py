"""The parts of tensor parallelism that need no second process: the [runner] config, the ranks'
addresses, the per-rank KV share, the stall watchdog and the shard refusal."""

from __future__ import annotations

import dataclasses

import pytest

from actors.model_runner import tensor_parallel
from models.info import ModelInfo
from models.sizing import kv_bytes_per_token, kv_capacity
from protocol.config import ConfigError, load_config
from protocol.transport import actor_name, derive_addresses, graph_actors, ipc_files, parse_name


def cfg(*sets: str):
    return load_config(None, list(sets))


def test_runner_config_checks_hosts_and_ports():
    assert cfg().runner.tp == 1
    with pytest.raises(ConfigError, match=r"runner.hosts: one IP per rank, got 1 for tp = 2"):
        cfg("runner.tp=2", 'runner.hosts=["10.0.0.1"]')
    with pytest.raises(ConfigError, match="several machines need a fixed first port"):
        cfg("runner.tp=2", 'runner.hosts=["10.0.0.1", "10.0.0.2"]')
    with pytest.raises(ConfigError, match=r"ports 65535\.\.65536"):
        cfg("runner.tp=2", "runner.port=65535")
    with pytest.raises(ConfigError, match=r"\$\.runner\.backend"):
        cfg("runner.backend=nccl")
    assert cfg("runner.tp=2", 'runner.hosts=["10.0.0.1", "10.0.0.2"]',
               "runner.port=5000").runner.hosts == ["10.0.0.1", "10.0.0.2"]


def test_one_machine_ranks_get_ipc_inboxes_and_distinct_free_ring_ports(tmp_path):
    addrs = derive_addresses(cfg("runner.tp=3"), str(tmp_path))
    assert graph_actors(cfg("runner.tp=3")) == ["tokenizer", "scheduler", "runner", "runner-1",
                                                 "runner-2", "detokenizer"]
    assert addrs.inbox("runner-2") == f"ipc://{tmp_path}/runner-2"
    assert addrs.inbox("runner") == f"ipc://{tmp_path}/runner"
    [ring] = addrs.ring
    hosts = {e.rsplit(":", 1)[0] for e in ring}
    ports = {int(e.rsplit(":", 1)[1]) for e in ring}
    assert hosts == {"127.0.0.1"} and len(ports) == 3 and 0 not in ports
    assert {p.name for p in ipc_files(addrs)} >= {"runner-1", "runner-2"}
    assert derive_addresses(cfg(), str(tmp_path)).extra == {}


def test_ranks_on_several_machines_listen_on_fixed_ports(tmp_path):
    c = cfg("runner.tp=2", 'runner.hosts=["10.0.0.1", "fd00::2"]', "runner.port=6000")
    addrs = derive_addresses(c, str(tmp_path))
    assert addrs.ring == [["10.0.0.1:6000", "[fd00::2]:6001"]]
    assert addrs.extra == {"runner-1": "tcp://[fd00::2]:6003"}  # port + tp + rank
    assert all(p.name != "runner-1" for p in ipc_files(addrs))


def test_each_rank_accounts_its_share_of_the_kv_heads():
    info = ModelInfo(path="/m", name="m", context_length=4096, eos_ids=[1], vocab_size=10,
                     model_type="qwen3", kv_bytes_per_token=8192, kv_value_bytes=2)
    assert kv_bytes_per_token(cfg("runner.tp=2"), info) == 4096
    assert kv_bytes_per_token(cfg("runner.tp=2", "runtime.activations=float32"), info) == 8192
    # On one machine the ranks split its memory too: the same tokens as one rank.
    one = kv_capacity(cfg("memory.kv_fraction=0.01"), info)
    assert kv_capacity(cfg("memory.kv_fraction=0.01", "runner.tp=2"), info) in (one - 1, one)


def test_actor_names_of_replicas_and_ranks():
    names = graph_actors(cfg("runner.tp=2", "scheduler.dp=2"))
    assert names == ["tokenizer", "scheduler", "scheduler.1", "runner", "runner-1", "runner.1",
                     "runner.1-1", "detokenizer"]
    assert [parse_name(n) for n in names[1:-1]] == [
        ("scheduler", 0, 0), ("scheduler", 1, 0), ("runner", 0, 0), ("runner", 0, 1),
        ("runner", 1, 0), ("runner", 1, 1)]
    assert all(actor_name(*parse_name(n)) == n for n in names)


def test_replicas_on_several_machines_take_their_own_ports(tmp_path):
    c = cfg("runner.tp=2", "scheduler.dp=2", 'runner.hosts=["10.0.0.1", "10.0.0.2"]',
            "runner.port=6000")
    addrs = derive_addresses(c, str(tmp_path))
    assert addrs.ring == [["10.0.0.1:6000", "10.0.0.2:6001"], ["10.0.0.1:6004", "10.0.0.2:6005"]]
    assert addrs.inbox("runner-1") == "tcp://10.0.0.2:6003"
    assert addrs.inbox("runner.1-1") == "tcp://10.0.0.2:6007"
    assert addrs.inbox("scheduler.1") == f"ipc://{tmp_path}/scheduler.1"


def test_watchdog_flags_only_a_busy_rank_past_its_timeout():
    dog = tensor_parallel.Watchdog(timeout_s=5.0)
    start = dog.beat_at
    assert dog.stalled_for(start + 100) == 0.0  # idle: waiting for work is not a stall
    dog.waiting(False)
    busy_from = dog.beat_at
    assert dog.stalled_for(busy_from + 4.9) == 0.0
    assert dog.stalled_for(busy_from + 6.0) == pytest.approx(6.0)
    dog.beat()  # a step finished: the clock starts again
    assert dog.stalled_for(dog.beat_at + 4.9) == 0.0


@dataclasses.dataclass
class _Group:
    n: int

    def size(self) -> int:
        return self.n


class NoShard:
    pass


def test_a_model_class_without_shard_is_refused_by_name():
    with pytest.raises(ValueError, match=r"runner.tp = 2: the model class "
                                         r"tests.core.test_tensor_parallel.NoShard has no shard"):
        tensor_parallel.shard(NoShard(), _Group(2))


class Args:
    num_attention_heads, num_key_value_heads, intermediate_size = 8, 4, 96


class Sharded:
    args = Args()

    def shard(self, group):
        raise AssertionError("must be refused before sharding")


def test_a_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match=r"runner.tp = 8 does not divide the model's "
                                         r"num_key_value_heads \(4\)"):
        tensor_parallel.shard(Sharded(), _Group(8))
    tensor_parallel.check_divisible(Sharded(), 4)  # 8, 4 and 96 all split in 4


def test_tp1_joins_no_group(tmp_path):
    c = cfg()
    assert tensor_parallel.join(c, derive_addresses(c, str(tmp_path)), 0, 0) is None


def test_the_main_launcher_leaves_out_ranks_of_other_hosts():
    from launch.cli import chosen_actors

    c = cfg("runner.tp=2", 'runner.hosts=["10.0.0.1", "10.0.0.2"]', "runner.port=7000")
    assert chosen_actors(c, "", "") == ["tokenizer", "scheduler", "runner", "detokenizer"]
    assert chosen_actors(c, "runner-1", "") == ["runner-1"]
    assert "runner-1" in chosen_actors(cfg("runner.tp=2"), "", "")
    # Loopback addresses, however written, are this machine: every rank starts here.
    here = cfg("runner.tp=2", 'runner.hosts=["127.0.0.1", "localhost"]')
    assert here.runner.on_one_host() and here.runners_here() == 2
    assert "runner-1" in chosen_actors(here, "", "")
    assert chosen_actors(cfg("scheduler.dp=2"), "", "scheduler.1,runner.1") == [
        "tokenizer", "scheduler", "runner", "detokenizer"]
    with pytest.raises(ConfigError, match="no actor runner-3 in this graph"):
        chosen_actors(c, "runner-3", "")


def test_config_inboxes_move_an_edge_to_tcp(tmp_path):
    c = cfg('server.inboxes={"scheduler" = "tcp://10.0.0.5:7100", "runner-1" = '
            '"tcp://10.0.0.6:7101"}', "runner.tp=2")
    addrs = derive_addresses(c, str(tmp_path))
    assert addrs.inbox("scheduler") == "tcp://10.0.0.5:7100"
    assert addrs.inbox("runner-1") == "tcp://10.0.0.6:7101"
    with pytest.raises(ConfigError, match=r"server.inboxes.runner: 'udp://x' is not"):
        cfg('server.inboxes={"runner" = "udp://x"}')
    with pytest.raises(ValueError, match="no actor 'runner-5'"):
        derive_addresses(cfg('server.inboxes={"runner-5" = "tcp://1.2.3.4:5"}'), str(tmp_path))


def test_runner_processes_on_one_machine_split_its_cores(monkeypatch):
    from actors.model_runner import entry

    for var in entry.THREAD_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(entry.os, "cpu_count", lambda: 8)
    assert entry.share_cores(cfg()) is None and "MKL_NUM_THREADS" not in entry.os.environ
    assert entry.share_cores(cfg("runner.tp=2", "scheduler.dp=2")) == 2
    assert entry.os.environ["MKL_NUM_THREADS"] == entry.os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("MKL_NUM_THREADS", "3")  # the user's own choice wins
    entry.share_cores(cfg("runner.tp=4"))
    assert entry.os.environ["MKL_NUM_THREADS"] == "3"
    # Ranks on other machines have their machine to themselves.
    assert entry.share_cores(cfg("runner.tp=2", 'runner.hosts=["10.0.0.1", "10.0.0.2"]',
                                 "runner.port=6000")) is None
