"""A job from the swarm may not name a local path, and only its origin speaks for it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from atomd.config import Settings
from atomd.db import migrate, repo
from atomd.db.connection import make_engine, make_sessionmaker
from atomd.jobs import JobManager
from atomd.jobs.admission import advert_data_problem, advert_problem, local_data
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Update
from atomd.p2p.messages import JobAdvert, advert_forgery, job_id_for, sign_advert
from atomd.spec import JobSpec
from atomd.telemetry import Telemetry


async def _manager(tmp_path: Path) -> tuple[JobManager, Any, Any]:
    """A job manager on a migrated database under ``tmp_path``: (manager, sessions, engine)."""
    settings = Settings(data_dir=tmp_path / "d", device="cpu")
    await asyncio.to_thread(migrate.upgrade, settings.db_path)
    engine = make_engine(settings.db_path)
    sessions = make_sessionmaker(engine)
    jobs = JobManager(jobs_dir=settings.jobs_dir, sessions=sessions, telemetry=Telemetry(),
                      device="cpu", peer_id="p" * 32)  # fmt: skip
    return jobs, sessions, engine


async def _why_not_joined(
    jobs: JobManager, sessions: Any, engine: Any, spec: dict[str, Any]
) -> str:
    """Run ``jobs``, offer it a job of ``spec``, and say why it did not join (its first
    ``job.refused`` event); asserts that it joined nothing. Stops ``jobs`` and ``engine``."""
    task = asyncio.create_task(jobs.run())
    await jobs.wait_started()
    try:
        advert = JobAdvert.model_validate({"id": "a" * 32, "spec": spec})
        events = await _refusals_of(jobs, sessions, advert)
        assert events, "no job.refused event"
        assert jobs.active is None
        async with sessions() as s:
            assert await repo.get_job(s, job_id="a" * 32) is None
        return str(events[0].message)
    finally:
        await jobs.shutdown()
        await task
        await engine.dispose()


async def _refusals_of(jobs: JobManager, sessions: Any, advert: JobAdvert) -> list[Any]:
    """Offer ``advert`` to a running ``jobs`` and wait (up to 4 s) for its ``job.refused``."""
    jobs.offer(advert, ["http://127.0.0.1:1"])
    for _ in range(200):
        async with sessions() as s:
            events = await repo.list_events(s, kind="job.refused")
        if events:
            return list(events)
        await asyncio.sleep(0.02)
    return []


def test_only_the_bundled_corpus_or_registered_names() -> None:
    names = {"wiki": "/srv/data/wiki.bin"}
    assert advert_data_problem("shakespeare", names) is None
    assert advert_data_problem("wiki", names) is None
    for path in ("/etc/passwd", "/home/me/secret.txt", "../x.bin", "wiki.bin"):
        why = advert_data_problem(path, names)
        assert why is not None and "may not name a local path" in why and "wiki" in why
    spec = JobSpec(preset="tiny", data="wiki")
    assert local_data(spec, names).data == "/srv/data/wiki.bin"
    assert local_data(JobSpec(preset="tiny"), names).data == "shakespeare"


def test_no_field_of_an_advert_names_a_local_file(tmp_path: Path) -> None:
    """Tokenizer and initial weights are local files too: an advert may not name them."""
    (tmp_path / "tokenizer.json").write_text("{}")
    ok = JobSpec(preset="tiny", tokenizer="default", vocab_size=4096)
    assert advert_problem(ok, {}) is None
    by_path = ok.model_copy(update={"tokenizer": str(tmp_path / "tokenizer.json")})
    assert "may only use 'bytes' or 'default'" in (advert_problem(by_path, {}) or "")
    weights = ok.model_copy(update={"init_from": str(tmp_path)})
    assert "may not name a local path" in (advert_problem(weights, {}) or "")
    data = ok.model_copy(update={"data": "/etc/passwd"})
    assert "may not name a local path" in (advert_problem(data, {}) or "")


async def test_an_advert_naming_a_path_is_not_joined(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the operator's private notes " * 1000)
    jobs, sessions, engine = await _manager(tmp_path)
    why = await _why_not_joined(jobs, sessions, engine, {"preset": "tiny", "data": str(secret)})
    assert "may not name a local path" in why


async def test_only_its_origin_stops_a_job_on_every_peer(tmp_path: Path) -> None:
    """A stop heard from the swarm ends this daemon's copy only if the job's origin sent it:
    from any member, one message each would end every peer's copy of every job, for good (a
    stopped job is not joined again). An operator of another peer
    is told so, and can stop its own copy."""
    from types import SimpleNamespace

    from atomd.errors import JobConflictError
    from atomd.jobs.active import ActiveJob

    jobs, sessions, engine = await _manager(tmp_path)
    origin, job_id = "o" * 32, "a" * 32
    stops: list[str] = []
    jobs.swarm = SimpleNamespace(broadcast_stop=stops.append)  # type: ignore[assignment]
    try:
        async with sessions() as s, s.begin():
            await repo.create_job(s, job_id=job_id, spec={}, out_dir="/x", state="running",
                                  scope="swarm", origin=origin)  # fmt: skip
        active = ActiveJob(job_id, JobSpec(preset="tiny"), tmp_path, False, "swarm", origin)
        jobs.active = active
        with pytest.raises(JobConflictError, match="only its origin"):
            await jobs.stop_from_peer(job_id, "m" * 32)
        assert active.stop_reason is None and not active.stop_event.is_set()
        with pytest.raises(JobConflictError, match="only its origin stops it on every peer"):
            await jobs.stop(job_id, scope="swarm")
        assert stops == [] and active.stop_reason is None
        await jobs.stop_from_peer(job_id, origin)
        assert active.stop_event.is_set() and "stopped by the swarm" in str(active.stop_reason)
    finally:
        jobs.active = None
        await engine.dispose()


async def test_a_job_whose_checkpoints_would_not_fit_the_disk_is_not_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member's advert chooses how many checkpoints every joiner keeps (up to 1,000): a
    joiner checks they fit its free disk first, and says why it does not join."""
    import shutil

    from atomd.jobs import admission
    from atomd.jobs.admission import CHECKPOINT_MODEL_SIZES, disk_problem
    from atomd.model.config import num_parameters

    jobs, sessions, engine = await _manager(tmp_path)
    bound = CHECKPOINT_MODEL_SIZES * 4 * num_parameters(JobSpec(preset="tiny").model_shape)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(admission.shutil, "disk_usage",
                        lambda path: usage._replace(free=10 * bound))  # fmt: skip
    assert disk_problem(JobSpec(preset="tiny", keep_checkpoints=3), jobs.jobs_dir) is None
    spec = {"preset": "tiny", "keep_checkpoints": 1000}
    assert "keeping 1000 checkpoints" in await _why_not_joined(jobs, sessions, engine, spec)


