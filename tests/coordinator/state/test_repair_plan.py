"""The repair planner's rules on plain inputs (it is pure: no Redis, no nodes)."""

from __future__ import annotations

from coordinator.state.liveness import DEAD, DOWN, UP, NodeHealth
from coordinator.state.repair_plan import TRIM, Blob, plan
from coordinator.state.repairs import InFlight
from smoltorrent import defaults

GB = 10**9


def health(**states: str) -> dict[str, NodeHealth]:
    return {n: NodeHealth(n, s, 0.0) for n, s in states.items()}


def blob(d: str, replicas: int = 2) -> Blob:
    return Blob(d, 1000, replicas, ("ckpt",))


def decide(blobs, placement, nodes, busy=(), per_node=2, max_in_flight=10, free=None, backoff=None):
    free = free or {n: GB for n in nodes}
    return plan(
        {b.digest: b for b in blobs},
        placement,
        nodes,
        free,
        list(busy),
        per_node=per_node,
        max_in_flight=max_in_flight,
        backoff=backoff,
    )


def test_copies_on_dead_nodes_do_not_count_and_on_down_nodes_do():
    nodes = health(a=UP, b=DEAD, c=UP, d=DOWN)
    p = decide([blob("x"), blob("y")], {"x": {"a", "b"}, "y": {"a", "d"}}, nodes)
    assert [(r.digest, r.source, r.target) for r in p.repairs] == [("x", "a", "c")]


def test_the_last_copy_goes_before_the_second_under_a_throttle():
    nodes = health(a=UP, b=UP, c=UP, z=DEAD)
    blobs = [blob("two", replicas=3), blob("one", replicas=3)]
    placement = {"two": {"a", "b"}, "one": {"c", "z"}}
    p = decide(blobs, placement, nodes, max_in_flight=1)
    assert [r.digest for r in p.repairs] == ["one"]
    assert p.throttled >= 1


def test_never_a_target_that_holds_or_is_receiving_a_copy():
    nodes = health(a=UP, b=UP, c=UP, d=UP)
    busy = [InFlight("x", "b", "a", 1000, 0.0, 1e18)]
    p = decide([blob("x", replicas=4)], {"x": {"a"}}, nodes, busy=busy, per_node=5)
    targets = [r.target for r in p.repairs]
    assert sorted(targets) == ["c", "d"]
    assert len(set(targets)) == len(targets)


def test_one_node_takes_part_in_at_most_per_node_sessions_its_blobs_travel_together():
    nodes = health(a=UP, b=UP, c=UP, d=UP, z=DEAD)
    blobs = [blob(f"x{i}") for i in range(4)]
    placement = {f"x{i}": {"a", "z"} for i in range(4)}
    p = decide(blobs, placement, nodes, per_node=1)
    # Every copy needs a, which takes part in one session at a time: all four go in it.
    assert [[(r.digest, r.source) for r in s] for s in p.sessions()] == [
        [("x0", "a"), ("x1", "a"), ("x2", "a"), ("x3", "a")]
    ]
    assert len({r.target for r in p.repairs}) == 1 and p.throttled == 0
    # A session of a's already in flight: nothing more touches a.
    busy = [InFlight("y", "b", "a", 1000, 0.0, 1e18, session="y:b")]
    p = decide(blobs, placement, nodes, busy=busy, per_node=1)
    assert p.repairs == [] and p.throttled == 4


def test_a_holder_that_sends_nothing_opens_its_own_session_the_others_join():
    nodes = health(a=UP, b=UP, c=UP, z=DEAD)
    blobs = [blob(f"a{i}") for i in range(3)] + [blob(f"b{i}") for i in range(3)]
    placement = {
        **{f"a{i}": {"a", "z"} for i in range(3)},
        **{f"b{i}": {"b", "z"} for i in range(3)},
    }
    p = decide(blobs, placement, nodes, per_node=2, max_in_flight=2)
    # Each node paces its own pushes: two senders move twice the bytes one would.
    sessions = p.sessions()
    assert [sorted(r.digest for r in s) for s in sessions] == [
        ["a0", "a1", "a2"],
        ["b0", "b1", "b2"],
    ]
    assert {(s[0].source, len({r.target for r in s})) for s in sessions} == {("a", 1), ("b", 1)}
    # Copies of one session's records count it once: a second plan opens no other.
    busy = [
        InFlight(r.digest, r.target, r.source, r.size, 0.0, 1e18, session=f"s{r.session}")
        for r in p.repairs
    ]
    more = [blob(f"a{i}") for i in range(3, 5)]
    again = decide(more, {b.digest: {"a", "z"} for b in more}, nodes, busy=busy, max_in_flight=2)
    assert again.repairs == [] and again.throttled == 2


def test_a_session_stops_at_its_byte_and_blob_limits():
    nodes = health(a=UP, b=UP, z=DEAD)
    big = defaults.REPAIR_BATCH_BYTES // 2 + 1
    blobs = [Blob(f"x{i}", big, 2, ("ckpt",)) for i in range(3)]
    placement = {b.digest: {"a", "z"} for b in blobs}
    p = decide(blobs, placement, nodes, per_node=10, free={"a": GB, "b": GB})
    assert [len(s) for s in p.sessions()] == [1, 1, 1]  # two would pass the byte limit
    many = [blob(f"y{i:04}") for i in range(defaults.REPAIR_BATCH_BLOBS + 1)]
    p = decide(many, {b.digest: {"a", "z"} for b in many}, nodes, per_node=10)
    assert [len(s) for s in p.sessions()] == [defaults.REPAIR_BATCH_BLOBS, 1]


