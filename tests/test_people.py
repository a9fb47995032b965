"""People on one server: homes, shared folders, reach (src/notesvc/people.py, grants.py)."""

from __future__ import annotations

import shutil
import threading

import pytest

from conftest import (
    API,
    KEY,
    LOCAL,
    assert_error,
    data,
    note_url,
    put_note,
    search,
    with_key,
)


def add_person(client, name: str, status: int = 201, **body) -> dict:
    resp = client.post_json(f"{API}/people", {"name": name, **body}, status=status)
    return data(resp) if status == 201 else resp


def device_of(client, anon, name: str, **body) -> tuple:
    """Add a person and claim their first pairing: (person, a client with their key)."""
    made = add_person(client, name, **body)
    claim = {"secret": made["pairing"]["secret"], "deviceName": f"{name}'s phone"}
    key = data(anon.post_json(f"{API}/auth/devices/claim", claim, status=201))["key"]
    return made["person"], with_key(anon, key)


def paths(answer: dict) -> list:
    return [n["path"] for n in answer["notes"]]


class TestPeople:
    def test_adding_a_person_makes_their_home_and_a_pairing_for_their_first_device(
        self, client, root
    ):
        made = add_person(client, "Ann")
        person, pairing = made["person"], made["pairing"]
        assert person["id"].startswith("p_")
        assert len(person["id"]) == 12
        assert person["home"] == "notes/Ann"
        assert (root / "notes" / "Ann").is_dir()
        assert pairing["scope"] == "admin"
        assert pairing["person"] == person["id"]
        assert pairing["secret"]
        assert pairing["url"].endswith("#pair=" + pairing["secret"])
        listed = data(client.get(f"{API}/people"))["people"]
        assert [(p["name"], p["devices"]) for p in listed] == [("Ann", 0)]

    @pytest.mark.parametrize(
        ("name", "code"),
        [
            ("", "VALIDATION_ERROR"),
            ("   ", "VALIDATION_ERROR"),
            ("a/b", "VALIDATION_ERROR"),
            ("..", "VALIDATION_ERROR"),
            (".notesvc", "VALIDATION_ERROR"),
            ("evil\u202eman", "VALIDATION_ERROR"),
            ("tab\there", "VALIDATION_ERROR"),
            ("x" * 65, "VALIDATION_ERROR"),
            (42, "VALIDATION_ERROR"),
        ],
    )
    def test_a_name_that_cannot_name_a_folder_is_refused(self, client, name, code):
        assert_error(add_person(client, name, status=400), 400, code)
        assert data(client.get(f"{API}/people"))["people"] == []

    def test_names_are_unique_case_blind_after_nfc_and_a_taken_folder_needs_a_home(self, client):
        add_person(client, "Ren\u00e9")
        assert_error(add_person(client, "rene\u0301", status=409), 409, "CONFLICT")
        put_note(client, "notes/Bob/old.md", "the owner's")
        assert_error(add_person(client, "Bob", status=409), 409, "CONFLICT")
        assert add_person(client, "Bob", home="notes/people/bob")["person"]["home"] == (
            "notes/people/bob"
        )
        assert_error(add_person(client, "Eve", home="notes/people", status=409), 409, "CONFLICT")

    @pytest.mark.slow
    def test_at_most_fifty_people(self, client):
        for i in range(50):
            add_person(client, f"p{i}")
        assert_error(add_person(client, "one more", status=409), 409, "CONFLICT")

    @pytest.mark.slow
    def test_a_person_and_their_first_pairing_are_one_write_and_a_refusal_adds_no_one(
        self, client, root, monkeypatch
    ):
        state = client.app.service.state
        writes = []
        update = state.update
        monkeypatch.setattr(state, "update", lambda change: writes.append(1) or update(change))
        ann = add_person(client, "Ann")
        assert len(writes) == 1  # the person and their pairing in one durable write
        claim = {"secret": ann["pairing"]["secret"], "deviceName": "Ann's phone"}
        state_now = state.read()
        assert [p["id"] for p in state_now["people"]] == [ann["person"]["id"]]
        assert [p["id"] for p in state_now["pairings"]] == [ann["pairing"]["id"]]
        pid = ann["person"]["id"]
        for i in range(49):  # 50 of the people's pairings now wait
            client.post_json(f"{API}/people/{pid}/pairings", {"name": f"d{i}"}, status=201)
        refused = add_person(client, "Bob", status=409)
        assert_error(refused, 409, "CONFLICT")
        assert [p["name"] for p in data(client.get(f"{API}/people"))["people"]] == ["Ann"]
        assert not (root / "notes" / "Bob").exists()
        client.post_json(f"{API}/auth/devices/claim", claim, status=201)  # Ann's still works

    def test_once_a_person_lives_here_the_setup_page_never_shows_the_owners_key(self, client, anon):
        key = client.extra_environ["HTTP_X_SERVICE_KEY"]
        setup = data(anon.get(f"{API}/system/setup", extra_environ=LOCAL))
        assert (setup["apiKey"], setup["setupComplete"]) == (key, False)  # not set up yet
        device_of(client, anon, "Ann")  # on the home network, as setup's page allows
        setup = data(anon.get(f"{API}/system/setup", extra_environ=LOCAL))
        assert key not in str(setup)
        assert setup["setupComplete"] is True
        client.get(f"{API}/notes")  # the owner's key itself goes on working

    def test_a_home_never_lies_in_a_shared_folder_whose_members_would_read_it(
        self, client, anon, root
    ):
        put_note(client, "notes/Family/list.md", "bread")
        ann, as_ann = device_of(client, anon, "Ann")
        body = {"members": [{"person": ann["id"], "scope": "write"}]}
        client.put_json(f"{API}/folders/notes%2FFamily/members", body)
        resp = add_person(client, "Kid", status=409, home="notes/Family/kid")
        assert "shared" in assert_error(resp, 409, "CONFLICT")["message"]
        as_ann.get(f"{API}/folders/tree/notes%2FFamily%2Fkid", status=404)
        assert add_person(client, "Kid", home="notes/kid")["person"]["home"] == "notes/kid"
        shutil.rmtree(root / "notes" / "Family")  # gone (by hand): its members with it
        add_person(client, "Lou", home="notes/Family/lou")
        assert data(as_ann.get(f"{API}/shared"))["folders"] == []

    def test_a_person_is_renamed_and_their_home_keeps_its_name(self, client):
        pid = add_person(client, "Ann")["person"]["id"]
        renamed = data(client.patch_json(f"{API}/people/{pid}", {"name": "Annie"}))["person"]
        assert (renamed["name"], renamed["home"]) == ("Annie", "notes/Ann")
        client.patch_json(f"{API}/people/p_nobodyhere", {"name": "x"}, status=404)