def _signed(origin: Identity, spec: JobSpec | None = None) -> JobAdvert:
    """A job of ``origin``'s, its advert signed by it."""
    advert = JobAdvert(id=job_id_for(origin.peer_id), spec=spec or JobSpec(preset="tiny"))
    return sign_advert(advert, origin, "default")


def test_an_advert_is_believed_only_as_its_origin_made_it() -> None:
    """A job's advert names its origin, and the origin signed the job id and the spec every
    peer trains alike. A member that passed it on could otherwise record itself as the origin
    of another's job (and then stop every joiner's copy) or change the spec it passes on."""
    origin, evil = Identity.generate(), Identity.generate()
    honest = _signed(origin)
    assert advert_forgery(honest, "default") is None
    # A joiner passes it on with its own data shard: still the origin's.
    sharded = honest.model_copy(update={"spec": honest.spec.model_copy(
        update={"num_shards": 4, "shard_index": 3})})  # fmt: skip
    assert advert_forgery(sharded, "default") is not None, "num_shards is the origin's"
    four = _signed(origin, JobSpec(preset="tiny", num_shards=4))
    mine = four.model_copy(update={"spec": four.spec.model_copy(update={"shard_index": 3})})
    assert advert_forgery(mine, "default") is None
    # Another member claims the job, re-signed by its own key: the id is not its.
    claimed = sign_advert(honest, evil, "default")
    assert claimed.origin == evil.peer_id
    assert "is not one its named origin" in (advert_forgery(claimed, "default") or "")
    # ... or keeps the origin and changes the spec, or drops the signature.
    lr = honest.model_copy(update={"spec": honest.spec.model_copy(update={"lr": 1.0})})
    assert "not signed by its origin" in (advert_forgery(lr, "default") or "")
    bare = honest.model_copy(update={"signature": None})
    assert "not signed by its origin" in (advert_forgery(bare, "default") or "")
    wrong_key = honest.model_copy(update={"origin_key": evil.public_key_hex})
    assert "is not that of key" in (advert_forgery(wrong_key, "default") or "")
    # Another swarm's advert, and a job id of the old kind (random), are not believed.
    assert advert_forgery(honest, "other") is not None
    legacy = sign_advert(honest.model_copy(update={"id": "a" * 32}), origin, "default")
    assert advert_forgery(legacy, "default") is not None
    # Through the wire (JSON and back) it still holds.
    again = JobAdvert.model_validate_json(honest.model_dump_json(by_alias=True))
    assert advert_forgery(again, "default") is None


