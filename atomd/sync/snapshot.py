"""A peer's sync state as named CPU tensors: for checkpoints and for state transfer.

``write`` turns a ``SyncState`` into tensors and ``read`` restores one from them. What another
peer sent is read defensively: text, counts and sums that do not read as what ``write`` puts
there are left out (a round left out counts as never committed here), never trusted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from atomd.sync.offset import MAX_SOURCES
from atomd.sync.robust import DeltaStats
from atomd.sync.rounds import Committed

if TYPE_CHECKING:
    from atomd.sync.state import SyncState

_ANCHOR, _MOMENTUM, _EF = "anchor.", "outer.momentum.", "ef."
_PENDING, _PENDING_COUNT = "pending.", "pending_count."
# A committed round's sum: dense as "committed.<b>.<name>", or its nonzero entries as
# "committed_at.<b>.<name>" (flat indices) and "committed_val.<b>.<name>".
_COMMITTED, _COMMITTED_AT, _COMMITTED_VAL = "committed.", "committed_at.", "committed_val."
_COMMITTED_COUNT = "committed_count."
_VERSION, _ROUND, _AVERAGING = "sync.version", "sync.round", "sync.averaging"
# The deltas merged recently, as UTF-8 lines "sender<TAB>base version" (a uint8 tensor): a peer
# that takes this state refuses them as duplicates when they reach it too.
_SEEN = "sync.seen"
# The inherited offset, its sources and the version they were last heard at; and who served
# the state (its own peer id, read by the peer that takes it).
_OFFSET, _OFFSET_FROM, _OFFSET_HEARD, _SERVED_BY = (
    "inherited.", "sync.inherited_from", "sync.inherited_heard", "sync.served_by",
)  # fmt: skip
# The newest own delta's reference statistics (the robust rule's): the overall norm then each
# tensor's, and each tensor's largest |x|, in the anchor's order (float64).
_REF_NORMS, _REF_MAXABS = "sync.ref.norms", "sync.ref.maxabs"
MAX_PEER_ID = 64  # bytes of a peer id read back from a state (ids are 32 hex digits)
MAX_SEEN = 65_536  # entries read back from a state: (senders) x (max_staleness + 1) rounds


def write(state: SyncState) -> dict[str, Tensor]:
    """Anchor, pending deltas, outer momentum, error-feedback residuals, counters (CPU)."""
    out = {_ANCHOR + n: t.clone() for n, t in state.anchor.items()}
    out.update({_MOMENTUM + n: t for n, t in state.committed.outer.state_tensors().items()})
    out.update(
        {_EF + n: t.detach().cpu().clone() for n, t in state.feedback.state_tensors().items()}
    )
    rounds = state.rounds
    for b, acc in rounds.sums.items():
        out.update({f"{_PENDING}{b}.{n}": t.clone() for n, t in acc.items()})
        out[f"{_PENDING_COUNT}{b}"] = torch.tensor(rounds.counts[b], dtype=torch.int64)
    out[_VERSION] = torch.tensor(state.version, dtype=torch.int64)
    out[_ROUND] = torch.tensor(state.round, dtype=torch.int64)
    out[_SERVED_BY] = _text_tensor(state.peer_id)
    offset = state.offset
    if offset:
        out.update({_OFFSET + n: t.clone() for n, t in offset.tensors.items()})
        out[_OFFSET_FROM] = _text_tensor("\n".join(sorted(offset.sources)))
        out[_OFFSET_HEARD] = torch.tensor(offset.heard, dtype=torch.int64)
    if state.averaging:
        out[_AVERAGING] = torch.tensor(1, dtype=torch.int64)
    out[_SEEN] = _text_tensor(
        "".join(f"{sender}\t{b}\n" for sender, b in sorted(state.intake.seen))
    )
    for b, (sums, count) in rounds.committed.items():
        out[f"{_COMMITTED_COUNT}{b}"] = torch.tensor(count, dtype=torch.int64)
        for n, t in sums.items():
            if t.is_sparse:
                out[f"{_COMMITTED_AT}{b}.{n}"] = t.indices()[0].clone()
                out[f"{_COMMITTED_VAL}{b}.{n}"] = t.values().clone()
            else:
                out[f"{_COMMITTED}{b}.{n}"] = t.clone()
    ref = state.screen.newest_own() if state.screen is not None else None
    if ref is not None:
        names = list(state.anchor)
        out[_REF_NORMS] = torch.tensor(
            [ref.norm, *(ref.tensor_norms.get(n, 0.0) for n in names)], dtype=torch.float64
        )
        out[_REF_MAXABS] = torch.tensor(
            [ref.tensor_maxabs.get(n, 0.0) for n in names], dtype=torch.float64
        )
    return out


def read(state: SyncState, d: Mapping[str, Tensor]) -> None:
    """Restore into ``state`` what ``write`` produced (checkpoint or state transfer); the
    replica is not touched."""
    state.directions.clear()  # rounds of before the state: no reference for its rounds
    anchor = _read_anchor(d, state.anchor)
    with torch.no_grad():
        for name, t in anchor.items():
            state.anchor[name].copy_(t)
    state.committed.outer.load_state_tensors(_prefixed(d, _MOMENTUM))
    state.feedback.load_state_tensors(_prefixed(d, _EF))
    rounds = state.rounds
    rounds.sums, rounds.counts = {}, {}
    for k, t in d.items():
        if k.startswith(_PENDING_COUNT):
            rounds.counts[int(k[len(_PENDING_COUNT) :])] = int(t)
        elif k.startswith(_PENDING):
            b, _, name = k[len(_PENDING) :].partition(".")
            acc = rounds.sums.setdefault(int(b), {})
            acc[name] = t.detach().to("cpu", torch.float32).clone()
    state.version = int(d[_VERSION]) if _VERSION in d else 0
    state.round = int(d[_ROUND]) if _ROUND in d else 0
    if _AVERAGING in d and int(d[_AVERAGING]):  # restarted in the middle of consolidation
        state.average_from_now()
    staleness = state.spec.max_staleness
    state.intake.seen = _read_seen(d.get(_SEEN), floor=state.version - staleness)
    rounds.committed = _read_committed(
        d, rounds=range(state.version - staleness, state.version), like=state.anchor
    )
    state.together = not state.intake.merged_only(state.peer_id)
    # The donor's reference statistics judge the rounds closed before the state was taken.
    reference = _read_ref(d.get(_REF_NORMS), d.get(_REF_MAXABS), list(state.anchor))
    state.intake.restart(reference, state.version)
    state.pace.reset()
    _read_offset(state, d)


def _prefixed(d: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix) :]: t for k, t in d.items() if k.startswith(prefix)}


def _read_anchor(d: Mapping[str, Tensor], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    anchor = _prefixed(d, _ANCHOR)
    if set(anchor) != set(like):
        missing = sorted(set(like) - set(anchor))
        extra = sorted(set(anchor) - set(like))
        raise ValueError(f"sync state does not fit: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in anchor.items():
        if t.shape != like[name].shape:
            raise ValueError(
                f"sync state anchor {name} has shape {tuple(t.shape)}, "
                f"expected {tuple(like[name].shape)}"
            )
    return anchor


def _read_offset(state: SyncState, d: Mapping[str, Tensor]) -> None:
    offset = state.offset
    offset.served_by = _read_text(d.get(_SERVED_BY))
    offset.tensors = {}
    for k, t in d.items():
        name = k[len(_OFFSET) :]
        if k.startswith(_OFFSET) and name in state.anchor:
            like = state.anchor[name]
            if t.numel() != like.numel():
                raise ValueError(f"sync state offset {name} has {t.numel()} entries")
            offset.tensors[name] = t.detach().to("cpu", torch.float32).reshape(like.shape).clone()
    sources = _read_text(d.get(_OFFSET_FROM), limit=MAX_PEER_ID * MAX_SOURCES)
    offset.sources = set()
    if offset.tensors and sources is not None:
        offset.sources = {s for s in sources.split("\n")[:MAX_SOURCES] if s}
    heard = d.get(_OFFSET_HEARD)
    offset.heard = int(heard) if heard is not None else state.version


def _text_tensor(text: str) -> Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _read_text(t: Tensor | None, limit: int = MAX_PEER_ID) -> str | None:
    """Text stored by ``_text_tensor`` (None: none, or not text of 1 to ``limit`` bytes)."""
    if t is None or t.dtype != torch.uint8 or t.dim() != 1 or not 0 < t.numel() <= limit:
        return None
    try:
        return bytes(t.tolist()).decode()
    except UnicodeDecodeError:
        return None


def _read_seen(t: Tensor | None, *, floor: int) -> set[tuple[str, int]]:
    """The merged deltas ``write`` wrote: lines that do not read as "sender<TAB>base version"
    are skipped, rounds before ``floor`` (stale anyway) dropped, at most ``MAX_SEEN`` kept."""
    if t is None or t.dtype != torch.uint8 or t.dim() != 1:
        return set()
    seen: set[tuple[str, int]] = set()
    for line in bytes(t.tolist()).decode("utf-8", "replace").splitlines():
        sender, _, b = line.partition("\t")
        if sender and b.isdigit() and len(b) < 19 and int(b) >= floor:
            seen.add((sender, int(b)))
            if len(seen) >= MAX_SEEN:
                break
    return seen


def _read_committed(
    d: Mapping[str, Tensor], *, rounds: range, like: Mapping[str, Tensor]
) -> dict[int, Committed]:
    """The committed sums ``write`` wrote, of ``rounds`` (older ones take no more late deltas).
    A round is read whole or not at all: its count (1 to ``MAX_SEEN``) and, for every tensor
    of ``like``, either a dense float tensor of its size or flat int64 indices, in range and
    increasing, with as many finite values. A round left out counts as never committed here:
    a late delta of it commits the mean of what comes."""
    out: dict[int, Committed] = {}
    for b in rounds:
        count = d.get(f"{_COMMITTED_COUNT}{b}")
        if count is None or count.dtype != torch.int64 or count.numel() != 1:
            continue
        if not 1 <= int(count) <= MAX_SEEN:
            continue
        sums: dict[str, Tensor] = {}
        for name, ref in like.items():
            t = _read_sum(d, f"{b}.{name}", ref.numel())
            if t is None:
                break
            sums[name] = t
        else:
            out[b] = (sums, int(count))
    return out


def _read_sum(d: Mapping[str, Tensor], key: str, numel: int) -> Tensor | None:
    """One tensor of a committed sum (see ``_read_committed``), flat, or None."""
    dense = d.get(_COMMITTED + key)
    if dense is not None:
        if not dense.is_floating_point() or dense.numel() != numel or dense.is_sparse:
            return None
        t = dense.detach().to("cpu", torch.float32).reshape(-1).clone()
        return t if bool(torch.isfinite(t).all()) else None
    at, val = d.get(_COMMITTED_AT + key), d.get(_COMMITTED_VAL + key)
    if at is None or val is None or at.dtype != torch.int64 or not val.is_floating_point():
        return None
    if at.dim() != 1 or val.dim() != 1 or at.numel() != val.numel() or at.numel() > numel:
        return None
    if at.numel() and (int(at[0]) < 0 or int(at[-1]) >= numel or bool((at[1:] <= at[:-1]).any())):
        return None
    values = val.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(values).all()):
        return None
    return torch.sparse_coo_tensor(
        at.reshape(1, -1).clone(), values.clone(), (numel,), check_invariants=True
    ).coalesce()


def _read_ref(norms: Tensor | None, maxabs: Tensor | None, names: list[str]) -> DeltaStats | None:
    """The reference statistics ``write`` wrote, or None when absent or not what they must be
    (one norm per tensor plus the overall one, one largest |x| per tensor, all finite and not
    negative)."""
    if norms is None or maxabs is None or norms.dim() != 1 or maxabs.dim() != 1:
        return None
    if norms.numel() != len(names) + 1 or maxabs.numel() != len(names):
        return None
    n, m = norms.double(), maxabs.double()
    if not (bool(torch.isfinite(n).all()) and bool(torch.isfinite(m).all())):
        return None
    if bool((n < 0).any()) or bool((m < 0).any()) or float(n[0]) <= 0.0:
        return None
    return DeltaStats(
        float(n[0]),
        {name: float(v) for name, v in zip(names, n[1:].tolist(), strict=True)},
        {name: float(v) for name, v in zip(names, m.tolist(), strict=True)},
    )
