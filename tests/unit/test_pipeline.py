"""Pipeline semantics on small stage graphs with a FakeDevice: order, concurrency, retry,
rollback, adaptation, resume, consumption, cancellation, events and spans."""

from __future__ import annotations

import itertools
import threading

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.devices import FakeDevice
from bootstrap.pipeline import Pipeline, PipelineClosed, StageFailed
from bootstrap.pipeline.dependencies import GraphError
from bootstrap.pipeline.device_thread import DeviceThread
from bootstrap.pipeline.stage import Adaptation, Stage, on_oom
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.pipeline.undo import Undo


def alloc(device: FakeDevice, undo, nbytes: int, tag: str) -> None:
    handle = device.allocate(nbytes, tag)
    undo.push(device.free, handle)


def make(stages, device, **inputs):
    memory = InMemorySpanExporter()
    pipeline = Pipeline(stages, inputs, tracer_provider=make_tracer_provider(memory=memory), device=device)
    return pipeline, memory


def spans(memory, name):
    return [s for s in memory.get_finished_spans() if s.name == name]


@pytest.fixture
def device():
    return FakeDevice(total=10_000)


def chain(device):
    def first(seed, undo):
        alloc(device, undo, 100, "first")
        return seed + 1

    def second(a, undo):
        alloc(device, undo, 200, "second")
        return a * 10

    return [Stage("second", second, "b", retry=on_oom(3)), Stage("first", first, "a")]


async def test_order_comes_from_inputs_not_list_order(device):
    pipeline, _ = make(chain(device), device, seed=1)
    assert [s.id for s in pipeline.stages] == ["first", "second"]
    artifacts = await pipeline.run()
    assert artifacts["b"] == 20
    assert device.live() == {"first": 100, "second": 200}
    await pipeline.aclose()
    assert device.live() == {}


async def test_oom_retry_rolls_back_the_failed_attempt(device):
    device.inject_oom("second", 2)
    pipeline, memory = make(chain(device), device, seed=1)
    await pipeline.run()
    attempts = spans(memory, "bootstrap.stage.second.attempt")
    assert [a.attributes["bootstrap.attempt"] for a in attempts] == [1, 2, 3]
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "ERROR", "OK"]
    assert attempts[0].attributes["error.type"] == "DeviceOutOfMemory"
    (stage_span,) = spans(memory, "bootstrap.stage.second")
    assert stage_span.attributes["bootstrap.attempts"] == 3
    assert device.live() == {"first": 100, "second": 200}
    await pipeline.aclose()


async def test_rollback_releases_what_the_attempt_allocated_before_failing(device):
    def greedy(seed, undo):
        alloc(device, undo, 300, "greedy/a")
        alloc(device, undo, 300, "greedy/b")  # fails on the first attempt, after greedy/a
        return seed

    device.inject_oom("greedy/b", 1)
    observed = []
    stage = Stage("greedy", greedy, "g", retry=on_oom(2), adapt=lambda e, i: observed.append(dict(device.live())))
    pipeline, _ = make([stage], device, seed=0)
    await pipeline.run()
    assert observed == [{}]  # by the time adapt runs, the failed attempt's 300 bytes are back
    await pipeline.aclose()
    assert device.live() == {}