async def test_a_forged_advert_is_neither_joined_nor_counted(tmp_path: Path) -> None:
    """The swarm node offers the job manager only an advert its origin made, and counts the
    sender as training the job only then; a joined job carries the origin's seal on in its own
    adverts, across a restart (a real SQLite file)."""
    from typing import cast

    from atomd.config import Settings
    from atomd.db.connection import make_engine, make_sessionmaker
    from atomd.jobs.active import ActiveJob
    from atomd.p2p.membership import Member
    from atomd.p2p.messages import Gossip
    from atomd.p2p.node import SwarmNode

    origin, evil, me = Identity.generate(), Identity.generate(), Identity.generate()
    offers: list[JobAdvert] = []
    fake_jobs = SimpleNamespace(offer=lambda advert, donors: offers.append(advert),
                                advert=lambda: None, run_of=lambda job_id: None)  # fmt: skip
    settings = Settings(data_dir=tmp_path / "n", device="cpu", auto_join=True)
    await asyncio.to_thread(migrate.upgrade, settings.db_path)
    engine = make_engine(settings.db_path)
    node = SwarmNode(settings=settings, identity=me, sessions=make_sessionmaker(engine),
                     telemetry=Telemetry(), jobs=cast(Any, fake_jobs))  # fmt: skip
    for i in (origin, evil):
        node.membership.members[i.peer_id] = Member(
            i.peer_id, "https://127.0.0.1:42001", i.public_key_hex, "alive", 1
        )
    honest = _signed(origin)
    claimed = sign_advert(honest, evil, "default")
    record = node.membership.members[evil.peer_id]
    sender = Update(id=evil.peer_id, url=record.url, public_key=evil.public_key_hex,
                    state="alive", incarnation=1)  # fmt: skip
    node.gossip.on_message(evil.peer_id, Gossip(sender=sender, job=claimed))
    assert offers == [] and node.job_peers(claimed.id) == []
    node.gossip.on_message(evil.peer_id, Gossip(sender=sender, job=honest))  # passed on as it is
    assert [o.origin for o in offers] == [origin.peer_id]
    assert [m.id for m in node.job_peers(honest.id)] == [evil.peer_id]
    await engine.dispose()

    # The job manager records the seal with the job and carries it on, across a restart.
    jobs, sessions, engine = await _manager(tmp_path)
    try:
        offer = offers[0]
        async with sessions() as s, s.begin():
            await repo.create_job(s, job_id=honest.id, spec=offer.spec.model_dump(mode="json"),
                                  out_dir="/x", state="running", scope="swarm",
                                  origin=offer.origin, origin_key=offer.origin_key,
                                  origin_signature=offer.signature)  # fmt: skip
        async with sessions() as s:
            row = await repo.get_job(s, job_id=honest.id)
        assert row is not None
        from atomd.jobs.active import resumed_job

        jobs.active = resumed_job(row, JobSpec.model_validate(row.spec))
        assert isinstance(jobs.active, ActiveJob)
        told = JobAdvert.model_validate(jobs.advert())
        assert advert_forgery(told, "default") is None and told.origin == origin.peer_id
    finally:
        jobs.active = None
        await engine.dispose()


def _failed(e: BaseException) -> asyncio.Future[Any]:
    """A trainer's future that ended with ``e``."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_exception(e)
    return fut


async def test_a_refused_donor_state_is_removed_and_another_donor_asked(tmp_path: Path) -> None:
    """The trainer refused a donor's state (``DonorStateError``): the job manager removes that
    checkpoint, records why, does not ask the donor again and takes another's, up to
    DONOR_TRIES donors; any other failure is the job's own."""
    from atomd.errors import DonorStateError
    from atomd.jobs.active import ActiveJob
    from atomd.jobs.donor_state import DONOR_TRIES
    from atomd.train import checkpoint as ckpt

    jobs, sessions, engine = await _manager(tmp_path)
    distrusted: list[str] = []
    jobs.swarm = SimpleNamespace(distrust=distrusted.append)  # type: ignore[assignment]

    try:
        active = ActiveJob("a" * 32, JobSpec(preset="tiny"), tmp_path / "job", True, "swarm",
                           donors=["https://d1", "https://d2"])  # fmt: skip
        for n in range(1, DONOR_TRIES + 1):
            where = ckpt.checkpoint_dir(ckpt.checkpoint_root(active.out_dir), 40)
            where.mkdir(parents=True)
            (where / ckpt.DONATED_FILE).write_text(f"https://d{n}")  # as the fetch writes it
            active.adopt_step = 40
            again = await jobs.donor_state.donor_refused(
                active, _failed(DonorStateError("far worse", 40))
            )
            assert again == (n < DONOR_TRIES) and not where.exists()
            assert active.adopt_step is None
            assert f"https://d{n}" not in active.donors
        assert distrusted == [f"https://d{n}" for n in range(1, DONOR_TRIES + 1)]
        async with sessions() as s:
            events = await repo.list_events(s, kind="job.state_refused")
        assert len(events) == DONOR_TRIES
        assert any("far worse (from https://d1)" in e.message for e in events)
        active.tries = 0
        kept = ckpt.checkpoint_dir(ckpt.checkpoint_root(active.out_dir), 39)
        kept.mkdir(parents=True)
        (kept / ckpt.DONATED_FILE).write_text("https://d9")
        assert not await jobs.donor_state.donor_refused(active, _failed(ValueError("a bug")))
        assert distrusted[-1] != "https://d9" and kept.exists()
        # A state fetched before the daemon stopped, refused when it resumed: the donor its
        # checkpoint names is distrusted, and the checkpoint goes.
        where = ckpt.checkpoint_dir(ckpt.checkpoint_root(active.out_dir), 41)
        where.mkdir(parents=True)
        (where / ckpt.DONATED_FILE).write_text("https://d7")
        assert await jobs.donor_state.donor_refused(
            active, _failed(DonorStateError("far worse", 41))
        )
        assert distrusted[-1] == "https://d7" and not where.exists()
    finally:
        await engine.dispose()


