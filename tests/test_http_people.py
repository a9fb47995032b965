"""Handlers for people and shared folders (src/notesvc/http/people.py): what the web
client's Share… and its list of shared folders read (issue 52)."""

from __future__ import annotations

import pytest

from conftest import API, data, put_note, with_key


def person(client, anon, name: str) -> tuple:
    """Add a person and claim their first device: (person, a client with their key)."""
    made = data(client.post_json(f"{API}/people", {"name": name}, status=201))
    claim = {"secret": made["pairing"]["secret"], "deviceName": f"{name}'s phone"}
    key = data(anon.post_json(f"{API}/auth/devices/claim", claim, status=201))["key"]
    return made["person"], with_key(anon, key)


def members_url(folder: str) -> str:
    return f"{API}/folders/{folder.replace('/', '%2F')}/members"


def share(as_who, folder: str, *members: tuple, status: int = 200):
    body = {"members": [{"person": p["id"], "scope": scope} for p, scope in members]}
    return as_who.put_json(members_url(folder), body, status=status)


class TestShareCandidates:
    """GET /folders/:path/members names whom the asker may share the folder with."""

    def test_the_owner_is_offered_everyone_but_the_person_whose_home_holds_the_folder(
        self, client, anon
    ):
        put_note(client, "notes/Family/list.md", "milk")
        ann, _ = person(client, anon, "Ann")
        bob, _ = person(client, anon, "bob")
        got = data(client.get(members_url("notes/Family")))
        assert got["candidates"] == [  # by name, case-blind
            {"id": ann["id"], "name": "Ann"},
            {"id": bob["id"], "name": "bob"},
        ]
        put_note(client, "notes/Ann/trips/rome.md", "x")
        got = data(client.get(members_url("notes/Ann/trips")))
        assert got["candidates"] == [{"id": bob["id"], "name": "bob"}]

    def test_a_person_is_offered_the_others_for_their_home_and_no_one_elsewhere(self, client, anon):
        put_note(client, "notes/Family/list.md", "milk")
        ann, as_ann = person(client, anon, "Ann")
        bob, _ = person(client, anon, "Bob")
        share(client, "notes/Family", (ann, "write"))
        put_note(as_ann, "notes/Ann/trips/rome.md", "x")
        mine = data(as_ann.get(members_url("notes/Ann/trips")))
        assert mine == {
            "path": "notes/Ann/trips",
            "members": [],
            "candidates": [{"id": bob["id"], "name": "Bob"}],
        }
        # a folder shared with her, even to write: she reads its members, shares nothing
        family = data(as_ann.get(members_url("notes/Family")))
        assert "candidates" not in family
        assert [m["name"] for m in family["members"]] == ["Ann"]
        share(as_ann, "notes/Family", (bob, "read"), status=403)

    def test_a_read_key_is_offered_no_one(self, client, anon):
        put_note(client, "notes/Family/list.md", "milk")
        person(client, anon, "Ann")
        made = data(client.post_json(f"{API}/auth/keys", {"name": "r", "scope": "read"}))
        got = data(with_key(anon, made["key"]).get(members_url("notes/Family")))
        assert "candidates" not in got

    def test_own_members_come_before_the_inherited_ones(self, client, anon):
        put_note(client, "notes/Family/baking/bread.md", "flour")
        ann, _ = person(client, anon, "Ann")
        bob, _ = person(client, anon, "Bob")
        share(client, "notes/Family", (ann, "read"))
        share(client, "notes/Family/baking", (bob, "write"))
        got = data(client.get(members_url("notes/Family/baking")))["members"]
        assert [(m["name"], m.get("inherited", False), m.get("from")) for m in got] == [
            ("Bob", False, None),
            ("Ann", True, "notes/Family"),
        ]


class TestSharesOfMyOwn:
    """GET /shared's `shares`: the asker's own folders that are shared, with their members."""

    def test_the_owner_sees_every_shared_folder_and_a_person_those_in_their_home(
        self, client, anon
    ):
        put_note(client, "notes/Family/list.md", "milk")
        ann, as_ann = person(client, anon, "Ann")
        bob, as_bob = person(client, anon, "Bob")
        put_note(as_ann, "notes/Ann/trips/rome.md", "x")
        share(client, "notes/Family", (ann, "write"), (bob, "read"))
        share(as_ann, "notes/Ann/trips", (bob, "read"))
        owner = data(client.get(f"{API}/shared"))
        assert owner["folders"] == []
        assert [(s["path"], [m["name"] for m in s["members"]]) for s in owner["shares"]] == [
            ("notes/Ann/trips", ["Bob"]),
            ("notes/Family", ["Ann", "Bob"]),
        ]
        theirs = data(as_ann.get(f"{API}/shared"))
        assert [s["path"] for s in theirs["shares"]] == ["notes/Ann/trips"]
        assert [f["path"] for f in theirs["folders"]] == ["notes/Family"]
        bobs = data(as_bob.get(f"{API}/shared"))
        assert bobs["shares"] == []  # nothing of his own is shared: not a path of the others'
        assert [(f["path"], f["sharedBy"]["name"]) for f in bobs["folders"]] == [
            ("notes/Ann/trips", "Ann"),
            ("notes/Family", "Owner"),
        ]

    @pytest.mark.parametrize("scope", ["read", "write"])
    def test_a_folder_key_of_the_owner_is_told_of_no_share(self, client, anon, scope):
        put_note(client, "notes/Family/list.md", "milk")
        ann, _ = person(client, anon, "Ann")
        share(client, "notes/Family", (ann, "read"))
        body = {"name": "k", "scope": scope, "folder": "notes/kitchen"}
        made = data(client.post_json(f"{API}/auth/keys", body))
        assert data(with_key(anon, made["key"]).get(f"{API}/shared"))["shares"] == []
