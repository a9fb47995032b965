"""People on one server: each with a home folder, and the folders shared between them.

The owner (whoever holds the server key) adds people; each person's devices, keys and
connectors are grants (grants.py) that carry the person's id, and reach_of() there decides
what they see: their home, and the folders shared with them at the share's scope. This
module keeps the people and the folders' members in the state file (`people`, `members`),
so a change holds at once in every thread.
"""

from __future__ import annotations

import re
import secrets
import time
import unicodedata
from typing import Any, Callable

from notesvc.auth import StateStore
from notesvc.boot import log
from notesvc.errors import ApiError, bad_request, not_found
from notesvc.grants import GrantStore, Principal, epoch_of, inside
from notesvc.helpers import is_blank, iso
from notesvc.notes.paths import NOTES, check_segments, folder_path
from notesvc.notes.store import NoteStore

MAX_PEOPLE = 50
MAX_NAME_CHARS = 64
PERSON_ID_RE = re.compile(r"^p_[A-Za-z0-9_-]{10}\Z")
SHARE_SCOPES = ("read", "write")
OWNER_SHARER = {"id": "owner", "name": "Owner"}  # who shared, when the owner did


def person_name(raw: Any) -> str:
    """Return a person's name checked: 1-64 characters after NFC, and usable as the name
    of their home folder (the path rules of notes: no /, no leading dot, no control, bidi
    or zero-width character, none of \\ : * ? " < > |); 400 naming the rule otherwise."""
    if not isinstance(raw, str):
        raise bad_request("'name' must be a string")
    if any(unicodedata.category(c) == "Cc" for c in raw):
        raise bad_request("'name' holds a control character")
    name = " ".join(unicodedata.normalize("NFC", raw).split())
    if is_blank(name):
        raise bad_request("'name' must not be empty")
    if len(name) > MAX_NAME_CHARS:
        raise bad_request(f"'name' is longer than {MAX_NAME_CHARS} characters")
    if "/" in name:
        raise bad_request("'name' holds a /: a person's name is one folder name")
    try:
        check_segments(f"{NOTES}/{name}", "home folder")
    except ApiError as e:
        raise bad_request(f"'name' cannot name a folder: {e.message}") from None
    return name