async def test_a_swarm_moved_on_past_the_trainer_takes_its_state_again(tmp_path: Path) -> None:
    """The trainer ended with ``SwarmMovedOnError``: the job manager takes the swarm's state
    again as a restarted daemon does (resume, donors from the membership, a fresh plugin made
    at once, so that the frames that come meanwhile are kept for it), records a
    ``job.retake`` event, and lets the next plugin do so again only RETAKES times a job; any
    other failure is not one."""
    from atomd.errors import SwarmMovedOnError
    from atomd.jobs.active import ActiveJob
    from atomd.jobs.donor_state import RETAKES

    jobs, sessions, engine = await _manager(tmp_path)
    made: list[bool] = []

    def plugin(job_id: str, spec: JobSpec, *, may_retake: bool) -> object:
        made.append(may_retake)
        return object()

    jobs.swarm = SimpleNamespace()  # type: ignore[assignment]
    jobs.exchange = SimpleNamespace(plugin=plugin)  # type: ignore[assignment]

    try:
        active = ActiveJob("a" * 32, JobSpec(preset="tiny"), tmp_path / "job", False, "swarm",
                           donors=["https://d1"])  # fmt: skip
        old = active.plugin = cast(Any, object())
        active.adopt_step = 40
        assert not await jobs.donor_state.moved_on(active, _failed(ValueError("a bug")))
        assert active.plugin is old and made == []
        for n in range(1, RETAKES + 1):
            moved = SwarmMovedOnError("the swarm has closed 7 round(s) past", 40 + n)
            assert await jobs.donor_state.moved_on(active, _failed(moved))
            assert active.plugin is not old and made[-1] == (n < RETAKES)
            assert active.resume and active.donors == [] and active.adopt_step is None
            assert active.retaking
        async with sessions() as s:
            events = await repo.list_events(s, kind="job.retake")
        assert len(events) == RETAKES and "step 41: the swarm has closed" in events[-1].message
    finally:
        await engine.dispose()


@pytest.mark.parametrize("retaking", [False, True])
async def test_a_retake_takes_the_swarms_state_whatever_its_step(
    tmp_path: Path, retaking: bool
) -> None:
    """A peer cut off trains faster alone: its own checkpoint may be past the swarm's newest
    state. Retaking, it asks for the swarm's state from any step on, removes its own
    checkpoints past the one fetched (the trainer resumes from the newest) and adopts it; a
    restarted daemon asks only for a state newer than its own."""
    from atomd.jobs.active import ActiveJob
    from atomd.p2p.transfer import Fetched
    from atomd.train import checkpoint as ckpt

    jobs, _sessions, engine = await _manager(tmp_path)
    asked: list[int] = []

    async def settled_donors(job_id: str, *, give_up: Any) -> list[str]:
        return ["https://d1"]

    async def fetch_state(job_id: str, donors: list[str], root: Path, *, max_file_bytes: int,
                          at_least: int) -> Fetched | None:  # fmt: skip
        asked.append(at_least)
        if at_least > 310:
            return None  # the donor has nothing that new
        ckpt.checkpoint_dir(root, 310).mkdir(parents=True)
        return Fetched(step=310, donor="https://d1", donor_id="d1" * 16)

    jobs.swarm = SimpleNamespace(  # type: ignore[assignment]
        settled_donors=settled_donors, fetch_state=fetch_state
    )
    try:
        active = ActiveJob("a" * 32, JobSpec(preset="tiny"), tmp_path / "job", True, "swarm")
        active.retaking = retaking
        root = ckpt.checkpoint_root(active.out_dir)
        for step in (300, 320):
            ckpt.checkpoint_dir(root, step).mkdir(parents=True)
        assert await jobs.donor_state.take(active)
        names = [p.name for p in ckpt.list_checkpoints(root)]
        if retaking:
            assert asked == [1] and active.adopt_step == 310
            assert active.adopt_from == "d1" * 16  # the trainer's plugin.adopt(donor)
            assert names == ["step-00000310", "step-00000300"]
        else:
            assert asked == [321] and active.adopt_step is None
            assert names == ["step-00000320", "step-00000300"]
        assert not active.retaking
    finally:
        await engine.dispose()


