"""State transfer against real HTTP donors that die mid-stream, lie, or have nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from atomd.errors import CheckpointError
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.messages import PeerInfo, sign_manifest
from atomd.p2p.signing import Admission
from atomd.p2p.transfer import checkpoint_file, fetch_state, newest_manifest
from atomd.train import checkpoint as ckpt

GARBAGE = b"\x08\x00\x00\x00\x00\x00\x00\x00not json" * 64
GARBAGE_SHA = hashlib.sha256(GARBAGE).hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DONORS: dict[str, Identity] = {}  # behaviour -> the donor's identity (signed manifests)


def donor_app(root: Path, behaviour: str) -> FastAPI:
    """A donor serving ``root``'s newest checkpoint: honestly, or dying, or lying."""
    app = FastAPI()
    ident = DONORS.setdefault(behaviour, Identity.generate())
    me = ident.peer_id

    @app.get("/p2p/v1/info")
    async def info() -> PeerInfo:
        return PeerInfo(swarm="s", version="test", id=me, url="http://donor")

    @app.get("/p2p/v1/jobs/{job_id}/state")
    async def manifest(job_id: str) -> Any:
        found = newest_manifest(root)
        if found is None or behaviour == "empty":
            return JSONResponse({"error": "not_found", "detail": "none"}, status_code=404)
        m = found.model_dump(mode="json", by_alias=True, exclude_none=True)
        if behaviour in ("signed", "forged", "resized"):
            signer = ident if behaviour != "forged" else Identity.generate()
            signed = sign_manifest(found, signer, "s", job_id)
            if behaviour == "forged":  # another key's signature under this donor's id
                signed = signed.model_copy(update={"signer": me})
            if behaviour == "resized":  # signed, then a size changed on the way
                files = signed.files.model_copy(
                    update={"model": signed.files.model.model_copy(update={"bytes": 1})}
                )
                signed = signed.model_copy(update={"files": files})
            m = signed.model_dump(mode="json", by_alias=True, exclude_none=True)
        if behaviour == "huge":  # a manifest claiming 10^12-byte files
            m = {**m, "files": {n: {**f, "bytes": 10**12} for n, f in m["files"].items()}}
        if behaviour == "garbage":  # consistent sizes and hashes of bytes that are no checkpoint
            m = {
                **m,
                "files": {n: {"bytes": len(GARBAGE), "sha256": GARBAGE_SHA} for n in m["files"]},
            }
        return m

    @app.get("/p2p/v1/jobs/{job_id}/state/{step}/{name}")
    async def file(job_id: str, step: int, name: str) -> Any:
        path = root / f"step-{step:08d}" / name
        data = path.read_bytes()
        if behaviour == "dies":

            async def half() -> AsyncIterator[bytes]:
                yield data[: len(data) // 2]
                raise ConnectionResetError("donor died")

            return StreamingResponse(half(), headers={"content-length": str(len(data))})
        if behaviour == "garbage":
            return StreamingResponse(iter([GARBAGE]))
        if behaviour == "slow":

            async def trickle() -> AsyncIterator[bytes]:
                for i in range(len(data)):
                    yield data[i : i + 1]
                    await asyncio.sleep(0.5)

            return StreamingResponse(trickle(), headers={"content-length": str(len(data))})
        if behaviour == "lies":
            return StreamingResponse(iter([bytes(len(data))]))  # right size, wrong bytes
        return FileResponse(path)

    return app


@pytest.fixture
async def donors(tmp_path: Path) -> AsyncIterator[Any]:
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []
    source = tmp_path / "source"
    ckpt.save_checkpoint(
        source, step=7, model={"w": torch.arange(50_000.0)},
        state={"optim.w.exp_avg": torch.ones(10)}, meta={"model_config": {}},
    )  # fmt: skip

    async def start(behaviour: str) -> str:
        port = _free_port()
        config = uvicorn.Config(donor_app(source, behaviour), port=port, log_level="error")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 (uvicorn offers only a flag)
            await asyncio.sleep(0.01)
        servers.append((server, task))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, task in servers:
        server.should_exit = True
        await task


async def test_failed_donors_cost_an_attempt_and_leave_nothing(tmp_path: Path, donors: Any) -> None:
    urls = [await donors(b) for b in ("dies", "lies", "garbage", "empty", "ok")]
    root = tmp_path / "joiner" / "checkpoints"
    async with PeerClient(
        Identity.generate(), Admission("s", None, frozenset()), tls=False
    ) as client:
        got = await fetch_state(client, urls, "job1", root)
    assert got is not None and got.step == 7 and got.donor == urls[-1]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000007"]  # no .incoming left
    got = ckpt.load_latest(root)
    assert got is not None and torch.equal(got.model["w"], torch.arange(50_000.0))
    assert json.loads((root / "step-00000007" / "meta.json").read_text())["step"] == 7
    # Marked as another peer's until the trainer has checked it (``ckpt.DONATED_FILE``).
    assert (root / "step-00000007" / ckpt.DONATED_FILE).read_text() == urls[-1]


async def test_only_bad_donors_is_an_error_and_nothing_is_kept(tmp_path: Path, donors: Any) -> None:
    urls = [await donors("dies"), await donors("lies"), await donors("garbage")]
    root = tmp_path / "joiner"
    async with PeerClient(
        Identity.generate(), Admission("s", None, frozenset()), tls=False
    ) as client:
        with pytest.raises(CheckpointError, match="could not fetch"):
            await fetch_state(client, urls, "job1", root, rounds=1)
    assert list(root.iterdir()) == []


async def test_no_donor_has_state_yet(tmp_path: Path, donors: Any) -> None:
    urls = [await donors("empty")]
    async with PeerClient(
        Identity.generate(), Admission("s", None, frozenset()), tls=False
    ) as client:
        assert await fetch_state(client, urls, "job1", tmp_path / "j") is None


async def test_lying_donors_are_not_asked_again_and_sizes_are_bounded(
    tmp_path: Path, donors: Any
) -> None:
    urls = [await donors("huge"), await donors("lies"), await donors("ok")]
    liars: set[str] = set()
    root = tmp_path / "joiner"
    async with PeerClient(
        Identity.generate(), Admission("s", None, frozenset()), tls=False
    ) as client:
        got = await fetch_state(client, urls, "job1", root, max_file_bytes=1 << 20, liars=liars)
        assert got is not None and got.step == 7 and liars == set(urls[:2])
        assert not [p for p in root.iterdir() if p.name.startswith(".incoming")]
        with pytest.raises(CheckpointError, match="every donor of job job1 was refused"):
            await fetch_state(client, urls[:2], "job1", tmp_path / "j2", liars=liars)
        # Without a model bound, 10^12 bytes do not fit the disk: refused before downloading.
        with pytest.raises(CheckpointError, match="could not fetch"):
            await fetch_state(client, urls[:1], "job1", tmp_path / "j3", rounds=1)


async def test_the_whole_transfer_has_a_deadline(tmp_path: Path, donors: Any) -> None:
    urls = [await donors("slow")]
    async with PeerClient(
        Identity.generate(), Admission("s", None, frozenset()), tls=False
    ) as client:
        with pytest.raises(CheckpointError, match="did not arrive within 1 s"):
            await fetch_state(client, urls, "job1", tmp_path / "j", deadline_s=1.0)


async def test_the_donors_manifest_must_be_signed_by_the_donor(tmp_path: Path, donors: Any) -> None:
    urls = {b: await donors(b) for b in ("ok", "forged", "resized", "signed")}
    members = {(urls[b], DONORS[b].peer_id): (DONORS[b].peer_id, DONORS[b].public_key_hex)
               for b in urls}  # fmt: skip
    liars: set[str] = set()
    async with PeerClient(
        Identity.generate(), Admission("s", None, frozenset()), tls=False
    ) as client:
        step = await fetch_state(client, list(urls.values()), "job1", tmp_path / "j",
                                 liars=liars, key_at=lambda u, s: members.get((u, s)))  # fmt: skip
    assert step is not None and step.step == 7 and step.donor == urls["signed"]
    assert liars == {urls["ok"], urls["forged"], urls["resized"]}, "unsigned, forged, altered"


async def test_a_member_advertising_a_donors_url_cannot_have_it_taken_for_a_liar(
    tmp_path: Path, donors: Any
) -> None:
    """Any member signs its own record with any URL, another's included. The donor's key is
    the one of the member its manifest names, if that member is at the URL (``Donors.
    _key_at``): found by URL alone, a member whose id sorted first and who advertised the
    honest donor's URL would be taken for it, the honest manifest would fail against its key,
    and the honest donor would never be asked for state again."""
    from atomd.p2p.donors import Donors
    from atomd.p2p.membership import Membership, Update
    from atomd.p2p.messages import sign_record

    url = await donors("signed")
    honest = DONORS["signed"]
    hostile = Identity.generate()
    while hostile.peer_id > honest.peer_id:
        hostile = Identity.generate()
    me = Identity.generate()
    ms = Membership(Update(id=me.peer_id, url="http://me:1", public_key=me.public_key_hex,
                           state="alive", incarnation=1), identity=me, swarm="s")  # fmt: skip
    for who in (hostile, honest):
        record = Update(id=who.peer_id, url=url, public_key=who.public_key_hex, state="alive",
                        incarnation=1)  # fmt: skip
        assert ms.apply(sign_record(record, who, "s"), direct=True)
    node = SimpleNamespace(membership=ms)
    liars: set[str] = set()
    async with PeerClient(
        Identity.generate(), Admission("s", None, frozenset()), tls=False
    ) as client:
        step = await fetch_state(client, [url], "job1", tmp_path / "j", liars=liars,
                                 key_at=lambda u, signer: Donors._key_at(node, u, signer))  # type: ignore[arg-type]  # fmt: skip
    assert step is not None and step.step == 7 and not liars


def test_the_signed_manifest_covers_the_tokenizer_file() -> None:
    """A run with a BPE tokenizer sends its tokenizer.json: its size and hash are signed too,
    so nobody on the path can swap the vocabulary a joiner will decode and train with."""
    from atomd.p2p.identity import Identity
    from atomd.p2p.messages import StateManifest, manifest_problem

    entry = {"bytes": 10, "sha256": "a" * 64}
    m = StateManifest.model_validate({
        "format_version": 1, "step": 7, "files": {
            "model.safetensors": entry, "state.safetensors": entry, "tokenizer.json": entry,
        },
    })  # fmt: skip
    me = Identity.generate()
    signed = sign_manifest(m, me, "s", "job")
    assert manifest_problem(signed, "s", "job", me.peer_id, me.public_key_hex) is None
    files = signed.files.model_copy(
        update={"tokenizer": signed.files.tokenizer.model_copy(update={"sha256": "b" * 64})}  # type: ignore[union-attr]
    )
    swapped = signed.model_copy(update={"files": files})
    assert "signature" in (
        manifest_problem(swapped, "s", "job", me.peer_id, me.public_key_hex) or ""
    )


def test_a_checkpoint_that_names_its_tokenizer_is_served(tmp_path: Path) -> None:
    """The trainer's meta.json holds the job's tokenizer: the donor's manifest keeps it
    (a strict manifest that refused the key made every live state a 404)."""
    root = tmp_path / "ckpts"
    ckpt.save_checkpoint(
        root, step=3, model={"w": torch.ones(4)}, state={"optim.w.exp_avg": torch.ones(4)},
        meta={"model_config": {}, "tokenizer": "default"},
    )  # fmt: skip
    found = newest_manifest(root)
    assert found is not None and found.step == 3 and found.tokenizer == "default"


def test_a_donors_state_not_yet_checked_here_is_never_passed_on(tmp_path: Path) -> None:
    """A state fetched from a donor is marked until this daemon's trainer has evaluated it; a
    crash between the two would leave it the newest checkpoint, served on to the next joiner
    as if checked. The older, checked one is served instead."""
    root = tmp_path / "ckpts"
    for step in (3, 8):
        ckpt.save_checkpoint(
            root, step=step, model={"w": torch.ones(4)}, state={"optim.w.exp_avg": torch.ones(4)},
            meta={"model_config": {}},
        )  # fmt: skip
    (ckpt.checkpoint_dir(root, 8) / ckpt.DONATED_FILE).write_text("https://donor")
    found = newest_manifest(root)
    assert found is not None and found.step == 3
    assert checkpoint_file(root, 8, ckpt.MODEL_FILE) is None
    assert checkpoint_file(root, 3, ckpt.MODEL_FILE) is not None
    (ckpt.checkpoint_dir(root, 8) / ckpt.DONATED_FILE).unlink()  # the trainer checked it
    assert (newest_manifest(root) or found).step == 8


async def test_a_donor_younger_than_asked_has_no_state(tmp_path: Path, donors: Any) -> None:
    """A swarm still in its warm-up, or no newer than the joiner's own checkpoint: the joiner
    starts without a transfer (even from a donor that ignores the query and sends step 7)."""
    urls = [await donors("ok")]
    async with PeerClient(
        Identity.generate(), Admission("s", None, frozenset()), tls=False
    ) as client:
        assert await fetch_state(client, urls, "job1", tmp_path / "j", at_least=8) is None
        got = await fetch_state(client, urls, "job1", tmp_path / "k", at_least=7)
        assert got is not None and got.step == 7
    assert not (tmp_path / "j").exists() or list((tmp_path / "j").iterdir()) == []


async def test_a_donor_refuses_a_state_younger_than_asked_or_before_its_first_round(
    tmp_path: Path,
) -> None:
    """The donor side of ``at_least``: a job trained here but younger than asked is a 404
    (NotFoundError) before any snapshot is asked of the trainer; so is one whose swarm has
    closed no round yet (the joiner starts from the initial weights, the swarm's model then);
    old enough and past its first round, it is asked."""
    from atomd.errors import NotFoundError
    from atomd.jobs import JobManager
    from atomd.jobs.active import ActiveJob
    from atomd.jobs.driving import LIVE_STATE_EVERY_S
    from atomd.spec import JobSpec
    from atomd.telemetry import Telemetry
    from atomd.train.trainer import SnapshotRequests

    jobs = JobManager(jobs_dir=tmp_path, sessions=None, telemetry=Telemetry(),  # type: ignore[arg-type]
                      device="cpu", peer_id="p" * 32)  # fmt: skip
    snaps = SnapshotRequests()
    jobs.active = ActiveJob(id="j" * 32, spec=JobSpec(preset="tiny"), out_dir=tmp_path,
                            resume=False, scope="swarm", snapshots=snaps)  # fmt: skip
    jobs.active.step = 30
    with pytest.raises(NotFoundError, match="step 30"):
        await jobs.live_state("j" * 32, at_least=50)
    jobs.active.step = 50
    jobs.active.plugin = SimpleNamespace(version=0)  # type: ignore[assignment]
    with pytest.raises(NotFoundError, match="no round"):
        await jobs.live_state("j" * 32, at_least=50)
    jobs.active.plugin.version = 1  # type: ignore[union-attr]

    async def asked_and_served(step: int) -> bool:
        task = asyncio.create_task(jobs.live_state("j" * 32, at_least=50))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if snaps._waiting:
                break
        snaps.serve(lambda: step)
        return await task

    assert await asked_and_served(50) is True
    # Asked again at once (any member may ask, in a loop): the one just written is served,
    # nothing more is asked of the trainer.
    assert await jobs.live_state("j" * 32, at_least=50) is False
    assert not snaps._waiting
    jobs.active.live_at -= LIVE_STATE_EVERY_S  # long enough ago: asked again
    assert await asked_and_served(60) is True


async def test_a_swarm_job_expects_its_frames_from_its_launch_until_its_release(
    tmp_path: Path,
) -> None:
    """The job manager tells the exchange as it launches a swarm job (before torch loads and
    before the plugin exists), and releases the job when it ends; local jobs stay out of it."""
    from atomd.jobs import JobManager
    from atomd.jobs.active import ActiveJob
    from atomd.spec import JobSpec
    from atomd.telemetry import Telemetry

    calls: list[tuple[str, str]] = []
    exchange = SimpleNamespace(
        expect=lambda job_id, spec: calls.append(("expect", job_id)),
        release=lambda job_id: calls.append(("release", job_id)),
    )
    jobs = JobManager(jobs_dir=tmp_path, sessions=None, telemetry=Telemetry(),  # type: ignore[arg-type]
                      device="cpu", peer_id="p" * 32)  # fmt: skip
    jobs.exchange = exchange  # type: ignore[assignment]
    jobs.swarm = SimpleNamespace()  # type: ignore[assignment]
    driven: list[str] = []

    async def drive(active: ActiveJob) -> None:
        driven.append(active.id)
        # the exchange already knows of a swarm job, before anything of it ran
        assert calls == ([("expect", active.id)] if active.scope == "swarm" else [])

    jobs.driver.drive = drive  # type: ignore[method-assign]
    async with asyncio.TaskGroup() as tg:
        jobs.task_group = tg
        swarm_job = ActiveJob(id="s" * 32, spec=JobSpec(preset="tiny"), out_dir=tmp_path,
                              resume=True, scope="swarm")  # fmt: skip
        jobs.launch(swarm_job)
    assert driven == ["s" * 32]
    jobs.release(swarm_job)
    assert calls == [("expect", "s" * 32), ("release", "s" * 32)] and jobs.active is None
    calls.clear()
    async with asyncio.TaskGroup() as tg:
        jobs.task_group = tg
        local = ActiveJob(id="l" * 32, spec=JobSpec(preset="tiny"), out_dir=tmp_path,
                          resume=False, scope="local")  # fmt: skip
        jobs.launch(local)
    jobs.release(local)
    assert calls == [] and driven == ["s" * 32, "l" * 32]


async def test_the_members_word_on_a_fetched_state_needs_two_and_one_cannot_lower_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a fetched state, the node asks the job's other members for their newest
    validation loss (the donor's own word does not count): the higher median of at least two
    (``CLAIM_QUORUM``), so one member claiming a tiny loss cannot have an honest state refused."""
    from atomd.p2p import donors as donors_module
    from atomd.p2p.donors import Donors
    from atomd.p2p.messages import CurvePoint, ProgressCurve
    from atomd.p2p.transfer import Fetched

    def curve(*vals: float | None) -> ProgressCurve:
        return ProgressCurve(points=[CurvePoint(step=i, val_loss=v, tokens_per_s=1.0, at=1.0)
                                     for i, v in enumerate(vals)])  # fmt: skip

    answers: list[tuple[Any, Any]] = []

    async def fetched(*args: Any, **kwargs: Any) -> Fetched:
        return Fetched(7, "https://donor")

    async def peer_curves(job_id: str) -> tuple[list[tuple[Any, Any]], int]:
        return answers, 0

    monkeypatch.setattr(donors_module, "fetch_state", fetched)
    node = SimpleNamespace(client=None, _liars=set(), _key_at=None,
                           trainers=SimpleNamespace(peer_curves=peer_curves),
                           membership=SimpleNamespace(others=lambda *states: []))  # fmt: skip

    async def claimed() -> float | None:
        got = await Donors.fetch_state(node, "j", ["https://donor"], Path("/x"))  # type: ignore[arg-type]
        assert got is not None and got.step == 7
        return got.claimed_val

    def m(url: str) -> Any:
        return SimpleNamespace(url=url)

    answers[:] = [(m("https://donor"), curve(0.1)), (m("https://a"), curve(2.0, 1.9, None))]
    assert await claimed() is None, "the donor's word aside, one member is no quorum"
    answers.append((m("https://b"), "timed out"))
    assert await claimed() is None
    answers.append((m("https://liar"), curve(0.01)))
    assert await claimed() == 1.9, "the liar cannot lower it"
    answers.append((m("https://c"), curve(2.1)))
    assert await claimed() == 1.9


async def test_the_donor_of_a_fetched_state_counts_as_training_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted peer whose membership has not yet heard any member train the job counted
    itself alone in its first rounds (a peer alone commits its whole delta, where the others
    commit what it sends): the donor that served the state trains it, and counts from then on."""
    from typing import cast

    from atomd.config import Settings
    from atomd.db import migrate
    from atomd.db.connection import make_engine, make_sessionmaker
    from atomd.p2p import donors as donors_module
    from atomd.p2p.membership import Member
    from atomd.p2p.node import SwarmNode
    from atomd.p2p.transfer import Fetched
    from atomd.telemetry import Telemetry

    settings = Settings(data_dir=tmp_path, device="cpu")
    migrate.upgrade(settings.db_path)
    engine = make_engine(settings.db_path)
    node = SwarmNode(settings=settings, identity=Identity.generate(),
                     sessions=make_sessionmaker(engine), telemetry=Telemetry(),
                     jobs=cast(Any, None))  # fmt: skip
    donor = Identity.generate()
    url = "https://127.0.0.1:42001"
    node.membership.members[donor.peer_id] = Member(donor.peer_id, url, donor.public_key_hex,
                                                    "alive", 1)  # fmt: skip

    async def fetched(*args: Any, **kwargs: Any) -> Fetched:
        return Fetched(7, url + "/")

    async def no_curves(job_id: str) -> tuple[list[Any], int]:
        return [], 0

    monkeypatch.setattr(donors_module, "fetch_state", fetched)
    monkeypatch.setattr(node.trainers, "peer_curves", no_curves)
    job = "j" * 32
    assert node.job_peers(job) == []
    got = await node.fetch_state(job, [url], tmp_path / "ckpt")
    assert got is not None and got.step == 7
    assert got.donor_id == donor.peer_id  # the joiner's offset drains by its deltas
    assert [m.id for m in node.job_peers(job)] == [donor.peer_id]
    await engine.dispose()
