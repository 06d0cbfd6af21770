"""The event hub a server keeps for weeks of operations: its history keeps the newest events
only, and a reader's place in it (``since``) survives what it forgets."""

from __future__ import annotations

from bootstrap.pipeline.events import EventHub, StageEvent


def published(hub: EventHub, count: int, start: int = 0) -> None:
    for n in range(start, start + count):
        hub.publish(StageEvent("load_model", "started", attempt=n))


def test_the_history_keeps_the_newest_events_and_a_reader_misses_none_of_them():
    hub = EventHub(["load_model"], keep=8)
    published(hub, 5)
    seen, cursor = hub.since(0)
    assert [e.attempt for e in seen] == [0, 1, 2, 3, 4] and cursor == 5
    published(hub, 10, start=5)  # past what is kept: the oldest are forgotten
    assert len(hub.history) <= 8 and hub.history[-1].attempt == 14
    seen, cursor = hub.since(cursor)
    assert [e.attempt for e in seen] == list(range(5, 15))[-len(seen) :] and cursor == 15
    assert [e.attempt for e in seen] == [e.attempt for e in hub.history][-len(seen) :]
    assert hub.since(cursor) == ([], 15)  # nothing new: nothing again


def test_a_reader_that_kept_up_gets_every_event_once_however_often_the_history_is_cut():
    hub, cursor, got = EventHub(["load_model"], keep=4), 0, []
    for n in range(50):
        published(hub, 1, start=n)
        seen, cursor = hub.since(cursor)
        got += [e.attempt for e in seen]
    assert got == list(range(50)) and hub.forgotten + len(hub.history) == 50