async def test_a_job_whose_activations_would_not_fit_host_memory_is_not_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member may advertise micro_batch_size 4096 so that every free peer joins it; on the
    CPU its activations (~20 GiB for tiny) would bring the kernel's OOM killer onto the
    daemon. A joiner that trains on the CPU counts them first, and says why it does not join."""
    from atomd.devices import TRAIN_BYTES_PER_PARAMETER
    from atomd.jobs import admission
    from atomd.model.config import num_parameters

    state = num_parameters(JobSpec(preset="tiny").model_shape) * TRAIN_BYTES_PER_PARAMETER
    monkeypatch.setattr(admission, "host_memory_available", lambda: state + (1 << 30))
    jobs, sessions, engine = await _manager(tmp_path)  # device cpu
    spec = {"preset": "tiny", "micro_batch_size": 4096}
    why = await _why_not_joined(jobs, sessions, engine, spec)
    assert "one micro-batch's activations" in why and "lower micro_batch_size" in why


async def test_a_refused_donor_state_leaves_its_model_behind_before_the_next_try(
    tmp_path: Path, text_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer refused a donor's state: before the job builds a trainer for the next
    donor's, nothing keeps the refused one's model (its engine, the sync state the plugin built
    on it and loaded the donor's anchor into) alive. Kept by the job's plugin, a second model
    and its AdamW state were allocated beside it: a model that fits the device once did not."""
    import gc
    import logging
    import weakref

    from atomd.engine_choice import build_engine
    from atomd.errors import DonorStateError
    from atomd.jobs.active import ActiveJob
    from atomd.sync.runner import SyncPlugin
    from atomd.train import checkpoint as ckpt
    from atomd.train.trainer import Trainer
    from tests.conftest import fast_spec, trainer_for

    spec = fast_spec(data=str(text_file), max_steps=4, checkpoint_interval=100)
    trainer_for(spec, tmp_path / "donor", device="cpu").run()
    found = ckpt.load_latest(ckpt.checkpoint_root(tmp_path / "donor"))
    assert found is not None
    out = tmp_path / "job"
    hostile = {n: t * 10 for n, t in found.model.items()}  # far worse than untrained
    ckpt.save_checkpoint(ckpt.checkpoint_root(out), step=4, model=hostile, state=found.state,
                         meta=found.meta, keep=2)  # fmt: skip
    marked = ckpt.checkpoint_dir(ckpt.checkpoint_root(out), 4) / ckpt.DONATED_FILE
    marked.write_text("https://d1")  # as the fetch writes it

    jobs, _sessions, engine = await _manager(tmp_path)
    jobs.swarm = SimpleNamespace(distrust=lambda donor: None)  # type: ignore[assignment]
    # Not captured: a captured warning's record holds the exception, and so those frames.
    caplog.set_level(logging.CRITICAL, logger="atomd.jobs")
    plugin = SyncPlugin(job_id="a" * 32, spec=spec.sync, identity=Identity.generate(),
                        counted=lambda base: [], send=lambda out: None)  # fmt: skip
    active = ActiveJob("a" * 32, spec, out, True, "swarm", plugin=plugin, adopt_step=4,
                       donors=["https://d1", "https://d2"])  # fmt: skip
    del plugin
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    built = build_engine(spec, "cpu")
    model = weakref.ref(built.engine.model)
    try:
        Trainer(spec, out, built.engine, plan=built.plan, resume=True, plugin=active.plugin,
                adopt_step=4)  # fmt: skip
    except DonorStateError as e:
        fut.set_exception(e)
    del built
    try:
        assert await jobs.donor_state.donor_refused(active, fut)
        del fut  # as the job's next try does: the refused trainer's frames go with it
        gc.collect()
        assert model() is None, "the refused state's model is still held"
    finally:
        await engine.dispose()