def test_fewer_live_nodes_than_r_is_unrepairable_and_sends_nothing():
    nodes = health(a=UP, b=DEAD)
    p = decide([blob("x")], {"x": {"a", "b"}}, nodes)
    assert p.repairs == []
    assert "1 live node(s) for 2 copies" in p.unrepairable["x"]["reason"]


def test_no_space_and_no_reachable_copy_are_unrepairable():
    nodes = health(a=UP, b=UP, c=DOWN, z=DEAD)
    p = decide(
        [blob("full"), blob("far")],
        {"full": {"a", "z"}, "far": {"c", "z"}},
        nodes,
        free={"a": GB, "b": 10},
    )
    assert p.repairs == []
    assert "bytes free" in p.unrepairable["full"]["reason"]
    assert "no copy on a node that answers" in p.unrepairable["far"]["reason"]


def test_surplus_on_up_nodes_is_trimmed_unless_a_step_is_in_flight():
    nodes = health(a=UP, b=UP, c=UP)
    assert decide([blob("x")], {"x": {"a", "b", "c"}}, nodes).trims == ["x"]
    busy = [InFlight("x", TRIM, "", 0, 0.0, 1e18)]
    assert decide([blob("x")], {"x": {"a", "b", "c"}}, nodes, busy=busy).trims == []


def test_a_trim_in_flight_is_no_copy_arriving():
    """A blob with a trim on its way (decided when it had a copy to spare) that then lost a
    copy to a dead node is repaired: the trim brings no copy. Counted as one, a fault run's
    shared blob stayed at one copy while a trim record, its message lost with a Redis
    killed after the claim, lived out its hour."""
    nodes = health(a=UP, b=UP, c=UP, d=DEAD)
    busy = [InFlight("x", TRIM, "", 0, 0.0, 1e18)]
    p = decide([blob("x")], {"x": {"a", "d"}}, nodes, busy=busy)
    assert [(r.digest, r.source) for r in p.repairs] == [("x", "a")]
    assert p.trims == []


def test_a_target_backing_off_is_skipped_for_another_or_waits_not_unrepairable():
    nodes = health(a=UP, b=DEAD, c=UP, d=UP)
    p = decide([blob("x")], {"x": {"a", "b"}}, nodes, backoff={"x": {"d"}})
    assert [(r.source, r.target) for r in p.repairs] == [("a", "c")]
    p = decide([blob("x")], {"x": {"a", "b"}}, nodes, backoff={"x": {"c", "d"}})
    assert p.repairs == [] and p.unrepairable == {} and p.waiting == 1


def test_a_blob_a_pending_store_is_placing_is_never_trimmed():
    nodes = health(a=UP, b=UP, c=UP)
    placing = Blob("x", 1000, 2, ("ckpt",), placing=True)
    assert decide([placing], {"x": {"a", "b", "c"}}, nodes).trims == []
    assert decide([blob("x")], {"x": {"a", "b", "c"}}, nodes).trims == ["x"]


def test_after_fewest_copies_a_pinned_or_current_versions_blobs_then_the_newest():
    nodes = health(a=UP, b=UP, c=UP, d=UP, z=DEAD)
    blobs = [
        Blob("a-old", 1000, 3, ("ckpt",), newest=1),
        Blob("b-new", 1000, 3, ("ckpt",), newest=5),
        Blob("c-kept", 1000, 3, ("ckpt",), favoured=True, newest=0),
        Blob("d-last", 1000, 3, ("ckpt",), newest=0),
    ]
    two = {"a", "b", "z"}  # two copies that count
    placement = {"a-old": two, "b-new": two, "c-kept": two, "d-last": {"a", "z"}}
    p = decide(blobs, placement, nodes, per_node=10)
    assert [r.digest for r in p.repairs] == ["d-last", "d-last", "c-kept", "b-new", "a-old"]


def test_three_survivors_of_a_lost_node_each_send_one_session_at_the_defaults():
    """The lost node's blobs have their other copies on every survivor (plan/placement.py):
    at the default caps each survivor sends one session and receives one, so all three
    ports carry the repair (issue 37, the Pi emulation)."""
    nodes = health(a=UP, b=UP, c=UP, z=DEAD)
    blobs, placement = [], {}
    for i in range(12):
        holder = "abc"[i % 3]
        blobs.append(blob(f"{holder}{i:02}"))
        placement[f"{holder}{i:02}"] = {holder, "z"}
    p = decide(
        blobs,
        placement,
        nodes,
        per_node=defaults.REPAIRS_PER_NODE,
        max_in_flight=defaults.REPAIRS_MAX_IN_FLIGHT,
    )
    sessions = p.sessions()
    assert sorted(s[0].source for s in sessions) == ["a", "b", "c"]
    assert sorted(s[0].target for s in sessions) == ["a", "b", "c"]
    assert p.throttled == 0
