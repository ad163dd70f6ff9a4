"""RolloutFleet.close with the publisher's close: every transport, node sender and server is closed even
when one of them raises."""

from __future__ import annotations

import pytest

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()   # as `megatron-rl train` does: the fleet imports the actor and the weight sync
from megatron_rl.train.fleet import RolloutFleet  # noqa: E402
from megatron_rl.train.publisher import WeightPublisher  # noqa: E402


class Part:
    def __init__(self, name: str, done: list[str], fails: bool = False) -> None:
        self.name, self.done, self.fails = name, done, fails

    def close(self) -> None:
        self.done.append(self.name)
        if self.fails:
            raise OSError(f"{self.name} failed")

    stop = close


class Supervisor:
    closed = False


def fleet(done: list[str], failing: str) -> tuple[RolloutFleet, WeightPublisher]:
    f = RolloutFleet.__new__(RolloutFleet)          # the parts only: no process group needed
    f.supervisors = [Supervisor(), Supervisor()]
    p = WeightPublisher.__new__(WeightPublisher)
    p.links = [Part(n, done, n == failing) for n in ("transport-0", "transport-1")]
    p.transport, p._pool = p.links[0], None          # a link-per-server transport, no overlap pool
    f.servers = [Part(n, done, n == failing) for n in ("server-0", "server-1")]
    f.own_server = Part("own", done, failing == "own")
    p.node_sender = Part("node-sender", done, failing == "node-sender")    # this node's /dev/shm copy
    return f, p


@pytest.mark.parametrize("failing", ["transport-0", "node-sender", "server-0", "own"])
def test_one_part_failing_to_close_still_closes_the_rest_and_raises(failing: str) -> None:
    done: list[str] = []
    f, p = fleet(done, failing)
    with pytest.raises(OSError, match=f"{failing} failed"):
        f.close(p.close)
    assert done == ["transport-0", "transport-1", "node-sender", "server-0", "server-1", "own"]
    assert all(s.closed for s in f.supervisors)