async def test_a_full_disk_while_recording_progress_waits_instead_of_ending_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's checkpoint can fill the disk for a moment before it fails and is removed:
    a progress commit in that moment raised out of the job's task and ended the daemon (the
    full-disk integration test in CI). The reports wait for room, then are dropped with a log
    line; they wait while another process holds the database (dropped only once the daemon
    shuts down); any other database error still raises."""
    from sqlalchemy.exc import OperationalError

    from atomd.db import health
    from atomd.jobs import recording
    from atomd.jobs.active import ActiveJob

    jobs, _, engine = await _manager(tmp_path)
    monkeypatch.setattr(recording, "RECORD_RETRY_S", 0.01)
    active = ActiveJob("a" * 32, JobSpec(preset="tiny"), tmp_path / "job", False)
    calls: list[int] = []
    fail: list[BaseException] = []

    async def record(a: Any, items: Any) -> None:
        calls.append(len(items))
        if fail:
            raise fail.pop()

    def full() -> OperationalError:
        return OperationalError("COMMIT", None, Exception("database or disk is full"))

    monkeypatch.setattr(jobs.recorder, "record", record)
    try:
        fail[:] = [full(), full()]
        await jobs.recorder.record_when_room(active, [object()])  # type: ignore[list-item]
        assert calls == [1, 1, 1] and not fail
        monkeypatch.setattr(health, "LOCKED_RETRY_S", 0.01)

        def locked() -> OperationalError:
            return OperationalError("COMMIT", None, Exception("database is locked"))

        calls.clear()
        fail[:] = [locked(), locked()]
        await jobs.recorder.record_when_room(active, [object()])  # type: ignore[list-item]
        assert calls == [1, 1, 1] and not fail
        fail[:] = [OperationalError("COMMIT", None, Exception("disk I/O error"))]
        with pytest.raises(OperationalError, match="I/O"):
            await jobs.recorder.record_when_room(active, [object()])  # type: ignore[list-item]
        await jobs.shutdown()
        calls.clear()
        fail[:] = [locked()]
        await jobs.recorder.record_when_room(active, [object()])  # type: ignore[list-item]
        assert calls == [1], "shutting down: dropped, not waited for"
        monkeypatch.setattr(recording, "RECORD_FULL_S", 0.0)
        calls.clear()
        fail[:] = [full()]
        await jobs.recorder.record_when_room(active, [object()])  # type: ignore[list-item]
        assert calls == [1], "dropped past the bound, not retried"
    finally:
        await engine.dispose()


@pytest.mark.parametrize("how", ["shutdown", "stop", "stop, its record slow"])
async def test_a_stop_cancels_a_state_transfer_under_way(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM (or a stop) while a joiner fetches the swarm's state waited out the whole
    transfer, up to its 15-minute deadline. It is cancelled at once and the job recorded as a
    stop during training would be: pending to resume after a shutdown (from its newest
    checkpoint), stopped after a stop, also when the stop's own record ("stopping") is slow
    to commit (another process's lock): the end is written after it, not overwritten by it."""
    from atomd.jobs.active import ActiveJob
    from atomd.jobs.recording import SHUTDOWN_REASON
    from atomd.train import checkpoint as ckpt

    if how == "stop, its record slow":
        set_job_state = repo.set_job_state

        async def slow_stopping(s: Any, *, job_id: str, state: str, reason: Any = None) -> Any:
            if state == "stopping":
                await asyncio.sleep(0.3)
            return await set_job_state(s, job_id=job_id, state=state, reason=reason)

        monkeypatch.setattr(repo, "set_job_state", slow_stopping)
    jobs, sessions, engine = await _manager(tmp_path)
    fetching, cancelled = asyncio.Event(), asyncio.Event()

    async def settled_donors(job_id: str, *, give_up: Any) -> list[str]:
        return ["https://d1"]

    async def fetch_state(job_id: str, donors: list[str], root: Path, *, max_file_bytes: int,
                          at_least: int) -> None:  # fmt: skip
        fetching.set()
        try:
            await asyncio.Event().wait()  # a donor that sends slowly
        finally:
            cancelled.set()

    jobs.swarm = SimpleNamespace(  # type: ignore[assignment]
        settled_donors=settled_donors, fetch_state=fetch_state
    )
    active = ActiveJob("a" * 32, JobSpec(preset="tiny"), tmp_path / "job", True, "swarm")
    ckpt.checkpoint_dir(ckpt.checkpoint_root(active.out_dir), 40).mkdir(parents=True)
    async with sessions() as s, s.begin():
        await repo.create_job(s, job_id=active.id, spec={}, out_dir=str(active.out_dir),
                              state="running", scope="swarm")  # fmt: skip
    jobs.active = active
    try:
        taking = asyncio.create_task(jobs.donor_state.take(active))
        await asyncio.wait_for(fetching.wait(), 10)
        if how == "shutdown":
            await jobs.shutdown()
        else:
            await asyncio.gather(jobs.request_stop(active, "stopped by request"), taking)
        assert await asyncio.wait_for(taking, 10) is False  # the job ended here
        assert cancelled.is_set() and jobs.active is None
        async with sessions() as s:
            job = await repo.get_job(s, job_id=active.id)
        assert job is not None
        if how == "shutdown":
            assert (job.state, job.reason) == ("pending", SHUTDOWN_REASON)
        else:
            assert (job.state, job.reason) == ("stopped", "stopped by request")
    finally:
        await engine.dispose()


async def test_a_checkpoint_pruned_before_it_was_recorded_is_skipped(tmp_path: Path) -> None:
    """Reports wait while another process holds the database, and the trainer goes on and
    prunes its old checkpoints (``keep_checkpoints``): hashing one that is gone raised out of
    the job's task and ended the daemon. It is skipped; the rest of the batch is recorded."""
    from atomd.jobs.active import ActiveJob, CheckpointSaved

    jobs, sessions, engine = await _manager(tmp_path)
    active = ActiveJob("b" * 32, JobSpec(preset="tiny"), tmp_path / "job", False)
    async with sessions() as s, s.begin():
        await repo.create_job(s, job_id=active.id, spec={}, out_dir=str(active.out_dir))
    try:
        await jobs.recorder.record(
            active, [CheckpointSaved(tmp_path / "job" / "step-00000010", 10)]
        )
        async with sessions() as s:
            assert await repo.latest_checkpoint(s, job_id=active.id) is None
    finally:
        await engine.dispose()


async def test_a_swarm_wide_stop_is_remembered_across_a_restart(tmp_path: Path) -> None:
    """The origin tells a member that missed its swarm-wide stop again (``SwarmNode``), also
    after the origin itself restarted: the stop is recorded (``job.swarm_stopped``) and read
    back as the jobs are taken up, whatever the origin's own copy reads (a SIGKILL may leave
    it "stopping"); a job resumed here since is no longer stopped, also when it was stopped
    here only afterwards."""
    stopped, stopping, resumed, local = "c" * 32, "d" * 32, "e" * 32, "f" * 32
    jobs, sessions, engine = await _manager(tmp_path)
    async with sessions() as s, s.begin():
        for job_id, state in ((stopped, "stopped"), (stopping, "stopping"), (resumed, "stopped"),
                              (local, "stopped")):  # fmt: skip
            await repo.create_job(s, job_id=job_id, spec={}, out_dir="/x", state=state,
                                  scope="swarm", origin="p" * 32)  # fmt: skip
        for job_id in (stopped, stopping, resumed):
            await repo.add_event(s, kind="job.swarm_stopped", job_id=job_id, message="")
        # Resumed here after the swarm-wide stop, then stopped here only.
        await repo.add_event(s, kind="job.resuming", job_id=resumed, message="")
    task = asyncio.create_task(jobs.run())
    try:
        await jobs.wait_started()
        assert jobs.stopped_swarm_wide(stopped) == 0 and jobs.stopped_swarm_wide(stopping) == 0
        assert jobs.stopped_swarm_wide(resumed) is None
        assert jobs.stopped_swarm_wide(local) is None  # stopped here only
    finally:
        await jobs.shutdown()
        await task
        await engine.dispose()