class TestReach:
    def test_a_person_sees_their_home_only_until_something_is_shared(self, client, anon):
        put_note(client, "notes/owner/secret.md", "the owner's diary")
        _ann, as_ann = device_of(client, anon, "Ann")
        put_note(as_ann, "notes/Ann/list.md", "milk")
        assert paths(data(as_ann.get(f"{API}/notes"))) == ["notes/Ann/list.md"]
        as_ann.get(note_url("notes/owner/secret.md"), status=404)
        assert search(as_ann, "diary")["total"] == 0
        assert search(client, "diary")["total"] == 1  # the owner sees everything
        as_ann.post_json(f"{API}/notes", {"path": "notes/owner/x.md", "content": "x"}, status=404)

    def test_a_note_without_a_path_goes_to_their_inbox(self, client, anon):
        _, as_ann = device_of(client, anon, "Ann")
        made = data(as_ann.post_json(f"{API}/notes", {"content": "# Call mum\n"}, status=201))
        assert made["path"] == "notes/Ann/inbox/Call mum.md"

    def test_a_shared_folder_joins_the_reach_at_its_scope(self, client, anon):
        put_note(client, "notes/Family/shopping.md", "bread")
        put_note(client, "notes/Family/plans.md", "holiday")
        ann, as_ann = device_of(client, anon, "Ann")
        body = {"members": [{"person": ann["id"], "scope": "read"}]}
        shared = data(client.put_json(f"{API}/folders/notes%2FFamily/members", body))
        assert [(m["name"], m["scope"]) for m in shared["members"]] == [("Ann", "read")]
        assert paths(data(as_ann.get(f"{API}/notes"))) == [
            "notes/Family/plans.md",
            "notes/Family/shopping.md",
        ]
        assert search(as_ann, "bread")["total"] == 1
        resp = as_ann.put_json(note_url("notes/Family/shopping.md"), {"content": "x"}, status=403)
        assert "read" in assert_error(resp, 403, "FORBIDDEN")["message"]
        mine = data(as_ann.get(f"{API}/shared"))["folders"]
        assert mine == [
            {"path": "notes/Family", "scope": "read", "sharedBy": {"id": "owner", "name": "Owner"}}
        ]
        body["members"][0]["scope"] = "write"
        client.put_json(f"{API}/folders/notes%2FFamily/members", body)
        as_ann.put_json(note_url("notes/Family/shopping.md"), {"content": "bread, eggs"})
        client.put_json(f"{API}/folders/notes%2FFamily/members", {"members": []})
        as_ann.get(note_url("notes/Family/shopping.md"), status=404)  # cut at once

    def test_a_folder_deleted_takes_its_members_and_a_new_home_there_starts_unshared(
        self, client, anon, dav, root
    ):
        bob, as_bob = device_of(client, anon, "Bob")
        for folder in ("notes/Temp", "notes/Gone"):
            put_note(client, f"{folder}/a.md", "the owner's")
            body = {"members": [{"person": bob["id"], "scope": "read"}]}
            client.put_json(f"{API}/folders/{folder.replace('/', '%2F')}/members", body)
        dav("DELETE", "notes/Temp", status=204)  # deleted whole: its shares end with it
        shutil.rmtree(root / "notes" / "Gone")  # taken away by hand on the machine
        shared = [f["path"] for f in data(as_bob.get(f"{API}/shared"))["folders"]]
        assert shared == ["notes/Gone"]
        for name in ("Temp", "Gone"):  # a new person whose home is the old folder's path
            _, as_new = device_of(client, anon, name)
            put_note(as_new, f"notes/{name}/diary.md", "mine alone")
            as_bob.get(note_url(f"notes/{name}/diary.md"), status=404)
            assert data(client.get(f"{API}/folders/notes%2F{name}/members"))["members"] == []
        assert data(as_bob.get(f"{API}/shared"))["folders"] == []

    def test_a_key_narrowed_to_a_share_that_ends_reaches_nothing_not_everything(self, client, anon):
        put_note(client, "notes/owner/secret.md", "the owner's diary")
        put_note(client, "notes/Family/list.md", "bread #shop")
        ann, as_ann = device_of(client, anon, "Ann")
        put_note(as_ann, "notes/Ann/mine.md", "her own diary")
        members = f"{API}/folders/notes%2FFamily/members"
        client.put_json(members, {"members": [{"person": ann["id"], "scope": "read"}]})
        body = {"name": "family only", "scope": "write", "folder": "notes/Family"}
        narrow = with_key(anon, data(as_ann.post_json(f"{API}/auth/keys", body))["key"])
        link = data(narrow.post_json(f"{API}/shares", {"path": "notes/Family/list.md"}))
        token = link["url"].rsplit("/", 1)[-1]
        assert paths(data(narrow.get(f"{API}/notes"))) == ["notes/Family/list.md"]
        client.put_json(members, {"members": []})  # the share ends: the key reaches nothing
        assert data(narrow.get(f"{API}/notes"))["notes"] == []
        assert search(narrow, "diary")["total"] == 0
        narrow.get(note_url("notes/owner/secret.md"), status=404)
        narrow.get(note_url("notes/Ann/mine.md"), status=404)
        assert data(narrow.get(f"{API}/folders/tree"))["children"] == []
        assert data(narrow.get(f"{API}/changes"))["changes"] == []
        assert data(narrow.get(f"{API}/plugins/tags"))["tags"] == []
        assert data(narrow.post_json(f"{API}/auth/verify", {}))["reach"] == []
        anon.get(f"{API}/shared/{token}", status=404)  # a link dies with its maker's reach
        mcp = {"jsonrpc": "2.0", "id": 1, "method": "tools/call"}
        mcp["params"] = {"name": "read_note", "arguments": {"path": "notes/owner/secret.md"}}
        answer = narrow.post_json(f"{API}/mcp", mcp).json["result"]
        assert answer["isError"] is True

    def test_a_person_shares_folders_of_their_home_only(self, client, anon):
        ann, as_ann = device_of(client, anon, "Ann")
        bob, as_bob = device_of(client, anon, "Bob")
        put_note(as_ann, "notes/Ann/Trips/rome.md", "colosseum")
        put_note(client, "notes/Family/x.md", "x")
        body = {"members": [{"person": bob["id"], "scope": "write"}]}
        as_ann.put_json(f"{API}/folders/notes%2FAnn%2FTrips/members", body)
        assert search(as_bob, "colosseum")["total"] == 1
        as_ann.put_json(f"{API}/folders/notes%2FFamily/members", body, status=404)
        resp = as_ann.put_json(
            f"{API}/folders/notes%2FAnn%2FTrips/members",
            {"members": [{"person": ann["id"], "scope": "read"}]},
            status=400,
        )
        assert_error(resp, 400, "VALIDATION_ERROR")
        resp = as_ann.put_json(
            f"{API}/folders/notes%2FAnn%2FTrips/members",
            {"members": [{"person": "p_nobodyhere", "scope": "read"}]},
            status=400,
        )
        assert_error(resp, 400, "VALIDATION_ERROR")
        shared = data(as_bob.get(f"{API}/shared"))["folders"]
        assert shared[0]["sharedBy"] == {"id": ann["id"], "name": "Ann"}

    def test_a_persons_admin_is_their_own_things_only(self, client, anon):
        _, as_ann = device_of(client, anon, "Ann")
        as_ann.get(f"{API}/people", status=403)
        as_ann.post_json(f"{API}/people", {"name": "Eve"}, status=403)
        as_ann.get(f"{API}/security/audit", status=403)
        as_ann.post(f"{API}/auth/rotate", status=403)
        key = data(
            as_ann.post_json(f"{API}/auth/keys", {"name": "laptop", "scope": "read"}, status=201)
        )
        assert key["person"]
        owner_key = data(client.post_json(f"{API}/auth/keys", {"name": "o", "scope": "read"}))
        mine = [k["name"] for k in data(as_ann.get(f"{API}/auth/keys"))["keys"]]
        assert "o" not in mine
        assert "laptop" in mine
        as_ann.delete(f"{API}/auth/keys/{owner_key['id']}", status=404)
        as_ann.post_json(
            f"{API}/auth/keys", {"name": "k", "scope": "read", "folder": "notes/x"}, status=404
        )

    @pytest.mark.slow
    def test_removing_a_person_ends_their_keys_at_once_in_every_thread(self, client, anon):
        ann, as_ann = device_of(client, anon, "Ann")
        put_note(as_ann, "notes/Ann/a.md", "mine")
        laptop = data(as_ann.post_json(f"{API}/auth/keys", {"name": "l", "scope": "read"}))
        answers = []

        def read_forever():
            for _ in range(200):
                answers.append(
                    anon.get(
                        note_url("notes/Ann/a.md"), headers={KEY: laptop["key"]}, status="*"
                    ).status_int
                )

        reader = threading.Thread(target=read_forever)
        reader.start()
        gone = data(client.delete(f"{API}/people/{ann['id']}"))
        reader.join()
        assert gone["removed"] is True
        assert laptop["id"] in gone["revoked"]
        as_ann.get(f"{API}/notes", status=401)
        anon.get(f"{API}/notes", headers={KEY: laptop["key"]}, status=401)
        assert answers[-1] == 401
        assert set(answers) <= {200, 401}
        assert answers == sorted(answers)  # never 200 again once 401
        assert data(client.get(note_url("notes/Ann/a.md")))["content"] == "mine"  # notes stay
