"""Handlers for people and shared folders: a household on one server (docs/api.md: People)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from notesvc.boot import bottle
from notesvc.errors import ApiError, bad_request, not_found
from notesvc.grants import clean_name, inside, made_by, request_principal, visible_folders
from notesvc.helpers import field, read_json
from notesvc.http.access import new_pairing, pairing_answer
from notesvc.notes.paths import NOTES, folder_path
from notesvc.people import PeopleStore

if TYPE_CHECKING:  # annotations only: these modules come later
    from notesvc.service import Service


def _person(svc: Service, person_id: str) -> dict:
    person = svc.people.get(person_id)
    if person is None:
        raise not_found(f"no person {person_id[:40]}")
    return person


def add_person(svc: Service) -> dict:
    """POST /people (the owner): a person, their home, and a pairing for their first
    device (admin for their own things, ten minutes, once)."""
    body = read_json(svc.config.max_body_bytes)
    who = request_principal()
    made: dict = {}

    def first_device(data: dict, person: dict) -> None:  # in the same state write
        name = clean_name(f"{person['name']}'s first device", "device")
        record, secret = svc.grants.pairing_record(
            name,
            "admin",
            None,
            svc.config.pairing_ttl,
            created_by=made_by(who),
            person=person["id"],
        )
        made["record"], made["secret"] = svc.grants.add_pairing(data, record), secret

    person = svc.people.add(
        body.get("name"), body.get("home"), created_by=made_by(who), then=first_device
    )
    svc.grants.log_pairing(made["record"])
    env = bottle.request.environ
    state = svc.state.read()
    pairing = pairing_answer(svc.config, state, env, made["record"], made["secret"])
    bottle.response.status = 201
    return {"person": PeopleStore.public(person), "pairing": pairing}


def list_people(svc: Service) -> dict:
    return {"people": svc.people.listed()}


def rename_person(svc: Service, person_id: str) -> dict:
    body = read_json(svc.config.max_body_bytes)
    if "name" not in body:
        raise bad_request("'name' is required")
    return {"person": PeopleStore.public(svc.people.rename(person_id, body["name"]))}


def remove_person(svc: Service, person_id: str) -> dict:
    """DELETE /people/:id: everything the person holds ends at once; their notes stay."""
    gone = svc.people.remove(person_id)
    return {"id": person_id, "removed": True, "revoked": gone}


def create_person_pairing(svc: Service, person_id: str) -> dict:
    """POST /people/:id/pairings (the owner): a pairing for one more device of a person,
    in their reach (a folder of it, when asked)."""
    person = _person(svc, person_id)
    body = read_json(svc.config.max_body_bytes, required=False)
    name = clean_name(field(body, "name", required=False, max_len=100), "device")
    scope = field(body, "scope", required=False) or "write"
    raw = field(body, "folder", required=False)
    folder = folder_path(raw) if raw is not None else NOTES
    if folder != NOTES and not svc.grants.person_sees(person_id, folder):
        raise not_found(f"no folder at {folder} in {person['name']}'s reach")
    env, who = bottle.request.environ, request_principal()
    folder_or_none = None if folder == NOTES else folder
    answer = new_pairing(
        svc.config, svc.grants, name, scope, folder_or_none, env, made_by(who), person_id
    )
    bottle.response.status = 201
    return answer


def _shared_folder(svc: Service, raw: str) -> str:
    """Return a folder whose members the request may see: inside its reach (404 beyond)."""
    folder, shown = visible_folders(svc, raw)
    if shown != (folder,) or folder == NOTES:
        raise (
            not_found(f"no folder at {folder}")
            if folder != NOTES
            else bad_request(f"{NOTES} itself is not shared: share a folder in it")
        )
    return folder


def get_members(svc: Service, path: str) -> dict:
    """GET /folders/:path/members: the folder's members (its own, then the inherited ones)
    and, for a principal who may share it, `candidates`: the people it may be shared with
    (everyone but the one sharing and the person whose home holds it), so a person's Share
    dialog can name them without the owner's list of people."""
    folder = _shared_folder(svc, path)
    if not svc.notes.on_disk(folder).is_dir():  # (moved away, or never made)
        raise not_found(f"no folder at {folder}")
    answer = {"path": folder, "members": svc.people.members(folder)}
    who = request_principal()
    data = svc.state.read()
    homes = {p["id"]: p["home"] for p in svc.people.people(data)}
    may_share = who.allows("write") and (who.whole or who.may_write(folder))
    if may_share and (not who.person or inside(folder, homes.get(who.person, NOTES + "/"))):
        holder = next((pid for pid, home in homes.items() if inside(folder, home)), None)
        answer["candidates"] = [
            {"id": p["id"], "name": p["name"]}
            for p in sorted(svc.people.people(data), key=lambda p: p["name"].casefold())
            if p["id"] not in (who.person, holder)
        ]
    return answer


def put_members(svc: Service, path: str) -> dict:
    """PUT /folders/:path/members {members: [{person, scope}]}: replaces the folder's own
    members (write on the folder; a person's, inside their home)."""
    folder = _shared_folder(svc, path)
    who = request_principal()
    if not who.whole and not who.may_write(folder):
        raise ApiError(403, "FORBIDDEN", f"sharing {folder} needs the write scope there")
    body = read_json(svc.config.max_body_bytes)
    if "members" not in body:
        raise bad_request("'members' is required: a list of {person, scope}")
    svc.people.set_members(folder, body["members"], who)
    return {"path": folder, "members": svc.people.members(folder)}


def list_shared_with_me(svc: Service) -> dict:
    """GET /shared: the folders shared with the person asking (none for the owner), and
    `shares`: the shared folders that are the asker's own, with their members (a person's:
    those in their home, whoever shared them; the owner's: every shared folder), so a list
    can mark what is shared and with whom."""
    who = request_principal()
    data = svc.state.read()
    me = svc.people.get(who.person, data) if who.person else None
    shares = []
    for folder in sorted(data.get("members", {})):
        mine = inside(folder, me["home"]) if me else who.whole and who.allows("write")
        if mine and who.sees(folder):
            shares.append({"path": folder, "members": svc.people.members(folder)})
    folders = svc.people.shared_with(who.person) if who.person else []
    return {"folders": folders, "shares": shares}