async def _launched(
    jobs: JobManager, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], asyncio.Task[None]]:
    """``jobs``, running, with its launches caught instead of trained: the list they go to,
    and its task."""
    launched: list[Any] = []
    monkeypatch.setattr(jobs, "launch", launched.append)
    task = asyncio.create_task(jobs.run())
    await jobs.wait_started()
    return launched, task


async def _close(jobs: JobManager, task: asyncio.Task[None], engine: Any) -> None:
    """Stop a running ``jobs`` (``_launched``) and its database."""
    jobs.active = None
    await jobs.shutdown()
    await task
    await engine.dispose()


async def test_the_origins_resume_starts_a_new_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swarm-wide stop names the run it ends, and the origin's resume starts the next
    (recorded, in the ``job.resuming`` event, and across a restart), so that the stop it
    signed before ends no copy of the new run. A joined copy resumed here goes on in the run
    it joined: the origin's signature covers that one only."""
    from atomd.errors import JobConflictError

    jobs, sessions, engine = await _manager(tmp_path)
    stops: list[tuple[str, int]] = []
    jobs.swarm = SimpleNamespace(broadcast_stop=lambda j, r: stops.append((j, r)))  # type: ignore[assignment]
    mine, joined = job_id_for("p" * 32), "b" * 32
    spec = JobSpec(preset="tiny").model_dump()
    async with sessions() as s, s.begin():
        await repo.create_job(s, job_id=mine, spec=spec, out_dir="/x", state="stopped",
                              scope="swarm", origin="p" * 32)  # fmt: skip
        await repo.create_job(s, job_id=joined, spec=spec, out_dir="/y", state="stopped",
                              scope="swarm", origin="o" * 32, run=3)  # fmt: skip
    launched, task = await _launched(jobs, monkeypatch)
    try:
        await jobs.stop(mine, scope="swarm")
        assert stops == [(mine, 0)] and jobs.stopped_swarm_wide(mine) == 0
        await jobs.resume(mine)
        assert [a.run for a in launched] == [1] and jobs.stopped_swarm_wide(mine) is None
        async with sessions() as s, s.begin():
            events = await repo.list_events(s, kind="job.resuming")
            await repo.set_job_state(s, job_id=mine, state="stopped")
        assert [e.message for e in events] == ["run 1"]
        await jobs.stop(mine, scope="swarm")
        assert stops[-1] == (mine, 1) and jobs.stopped_swarm_wide(mine) == 1
        await jobs.resume(joined)
        assert launched[-1].run == 3
        with pytest.raises(JobConflictError):
            await jobs.stop(joined, scope="swarm")  # not its origin
    finally:
        await _close(jobs, task, engine)
    again, sessions, engine = await _manager(tmp_path)
    _, task = await _launched(again, monkeypatch)
    try:
        assert again.stopped_swarm_wide(mine) == 1
        async with sessions() as s:
            assert [(j.id, j.run) for j in await repo.list_jobs(s) if j.id == mine] == [(mine, 1)]
    finally:
        await _close(again, task, engine)