async def test_adaptation_changes_inputs_and_is_recorded(device):
    seen = []

    def sized(size, undo):
        seen.append(size)
        alloc(device, undo, size, "sized")
        return size

    def halve(exc, inputs):
        return Adaptation({"size": inputs["size"] // 2}, {"size": f"{inputs['size']} -> {inputs['size'] // 2}"})

    pipeline, memory = make([Stage("sized", sized, "out", retry=on_oom(4), adapt=halve)], device, size=80_000)
    artifacts = await pipeline.run()
    assert seen == [80_000, 40_000, 20_000, 10_000]
    assert artifacts["out"] == 10_000
    attempts = spans(memory, "bootstrap.stage.sized.attempt")
    assert "bootstrap.adapt.size" not in attempts[0].attributes
    assert attempts[1].attributes["bootstrap.adapt.size"] == "80000 -> 40000"
    assert attempts[3].attributes["bootstrap.adapt.size"] == "20000 -> 10000"
    await pipeline.aclose()


async def test_non_retryable_error_fails_at_once_and_keeps_earlier_artifacts(device):
    calls = []

    def broken(a):
        calls.append(a)
        if len(calls) == 1:
            raise ValueError("bad value")
        return "fixed"

    stages = [chain(device)[1], Stage("broken", broken, "c", retry=on_oom(3))]
    pipeline, memory = make(stages, device, seed=1)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert (info.value.stage, info.value.attempts) == ("broken", 1)
    assert isinstance(info.value.cause, ValueError) and "bad value" in str(info.value)
    assert pipeline.artifacts["a"] == 2 and device.live() == {"first": 100}
    assert pipeline.status["broken"].state == "failed"
    (root,) = spans(memory, "bootstrap.pipeline")
    assert root.status.status_code.name == "ERROR"
    artifacts = await pipeline.retry()
    assert artifacts["c"] == "fixed" and calls == [2, 2]
    assert len(spans(memory, "bootstrap.stage.first")) == 1  # not run again on resume
    await pipeline.aclose()


async def test_exhausted_retries_raise_stage_failed_and_retry_resumes(device):
    device.inject_oom("second", 3)
    pipeline, _ = make(chain(device), device, seed=1)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert info.value.attempts == 3 and device.live() == {"first": 100}
    artifacts = await pipeline.retry("second")
    assert artifacts["b"] == 20
    assert pipeline.status["first"].attempts == 1
    await pipeline.aclose()
    assert device.live() == {}


async def test_independent_stages_run_concurrently(device):
    barrier = threading.Barrier(2, timeout=5)

    def left(seed):
        barrier.wait()  # both must be inside at once, else this times out
        return "l"

    def right(seed):
        barrier.wait()
        return "r"

    # non-blocking stages run on the event loop; these await their own threads, so both are
    # in flight at once only if the pipeline starts them concurrently
    stages = [
        Stage("left", lambda seed: anyio.to_thread.run_sync(left, seed), "l", blocking=False),
        Stage("right", lambda seed: anyio.to_thread.run_sync(right, seed), "r", blocking=False),
    ]
    pipeline, _ = make(stages, device, seed=0)
    artifacts = await pipeline.run()
    assert (artifacts["l"], artifacts["r"]) == ("l", "r")


async def test_blocking_stages_share_one_device_thread(device):
    names = []

    def where(seed):
        names.append(threading.current_thread().name)
        return seed

    stages = [Stage("one", where, "x"), Stage("two", lambda x: where(x), "y")]
    pipeline, _ = make(stages, device, seed=0)
    await pipeline.run()
    assert len(set(names)) == 1 and names[0].startswith("bootstrap-device")
    assert threading.current_thread().name not in names


async def test_consumed_artifact_is_released_when_consumer_succeeds(device):
    def probe(seed, undo):
        alloc(device, undo, 500, "probe")
        return "probe"

    def measure(p):
        return dict(device.live())

    stages = [Stage("probe", probe, "p"), Stage("measure", measure, "m", consumes=("p",))]
    pipeline, _ = make(stages, device, seed=0)
    artifacts = await pipeline.run()
    assert artifacts["m"] == {"probe": 500} and device.live() == {} and "p" not in artifacts


async def test_retry_of_a_consumer_rebuilds_what_it_consumed(device):
    built = []

    def probe(seed, undo):
        built.append(1)
        alloc(device, undo, 500, "probe")
        return "probe"

    stages = [Stage("probe", probe, "p"), Stage("measure", lambda p: p, "m", consumes=("p",))]
    pipeline, _ = make(stages, device, seed=0)
    await pipeline.run()
    await pipeline.retry("measure")
    assert len(built) == 2 and device.live() == {}


async def test_cancellation_rolls_back_completed_stages_in_reverse_order(device):
    released = []
    started = anyio.Event()

    def a(seed, undo):
        alloc(device, undo, 100, "a")
        undo.push(released.append, "a")
        return "a"

    def b(a_out, undo):
        alloc(device, undo, 100, "b")
        undo.push(released.append, "b")
        return "b"

    async def hang(b_out):
        started.set()
        await anyio.sleep_forever()

    stages = [Stage("a", a, "a_out"), Stage("b", b, "b_out"), Stage("c", hang, "c_out", blocking=False)]
    pipeline, memory = make(stages, device, seed=0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pipeline.run)
        await started.wait()
        tg.cancel_scope.cancel()
    assert released == ["b", "a"]
    assert device.live() == {}
    assert {s.state for s in pipeline.status.values()} == {"cancelled"}
    (c_span,) = spans(memory, "bootstrap.stage.c")
    assert c_span.attributes["bootstrap.outcome"] == "cancelled"


async def test_a_closed_or_running_pipeline_refuses_to_run(device):
    started, release = anyio.Event(), anyio.Event()

    async def slow(seed):
        started.set()
        await release.wait()
        return seed

    pipeline, _ = make([Stage("slow", slow, "out", blocking=False)], device, seed=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pipeline.run)
        await started.wait()
        with pytest.raises(RuntimeError, match="already running"):
            await pipeline.run()
        release.set()
    await pipeline.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await pipeline.run()


async def test_stage_failed_keeps_the_original_traceback(device):
    def broken(seed):
        raise ValueError("deep cause")

    pipeline, _ = make([Stage("broken", broken, "out")], device, seed=1)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert info.value.__cause__ is info.value.cause
    assert info.value.cause.__traceback__ is not None


async def test_events_stream_reports_progress(device):
    device.inject_oom("second", 1)
    pipeline, _ = make(chain(device), device, seed=1)
    seen = []

    async def consume():
        async for event in pipeline.events():
            seen.append((event.stage, event.kind))

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await pipeline.run()
        await pipeline.aclose()
    assert seen == [
        ("first", "started"),
        ("first", "done"),
        ("second", "started"),
        ("second", "attempt_failed"),
        ("second", "retrying"),
        ("second", "done"),
    ]
    assert pipeline.status["second"].attempts == 2 and pipeline.status["second"].duration_s >= 0


@pytest.mark.parametrize(
    "stages, message",
    [
        ([Stage("x", lambda missing: 1, "x")], "needs ['missing']"),
        ([Stage("x", lambda seed: 1, "o"), Stage("x", lambda seed: 1, "p")], "duplicate stage id"),
        ([Stage("x", lambda y: 1, "x_out"), Stage("y", lambda x_out: 1, "y")], "cycle"),
        ([Stage("x", lambda seed: 1, "o", consumes=("seed2",))], "consumes 'seed2' without requiring it"),
    ],
)
def test_bad_graphs_are_rejected_up_front(stages, message, device):
    with pytest.raises(GraphError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Pipeline(stages, {"seed": 0})


async def test_a_function_after_a_stage_gets_what_it_names_inside_the_stage_span(device):
    """The owner of an input acts on a stage's result (the plan cache after capacity): once the
    stage succeeded, in its span, before the next stage starts; a stage that fails runs none."""
    seen, memory = [], InMemorySpanExporter()
    stages = [Stage("first", lambda seed: seed + 1, "a"), Stage("second", lambda a: a * 10, "b")]

    def after_first(seed, a):
        seen.append((seed, a, trace.get_current_span().name))

    pipeline = Pipeline(
        stages, {"seed": 1}, tracer_provider=make_tracer_provider(memory=memory), after={"first": after_first}
    )
    await pipeline.run()
    assert seen == [(1, 2, "bootstrap.stage.first")]
    await pipeline.aclose()

    def fails(seed):
        raise ValueError("no")

    pipeline = Pipeline([Stage("first", fails, "a")], {"seed": 1}, after={"first": after_first})
    with pytest.raises(StageFailed):
        await pipeline.run()
    assert len(seen) == 1
    await pipeline.aclose()


@pytest.mark.parametrize(
    "after, message",
    [
        ({"third": lambda a: None}, "after stage 'third', which is not in the graph"),
        ({"first": lambda b: None}, "after stage 'first' needs ['b'], neither its inputs nor its artifact"),
    ],
)
def test_a_function_after_an_unknown_stage_or_naming_what_it_lacks_is_rejected(after, message):
    stages = [Stage("first", lambda seed: seed + 1, "a"), Stage("second", lambda a: a * 10, "b")]
    with pytest.raises(GraphError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Pipeline(stages, {"seed": 0}, after=after)


async def test_runs_without_a_tracer_provider(device):
    """No provider configured: spans are non-recording, everything else works the same."""
    from bootstrap.pipeline.stage import Skip

    stages = [
        Stage("skipped", lambda seed: None, "a", skip=lambda seed: Skip("cached", "plan-cache")),
        Stage("counted", lambda a: len(a), "b", figures=lambda n: {"bootstrap.count": n}),
    ]
    pipeline = Pipeline(stages, {"seed": 0}, device=device)
    assert (await pipeline.run())["b"] == 6
    assert pipeline.status["skipped"].state == "skipped"
    assert pipeline.status["counted"].figures == {"bootstrap.count": 6}


async def test_a_late_subscriber_gets_the_history_and_then_the_end(device):
    pipeline, _ = make(chain(device), device, seed=1)
    await pipeline.run()
    await pipeline.aclose()
    with anyio.fail_after(5):
        kinds = [event.kind async for event in pipeline.events()]
    assert kinds == ["started", "done", "started", "done"]


async def test_attempts_restart_at_one_when_a_stage_is_retried(device):
    device.inject_oom("second", 3)
    pipeline, _ = make(chain(device), device, seed=1)
    with pytest.raises(StageFailed):
        await pipeline.run()
    assert pipeline.status["second"].attempts == 3
    await pipeline.retry()
    assert pipeline.status["second"].attempts == 1
    await pipeline.aclose()


async def test_cancel_during_a_consumed_release_still_releases_the_consumer(device):
    release_started = threading.Event()

    def probe(seed, undo):
        alloc(device, undo, 100, "probe")
        undo.push(lambda: (release_started.set(), __import__("time").sleep(0.2)))  # a slow release
        return "p"

    def scratch(seed, undo):
        alloc(device, undo, 50, "scratch")
        return "s"

    def measure(p, s, undo):
        alloc(device, undo, 200, "measure")
        return "m"

    async def never(m):
        await anyio.sleep_forever()

    stages = [
        Stage("probe", probe, "p"),
        Stage("scratch", scratch, "s"),
        Stage("measure", measure, "m", consumes=("p", "s")),
        Stage("wait", never, "w", blocking=False),
    ]
    pipeline, _ = make(stages, device, seed=0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pipeline.run)
        await anyio.to_thread.run_sync(release_started.wait)
        tg.cancel_scope.cancel()  # lands while measure releases the first of the two it consumes
    await pipeline.aclose()
    assert device.live() == {}


def held_open(device):
    """Two stages that allocate, then one that waits on ``gate`` (set it to let the run finish)."""
    started, gate = anyio.Event(), anyio.Event()

    def a(seed, undo):
        alloc(device, undo, 100, "a")
        return "a"

    async def wait(a_out):
        started.set()
        await gate.wait()
        return "w"

    def b(w_out, undo):
        alloc(device, undo, 200, "b")
        return "b"

    stages = [Stage("a", a, "a_out"), Stage("wait", wait, "w_out", blocking=False), Stage("b", b, "b_out")]
    return stages, started, gate


async def test_aclose_during_run_cancels_the_run_instead_of_a_false_success(device):
    stages, started, _ = held_open(device)
    pipeline, memory = make(stages, device, seed=0)
    outcome = []

    async def run():
        try:
            await pipeline.run()
            outcome.append("success")
        except PipelineClosed as exc:
            outcome.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await started.wait()
            await pipeline.aclose()
            assert outcome and isinstance(outcome[0], PipelineClosed)  # the run ended before aclose returned
    assert device.live() == {}
    assert {s.state for s in pipeline.status.values()} == {"cancelled"}
    (root,) = spans(memory, "bootstrap.pipeline")
    assert root.attributes["bootstrap.outcome"] == "cancelled"


async def test_aclose_right_after_the_last_stage_still_refuses_to_report_success(device):
    stages, started, gate = held_open(device)
    pipeline, _ = make(stages, device, seed=0)
    outcome = []

    async def run():
        try:
            outcome.append(await pipeline.run())
        except PipelineClosed as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await started.wait()
        gate.set()  # the run can finish now, but aclose comes before run() has returned
        await pipeline.aclose()
    assert isinstance(outcome[0], PipelineClosed) and device.live() == {}


@pytest.mark.parametrize("call", ["run", "retry", "retry_stage", "retry_unknown"])
async def test_a_call_during_a_run_is_refused_before_touching_any_state(device, call):
    stages, started, gate = held_open(device)
    pipeline, _ = make(stages, device, seed=0)
    attempt = {
        "run": lambda: pipeline.run(),
        "retry": lambda: pipeline.retry(),
        "retry_stage": lambda: pipeline.retry("a"),
        "retry_unknown": lambda: pipeline.retry("nope"),
    }[call]
    async with anyio.create_task_group() as tg:
        tg.start_soon(pipeline.run)
        await started.wait()
        before = (dict(device.live()), dict(pipeline.artifacts), dict(pipeline.status))
        with pytest.raises((RuntimeError, ValueError), match=r"already running|unknown stage"):
            await attempt()
        assert (dict(device.live()), dict(pipeline.artifacts), dict(pipeline.status)) == before
        gate.set()
    assert device.live() == {"a": 100, "b": 200}  # the first run finished with what it made
    assert {s.state for s in pipeline.status.values()} == {"done"}
    await pipeline.aclose()
    assert device.live() == {}


async def test_two_acloses_at_once_both_return_after_everything_is_released(device):
    pipeline, _ = make(chain(device), device, seed=1)
    await pipeline.run()
    seen = []

    async def close():
        await pipeline.aclose()
        seen.append(dict(device.live()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(close)
        tg.start_soon(close)
    assert seen == [{}, {}]


async def test_a_failing_release_does_not_stop_the_rest_and_is_recorded(device):
    def leaky(seed, undo):
        alloc(device, undo, 100, "leaky/first")
        undo.push(_raise, OSError("driver refused to free"))
        alloc(device, undo, 100, "leaky/last")
        raise ValueError("the attempt fails after three allocations")

    pipeline, memory = make([Stage("leaky", leaky, "out")], device, seed=0)
    with pytest.raises(StageFailed):
        await pipeline.run()
    assert device.live() == {}  # the releases before and after the failing one both ran
    (attempt,) = spans(memory, "bootstrap.stage.leaky.attempt")
    assert attempt.attributes["bootstrap.rollback.actions"] == 3
    assert attempt.attributes["bootstrap.rollback.errors"] == ("OSError('driver refused to free')",)


def _raise(exc):
    raise exc


def test_undo_runs_every_action_newest_first_and_returns_the_errors():
    done = []
    undo = Undo()
    undo.push(done.append, "first")
    undo.push(_raise, OSError("cannot free"))
    undo.push(done.append, "last")
    errors = undo.run()
    assert done == ["last", "first"] and [str(e) for e in errors] == ["cannot free"]
    assert len(undo) == 0 and undo.run() == []


async def test_closing_the_device_thread_leaves_the_event_loop_free():
    thread, gate, started = DeviceThread(), threading.Event(), threading.Event()
    opened_by = []
    timer = threading.Timer(10, lambda: (opened_by.append("timer"), gate.set()))  # only if the loop is stuck
    timer.start()

    def job():
        started.set()
        gate.wait()

    async def open_gate():
        opened_by.append("event loop")
        gate.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(thread.run, job)
        await anyio.to_thread.run_sync(started.wait)
        tg.start_soon(thread.aclose)  # waits for the job; must not block the loop meanwhile
        tg.start_soon(open_gate)
    timer.cancel()
    assert opened_by == ["event loop"]


async def test_a_skip_check_that_blocks_never_stalls_the_event_loop(device):
    """A skip check reads files (the plan cache): it runs in a worker thread, so the loop keeps
    answering (a health probe) while it blocks."""
    import time

    from bootstrap.pipeline.stage import Skip

    def slow_skip(seed):
        time.sleep(0.5)  # a read that blocks
        return Skip("cached", "plan-cache")

    pipeline = Pipeline([Stage("slow", lambda seed: None, "a", skip=slow_skip)], {"seed": 0}, device=device)
    ticks: list[float] = []

    async def probe() -> None:
        while True:
            ticks.append(time.monotonic())
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(probe)
        assert (await pipeline.run())["a"] == "cached"
        tg.cancel_scope.cancel()
    assert len(ticks) > 10 and max(b - a for a, b in itertools.pairwise(ticks)) < 0.25