class PeopleStore:
    """The people of this server and the members of its shared folders (state.json's
    `people` and `members`); their grants live in the GrantStore beside it."""

    def __init__(
        self, state: StateStore, grants: GrantStore, notes: NoteStore, clock: Callable = time.time
    ):
        self.state, self.grants, self.notes, self.clock = state, grants, notes, clock
        # (data, the person's id) -> None, run inside a removal's state change: what a
        # person holds beyond grants (the chats bound to them) ends with them in one write
        self.on_remove: list = []
        # () -> None, after a change of who reaches what (a share, a removal, a move): the
        # change feeds waiting for someone look at their reach again
        self.after_change: list = []
        # drain(people=...): wait for the writes people had begun (the Service's), after a
        # share that narrowed them is written
        self.drain: Callable = lambda grants=(), people=(): None

    # -- reading ------------------------------------------------------------------------

    def people(self, data: dict | None = None) -> list:
        return list((data or self.state.read()).get("people", []))

    def get(self, person_id: Any, data: dict | None = None) -> dict | None:
        if not isinstance(person_id, str):
            return None
        return next((p for p in self.people(data) if p["id"] == person_id), None)

    def home_of(self, person_id: str) -> str:
        """Return a person's home folder ("" for the owner, or someone gone)."""
        person = self.get(person_id) if person_id else None
        return person["home"] if person else ""

    def holder(self, path: str) -> str:
        """Return the id of the person whose home holds a path ("": nobody's, the owner's)."""
        person = next((p for p in self.people() if inside(path, p["home"])), None)
        return person["id"] if person else ""

    def name_of(self, person_id: str, data: dict | None = None) -> str:
        person = self.get(person_id, data)
        return person["name"] if person else "someone"

    def listed(self) -> list:
        """Return the people with how many devices each has and when one was last used."""
        data = self.state.read()
        grants = {g["id"]: g for g in self.grants.grants()}
        out = []
        for p in self.people(data):
            devices = [g for g in grants.values() if g.get("person") == p["id"]]
            used = [g["lastUsedAt"] for g in devices if g.get("lastUsedAt")]
            out.append(
                {
                    "id": p["id"],
                    "name": p["name"],
                    "home": p["home"],
                    "createdAt": p["createdAt"],
                    "devices": sum(g["kind"] == "device" for g in devices),
                    "lastUsedAt": max(used, key=epoch_of) if used else None,
                }
            )
        return out

    @staticmethod
    def public(person: dict) -> dict:
        return {k: person.get(k) for k in ("id", "name", "home", "createdAt", "createdBy")}

    # -- adding, renaming, removing -----------------------------------------------------

    def add(
        self, raw_name: Any, raw_home: Any, *, created_by: str, then: Callable | None = None
    ) -> dict:
        """Add a person with a home folder (notes/<name>, or `raw_home` when given: a folder
        under notes/ that does not exist and lies in no other home); return them. 409 for a
        taken name or home, or at MAX_PEOPLE. then(data, person), when given, runs in the
        same state change (their first pairing): one write, and its refusal adds no one."""
        name = person_name(raw_name)
        home = f"{NOTES}/{name}" if raw_home is None else folder_path(raw_home)
        if home == NOTES or not home.startswith(NOTES + "/"):
            raise bad_request(f"'home' must be a folder under {NOTES}/")
        now = self.clock()
        person = {
            "id": "p_" + secrets.token_urlsafe(8)[:10],
            "name": name,
            "home": home,
            "createdAt": iso(now),
            "createdBy": created_by,
        }

        def change(data: dict) -> dict:
            people = data.setdefault("people", [])
            if len(people) >= MAX_PEOPLE:
                raise ApiError(409, "CONFLICT", f"{MAX_PEOPLE} people live here already")
            self._check_name(people, name, None)
            for p in people:
                if inside(home, p["home"]) or inside(p["home"], home):
                    raise ApiError(
                        409, "CONFLICT", f"{home} lies in {p['name']}'s home, or holds it"
                    )
            above = [f for f in data.get("members", {}) if inside(home, f) and f != home]
            shared = next((f for f in above if self.notes.on_disk(f).is_dir()), None)
            if shared is not None:  # (its members would read the home)
                raise ApiError(
                    409,
                    "CONFLICT",
                    f"{home} lies in {shared}, a shared folder: its members would read it; "
                    "give 'home' a folder outside it",
                )
            if self.notes.on_disk(home).exists():
                raise ApiError(
                    409,
                    "CONFLICT",
                    f"a folder {home} exists already: pick another name, or give 'home' a "
                    "free folder for them",
                )
            people.append(person)
            # setup is done once someone else lives here: its page (open to the home network
            # while setup is unfinished) must never hand a person the owner's key
            data["setupComplete"] = True
            data.pop("apiKey", None)
            # a home starts unshared: members left on a folder of that path, or above it,
            # that is gone (taken away by hand) were the old folder's, never the new person's
            members = data.get("members", {})
            stale = [f for f in members if inside(f, home) or inside(home, f)]  # (all gone)
            for folder in stale:
                del members[folder]
            if then is not None:
                then(data, person)
            return stale

        if self.state.update(change):
            self._changed()  # (the stale members' feeds wake and see them gone)
        try:
            self.notes.on_disk(home).mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:  # the home appears with their first note anyway
            log.warning("people: the home folder of %s was not made (%s)", person["id"], e)
        log.info("person %s added (home %s)", person["id"], home)
        return person

    @staticmethod
    def _check_name(people: list, name: str, but: str | None) -> None:
        folded = name.casefold()
        if any(p["name"].casefold() == folded and p["id"] != but for p in people):
            raise ApiError(409, "CONFLICT", f"someone here is called {name} already")

    def rename(self, person_id: str, raw_name: Any) -> dict:
        """Rename a person (their home keeps its name); 404 for an unknown id."""
        name = person_name(raw_name)

        def change(data: dict) -> dict:
            person = self.get(person_id, data)
            if person is None:
                raise not_found(f"no person {person_id[:40]}")
            self._check_name(data.get("people", []), name, person_id)
            person["name"] = name
            return dict(person)

        return self.state.update(change)

    def remove(self, person_id: str) -> list:
        """Remove a person: in one state change every grant they hold ends (devices, keys,
        connectors, and what those made: share links, feeds, chat links), their pairings,
        their memberships and the chats bound to them; their notes stay where they are.
        Return the grant ids ended; 404 for an unknown id."""

        def change(data: dict) -> list:
            if self.get(person_id, data) is None:
                raise not_found(f"no person {person_id[:40]}")
            gone = self.grants.grants_of_person(data, person_id)
            self.grants.end_grants(data, gone)
            data["pairings"] = [p for p in data.get("pairings", []) if p.get("person") != person_id]
            data["people"] = [p for p in data.get("people", []) if p["id"] != person_id]
            members = data.get("members", {})
            for folder in list(members):
                members[folder] = [m for m in members[folder] if m["person"] != person_id]
                if not members[folder]:
                    del members[folder]
            for hook in self.on_remove:
                hook(data, person_id)
            return gone

        gone = self.state.update(change)
        self.grants.ended(gone)
        self._changed()
        log.info("person %s removed (%d grants ended)", person_id, len(gone))
        return gone

    def _changed(self) -> None:
        for hook in self.after_change:
            hook()

    # -- sharing --------------------------------------------------------------------------

    def members(self, folder: str) -> list:
        """Return a folder's members: its own, then those it inherits from the folders above
        it (`inherited: true`), each with the person's name and who shared."""
        data = self.state.read()
        out = []
        shares = data.get("members", {}).items()
        for at, entries in sorted(shares, key=lambda s: (s[0] != folder, s[0])):  # own first
            if not inside(folder, at):
                continue
            for m in entries:
                row = self._member_row(m, data)
                if at != folder:
                    row.update({"inherited": True, "from": at})
                out.append(row)
        return out

    def _member_row(self, m: dict, data: dict) -> dict:
        return {
            "person": m["person"],
            "name": self.name_of(m["person"], data),
            "scope": m["scope"],
            "sharedBy": self.sharer(m.get("sharedBy"), data),
        }

    def sharer(self, by: Any, data: dict | None = None) -> dict:
        """Return {id, name} of who shared: a person, or the owner."""
        person = self.get(by, data) if by else None
        return {"id": person["id"], "name": person["name"]} if person else dict(OWNER_SHARER)

    def set_members(self, folder: str, raw: Any, principal: Principal) -> list:
        """Replace a folder's own members with `raw` ([{person, scope}]); return them.

        The owner shares any folder; a person a folder inside their home (403 elsewhere).
        Each member is a person other than the one sharing and other than the folder's own
        person (whose home holds it): 400 for an unknown id, oneself, a repeat or a bad
        scope. Members of the folders above are kept (a deeper share adds, never takes)."""
        if not isinstance(raw, list) or len(raw) > MAX_PEOPLE:
            raise bad_request(f"'members' must be a list of at most {MAX_PEOPLE} people")
        data = self.state.read()
        sharer = principal.person
        if sharer:
            me = self.get(sharer, data)
            if me is None or not inside(folder, me["home"]):
                raise ApiError(403, "FORBIDDEN", "a person shares folders of their own home only")
        owner_home = next((p for p in self.people(data) if inside(folder, p["home"])), None)
        wanted, seen = [], set()
        for item in raw:
            if not isinstance(item, dict):
                raise bad_request("each member is an object {person, scope}")
            pid, scope = item.get("person"), item.get("scope", "read")
            if not isinstance(pid, str):
                raise bad_request("a member's 'person' is a person's id")
            if self.get(pid, data) is None:
                raise bad_request(f"no person {pid[:40]!r} to share with")
            if scope not in SHARE_SCOPES:
                raise bad_request(f"a member's scope is one of {', '.join(SHARE_SCOPES)}")
            if pid == sharer or (owner_home is not None and pid == owner_home["id"]):
                raise bad_request("a folder is not shared with the person whose home holds it")
            if pid in seen:
                raise bad_request(f"{pid} is named twice")
            seen.add(pid)
            wanted.append({"person": pid, "scope": scope, "sharedBy": sharer or "owner"})
        if not self.notes.on_disk(folder).is_dir():
            raise not_found(f"no folder at {folder}")

        def change(d: dict) -> None:
            members = d.setdefault("members", {})
            known = {p["id"] for p in d.get("people", [])}
            kept = [m for m in wanted if m["person"] in known]  # (one removed meanwhile)
            if kept:
                members[folder] = kept
            else:
                members.pop(folder, None)
            self.grants.drop_unreached_shares(d)  # a member's links to what they lost die

        before = {m["person"] for m in data.get("members", {}).get(folder, [])}
        self.state.update(change)
        self.drain(people=before)  # their writes begun before: done before we answer
        self._changed()
        log.info("folder %s shared with %d people", folder, len(wanted))
        return [self._member_row(m, self.state.read()) for m in wanted]

    def shared_with(self, person_id: str) -> list:
        """Return the folders shared with a person: [{path, scope, sharedBy}]."""
        data = self.state.read()
        out = []
        for folder, entries in sorted(data.get("members", {}).items()):
            for m in entries:
                if m["person"] == person_id:
                    by = self.sharer(m.get("sharedBy"), data)
                    out.append({"path": folder, "scope": m["scope"], "sharedBy": by})
        return out

    def check_folder_change(self, principal: Principal, src: str, dst: str | None) -> None:
        """Refuse a move of the folder `src` to `dst` (None: its deletion) that would tear a
        household apart. A person (403) never moves or deletes a folder their reach starts
        at (their home, a folder shared with them) nor one holding anyone's home, and moves
        a folder that is shared (or holds one that is) only within their own home, where
        they may share. Nobody (409) moves a home or a shared folder out of notes/, or a
        home into another home (or around one). Homes and members then follow the move
        (folder_moved)."""
        data = self.state.read()
        homes = [p["home"] for p in self.people(data)]
        notes = src.startswith(NOTES + "/")
        holds_home = [h for h in homes if inside(h, src)] if notes else []
        holds_share = [f for f in data.get("members", {}) if inside(f, src)] if notes else []
        if principal.person:
            where = principal.reach.folder_of(src)
            if any(where == folder for folder, _ in principal.reach.folders):
                raise ApiError(
                    403,
                    "FORBIDDEN",
                    f"{src} is where this key's reach starts (a home, or a folder shared "
                    "with it): move or delete what is in it, not the folder itself",
                )
            if holds_home:
                raise ApiError(
                    403, "FORBIDDEN", f"{src} holds a person's home: only the owner moves it"
                )
            me = self.get(principal.person, data)
            mine = me is not None and inside(src, me["home"])
            if holds_share and dst is not None and not (mine and inside(dst, me["home"])):
                raise ApiError(
                    403,
                    "FORBIDDEN",
                    f"{src} is shared (or holds a shared folder): it moves within its "
                    "sharer's home only; unshare it first, or ask the owner",
                )
        if dst is None or not (holds_home or holds_share):
            return
        if not dst.startswith(NOTES + "/"):
            raise ApiError(409, "CONFLICT", "a home or a shared folder stays under notes/")
        for home in holds_home:
            there = dst + home[len(src) :]
            if any(o not in holds_home and (inside(there, o) or inside(o, there)) for o in homes):
                raise ApiError(
                    409, "CONFLICT", f"{home} would lie in another person's home, or hold one"
                )

    def folder_deleted(self, folder: str) -> None:
        """Forget the members of a folder deleted whole and of the folders in it: a folder
        made later at that path (a new person's home, say) is not shared with them."""
        if not any(inside(f, folder) for f in self.state.read().get("members", {})):
            return

        def change(d: dict) -> None:
            members = d.get("members", {})
            for f in [f for f in members if inside(f, folder)]:
                del members[f]

        self.state.update(change)
        self._changed()
        log.info("people: the shares in %s end with it", folder)

    def folder_moved(self, old: str, new: str) -> None:
        """Keep homes and members on a folder that moves (old -> new, under notes/), and the
        share links of the notes in it: called before its notes move, so a person's home
        and their links never part (called back, new -> old, when the move fails)."""

        def moved(path: str) -> str:
            return new + path[len(old) :] if inside(path, old) else path

        data = self.state.read()
        if not any(inside(p["home"], old) for p in self.people(data)) and not any(
            inside(f, old) for f in data.get("members", {})
        ):
            return

        def change(d: dict) -> None:
            for p in d.get("people", []):
                p["home"] = moved(p["home"])
            d["members"] = {moved(f): m for f, m in d.get("members", {}).items()}
            for share in d.get("shares", []):  # (ahead of its note: it stays its maker's)
                share["path"] = moved(share["path"])

        self.state.update(change)
        self._changed()
        log.info("people: homes and shares follow %s to %s", old, new)