async def test_a_joiner_trains_the_run_its_advert_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A joiner records the run of the origin's advert and carries it on, signed; it takes a
    stop of that run (or a later one) and refuses one of a run before: a member that kept the
    origin's stop of that run, replaying it, would end every copy of the new run. Hearing of
    a later run of the same job (its spec), the copy goes on in it, recorded."""
    from atomd.errors import JobConflictError

    origin = Identity.generate()
    jobs, sessions, engine = await _manager(tmp_path)
    launched, task = await _launched(jobs, monkeypatch)
    try:
        advert = sign_advert(
            JobAdvert(id=job_id_for(origin.peer_id), spec=JobSpec(preset="tiny"), run=2),
            origin, "default",
        )  # fmt: skip
        jobs.offer(advert, ["http://127.0.0.1:1"])
        for _ in range(200):
            if launched:
                break
            await asyncio.sleep(0.02)
        assert [a.run for a in launched] == [2]
        async with sessions() as s:
            row = await repo.get_job(s, job_id=advert.id)
        assert row is not None and row.run == 2
        active = jobs.active = launched[0]
        told = JobAdvert.model_validate(jobs.advert())
        assert told.run == 2 and advert_forgery(told, "default") is None
        with pytest.raises(JobConflictError, match="trains its run 2"):
            await jobs.stop_from_peer(advert.id, origin.peer_id, "m" * 32, run=1)
        assert not active.stop_event.is_set() and active.stop_reason is None

        # The origin resumes the job again: heard of, the copy goes on in run 3, sealed so.
        def later(run: int, spec: JobSpec) -> JobAdvert:
            return sign_advert(advert.model_copy(update={"run": run, "spec": spec}), origin,
                               "default")  # fmt: skip

        await jobs.newer_run(later(3, JobSpec(preset="tiny", lr=1.0)))  # not the job trained
        await jobs.newer_run(later(1, advert.spec))  # an earlier run
        assert active.run == 2
        await jobs.newer_run(later(3, advert.spec))
        told = JobAdvert.model_validate(jobs.advert())
        assert told.run == 3 and advert_forgery(told, "default") is None
        async with sessions() as s:
            row = await repo.get_job(s, job_id=advert.id)
            assert row is not None and (row.run, row.origin_signature) == (3, told.signature)
            assert [e.message for e in await repo.list_events(s, kind="job.run")] == ["run 3"]
        with pytest.raises(JobConflictError, match="trains its run 3"):
            await jobs.stop_from_peer(advert.id, origin.peer_id, "m" * 32, run=2)
        await jobs.stop_from_peer(advert.id, origin.peer_id, "m" * 32, run=3)
        assert active.stop_event.is_set() and "told by peer mmmm" in str(active.stop_reason)
    finally:
        await _close(jobs, task, engine)


async def test_a_copy_the_swarm_stopped_rejoins_a_later_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The origin's resume of the job it stopped swarm-wide starts a later run: a copy the
    swarm stopped here goes on in it (its origin's word is the job's), in the same write as
    its resume, also when a restart cut its stop short; a rejoin refused (the daemon busy)
    keeps the run for the next advert. A copy its operator stopped, one that finished or
    failed, one of another spec or origin, or an advert of no later run is not joined again.
    A joiner takes no advert of an earlier run than the latest the swarm heard of."""
    from atomd.jobs.active import ActiveJob

    origin, other = Identity.generate(), Identity.generate()
    jobs, sessions, engine = await _manager(tmp_path)
    latest = {"run": 0}
    jobs.swarm = SimpleNamespace(latest_run=lambda j: latest["run"])  # type: ignore[assignment]
    spec = JobSpec(preset="tiny")
    swarm_stop = f"stopped by the swarm (peer {origin.peer_id[:12]})"
    rows = {  # job id -> (state, reason)
        job_id_for(origin.peer_id): ("stopped", swarm_stop),
        job_id_for(origin.peer_id): ("stopped", "stopped by request"),
        job_id_for(origin.peer_id): ("finished", swarm_stop),
        job_id_for(origin.peer_id): ("failed", swarm_stop),
        job_id_for(origin.peer_id): ("stopping", swarm_stop),  # the daemon died stopping it
    }
    ids = list(rows)
    async with sessions() as s, s.begin():
        for job_id, (state, reason) in rows.items():
            await repo.create_job(s, job_id=job_id, spec=spec.model_dump(), out_dir="/x",
                                  scope="swarm", origin=origin.peer_id)  # fmt: skip
            await repo.set_job_state(s, job_id=job_id, state=state, reason=reason)
    launched, task = await _launched(jobs, monkeypatch)

    async def offer(job_id: str, run: int, lr: float = spec.lr, by: Identity = origin) -> None:
        a = JobAdvert(id=job_id, spec=spec.model_copy(update={"lr": lr}), run=run)
        await jobs.joiner.join(sign_advert(a, by, "default"), [])

    try:
        await offer(ids[0], 0)  # no later run
        await offer(ids[0], 1, lr=1.0)  # another spec
        for job_id in ids[1:4]:  # its operator stopped it; it finished; it failed
            await offer(job_id, 1)
        theirs = job_id_for(other.peer_id)
        await offer(theirs, 1, by=other)  # another origin's: a fresh job, joined
        assert [a.id for a in launched] == [theirs]
        launched.clear()
        jobs.active = cast(ActiveJob, SimpleNamespace(id="busy"))  # another job came first
        await offer(ids[0], 1)
        jobs.active = None
        assert launched == []
        await offer(ids[0], 1)
        assert [(a.id, a.run) for a in launched] == [(ids[0], 1)]
        async with sessions() as s:
            row = await repo.get_job(s, job_id=ids[0])
            assert row is not None and (row.state, row.run) == ("pending", 1)
            said = [e.message for e in await repo.list_events(s, kind="job.resuming")]
            assert said == ["run 1"]
        latest["run"] = 3
        fresh = job_id_for(origin.peer_id)
        await offer(fresh, 2)  # run 3 was heard of since
        assert len(launched) == 1
        async with sessions() as s:
            assert await repo.get_job(s, job_id=fresh) is None
    finally:
        await _close(jobs, task, engine)
    # The copy the daemon died stopping: recorded as the swarm's stop, rejoined.
    jobs, sessions, engine = await _manager(tmp_path)
    jobs.swarm = SimpleNamespace(latest_run=lambda j: 0)  # type: ignore[assignment]
    launched, task = await _launched(jobs, monkeypatch)
    try:
        async with sessions() as s:
            row = await repo.get_job(s, job_id=ids[4])
        assert row is not None and row.state == "stopped"
        assert str(row.reason).startswith(swarm_stop), row.reason
        await offer(ids[4], 1)
        assert (ids[4], 1) in [(a.id, a.run) for a in launched]  # (and ids[0], pending)
    finally:
        await _close(jobs, task, engine)
