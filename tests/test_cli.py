"""The command line (src/notesvc/cli.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    API,
    HERE,
    NOTESVC,
    make_state,
    notesvc,
    owner_headers,
    run_cli,
    running,
    wait_for,
)


class TestCli:
    pytestmark = [pytest.mark.real_server, pytest.mark.slow]

    def test_pair_prints_a_link_the_running_server_honours_at_once(self, tmp_path):
        with running(tmp_path) as server:
            done = run_cli("pair", "--root", str(tmp_path), "--scope", "read", "--name", "Tablet")
            assert done.returncode == 0, done.stderr
            found = re.search(r"(http://\S+)/#pair=([a-z2-7]{26})\n", done.stdout)
            origin, secret = found.groups()
            assert origin.endswith(f":{server.port}")  # the running server's, as its banner
            if importlib.util.find_spec("segno"):
                assert "▄" in done.stdout  # a QR code in Unicode blocks
            started = time.monotonic()
            status, _, body = server.request(
                "POST", f"{API}/auth/devices/claim", {"secret": secret, "deviceName": "Tab"}
            )
            assert status == 201
            assert time.monotonic() - started < 1.0
            assert body["data"]["device"]["scope"] == "read"
            assert secret not in done.stderr + "".join(server.lines)
        refused = run_cli("pair", "--root", str(tmp_path), "--scope", "admin", "--folder", "x")
        assert refused.returncode == 2
        assert refused.stderr.startswith("notesvc: error: an admin device sees every note")
        assert refused.stdout == ""
        nothing = run_cli("pair", "--root", str(tmp_path / "none"))
        assert nothing.returncode == 2
        assert "no notesvc state" in nothing.stderr
        assert not (tmp_path / "none").exists()

    def test_a_pairing_made_by_a_revoked_admin_device_cannot_be_claimed(self, tmp_path):
        claim_url, pairings = f"{API}/auth/devices/claim", f"{API}/auth/devices/pairings"
        with running(tmp_path) as server:
            owner = owner_headers(server.request("GET", f"{API}/system/setup")[2]["data"])
            done = run_cli("pair", "--root", str(tmp_path), "--scope", "admin", "--name", "Laptop")
            assert done.returncode == 0, done.stderr
            secret = re.search(r"#pair=([a-z2-7]{26})\n", done.stdout).group(1)
            status, _, body = server.request("POST", claim_url, {"secret": secret})
            assert status == 201
            laptop = body["data"]
            assert laptop["device"]["createdBy"] == "cli"  # made by `notesvc.py pair`
            as_laptop = {"X-Service-Key": laptop["key"]}
            status, _, body = server.request("POST", pairings, {"scope": "write"}, as_laptop)
            assert status == 201
            assert body["data"]["createdBy"] == laptop["deviceId"]
            status, _, body = server.request(
                "POST", claim_url, {"secret": body["data"]["secret"], "deviceName": "Kid"}
            )
            assert status == 201
            kid = body["data"]  # claimed before the revocation: it stays, shown as the laptop's
            status, _, body = server.request("POST", pairings, {"scope": "admin"}, as_laptop)
            waiting = body["data"]["secret"]
            status, _, body = server.request(
                "DELETE", f"{API}/auth/keys/{laptop['deviceId']}", headers=owner
            )
            assert (status, body["data"]) == (200, {"id": laptop["deviceId"], "revoked": True})
            status, _, body = server.request("POST", claim_url, {"secret": waiting})
            assert status == 404
            assert body["error"]["code"] == "NOT_FOUND"
            keys = server.request("GET", f"{API}/auth/keys", headers=owner)[2]["data"]["keys"]
            assert [(k["id"], k["createdBy"]) for k in keys] == [
                (kid["deviceId"], laptop["deviceId"])
            ]
            status, _, _ = server.request(
                "GET", f"{API}/notes", headers={"X-Service-Key": kid["key"]}
            )
            assert status == 200
            assert waiting not in "".join(server.lines)

    @pytest.mark.parametrize(
        ("args", "env", "names"),
        [
            (["--port", "abc"], {}, "--port"),
            ([], {"SERVICE_PORT": "abc"}, "SERVICE_PORT"),
            (["--auth-mode", "magic"], {}, "--auth-mode"),
            (["--auth-mode", "jwt"], {}, "SERVICE_JWT_SECRET"),
            ([], {"SERVICE_TRUST_PROXY": "perhaps"}, "SERVICE_TRUST_PROXY"),
            (["--no-such-flag"], {}, "--no-such-flag"),
        ],
    )
    def test_bad_values_exit_2_with_one_line(self, tmp_path, args, env, names):
        out = run_cli(*args, "--root", str(tmp_path), env=env)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert names in lines[0]
        assert "Traceback" not in out.stderr

    def test_version(self):
        out = run_cli("--version")
        assert out.returncode == 0
        assert out.stdout.strip() == f"notesvc {notesvc.__version__}"

    def test_help_lists_every_variable(self):
        out = run_cli("--help")
        assert out.returncode == 0
        for s in notesvc.SETTINGS:
            assert s.env in out.stdout
            if s.flag:
                assert s.flag in out.stdout

    def test_corrupt_state_file_stops_startup_cleanly(self, tmp_path):
        (tmp_path / ".notesvc").mkdir()
        (tmp_path / ".notesvc" / "state.json").write_text("{broken")
        out = run_cli("--root", str(tmp_path), "--port", "0", "--host", "127.0.0.1")
        assert out.returncode == 2
        assert "state.json" in out.stderr
        assert "Traceback" not in out.stderr


def tree_snapshot(root: Path) -> dict:
    """Every path under root with what a write would change (mode, owner, mtime, size)."""
    snap = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = os.lstat(path)
        snap[str(path)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size)
    return snap


def system_python_with_bottle() -> str | None:
    """Return /usr/bin/python3 when it imports bottle and waitress by itself (Debian's)."""
    exe = "/usr/bin/python3"
    if not os.path.exists(exe):
        return None
    probe = subprocess.run([exe, "-I", "-c", "import bottle, waitress"], capture_output=True)
    return exe if probe.returncode == 0 else None


MARKER_PLUGIN = """
import pathlib
pathlib.Path({marker!r}).write_text("plugin code ran")
"""


class TestCliSafety:
    """Issue 10, items 6, 10, 11, 13: the CLI is safe as root, honest, and self-explaining."""

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
    @pytest.mark.parametrize("options", [["-I", "-Xfaulthandler"], ["-Xfaulthandler"]])
    def test_the_script_runs_as_the_module_with_the_same_options(self, tmp_path, options):
        """`python notesvc.py` hands over (same process) to an interpreter that imports the
        file as `notesvc`, so the script's syntax tree is not kept; its options go along."""
        (tmp_path / "cwd").mkdir()
        (tmp_path / "cwd" / "secrets.py").write_text("raise SystemExit('shadowed')\n")
        args = ["--root", str(tmp_path / "r"), "--host", "127.0.0.1", "--port", "0"]
        proc = subprocess.Popen(
            [sys.executable, *options, NOTESVC, *args],
            cwd=tmp_path / "cwd",  # a module here never shadows the standard library's
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if "listening on" in line:
                    break
            assert any("listening on" in line for line in lines), lines
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[:-1]
            dash_c = argv.index(b"-c")
            assert argv[0] == sys.executable.encode()
            assert set(map(str.encode, options)) <= set(argv[1:dash_c])
            assert argv[dash_c + 2 :] == [os.path.abspath(NOTESVC).encode(), *map(str.encode, args)]
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert b"MALLOC_ARENA_MAX=1" in environ  # one malloc arena, not one per thread
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
            proc.stderr.close()

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.parametrize("command", ["audit", "rotate-key"])
    def test_command_on_root_without_state_refuses_and_creates_nothing(self, tmp_path, command):
        typo = tmp_path / "typo"
        out = run_cli(command, "--root", str(typo))
        assert out.returncode == 2
        assert out.stderr.splitlines() == [
            f"notesvc: error: no notesvc state at {typo}/.notesvc "
            "(start the server there first, or check --root)"
        ]
        assert out.stdout == ""
        assert not typo.exists()

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_subcommand_help_lists_only_the_flags_it_reads(self):
        flags = {s.flag for s in notesvc.SETTINGS if s.flag}
        for command in notesvc.COMMANDS:
            out = run_cli(command, "--help")
            assert out.returncode == 0
            shown = set(re.findall(r"(--[a-z-]+)", out.stdout)) & flags
            expected = {
                s.flag
                for s in notesvc.SETTINGS
                if s.flag and command in notesvc.setting_commands(s)
            }
            assert shown == expected, command
        rotate = run_cli("rotate-key", "--help").stdout
        assert set(re.findall(r"(--[a-z-]+)", rotate)) == {"--help", "--root", "--log-level"}
        relay = run_cli("relay", "--help").stdout
        for flag in ("--auth-mode", "--pairing", "--root", "--cors", "--relay-url"):
            assert flag not in relay
        assert "SERVICE_RELAY_TIMEOUT" in relay
        assert "SERVICE_JWT_SECRET" not in relay

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_flag_of_another_command_is_refused_in_one_line(self, tmp_path):
        make_state(tmp_path)
        out = run_cli("--pairing", "relay", "rotate-key", "--root", str(tmp_path))
        assert out.returncode == 2
        assert len(out.stderr.strip().splitlines()) == 1
        assert "--pairing does not apply to rotate-key" in out.stderr

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_rotate_key_ignores_variables_it_does_not_read(self, tmp_path):
        make_state(tmp_path)
        out = run_cli("rotate-key", "--root", str(tmp_path), env={"SERVICE_AUTH_MODE": "jwt"})
        assert out.returncode == 0, out.stderr
        assert re.fullmatch(r"nsk_[A-Za-z0-9_-]{43}", out.stdout.strip())

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_audit_never_runs_plugin_code_and_writes_nothing(self, tmp_path):
        root = tmp_path / "root"
        make_state(root)
        plugins = root / ".notesvc" / "plugins"
        plugins.mkdir(mode=0o700)
        marker = tmp_path / "ran.txt"
        (plugins / "evil_one.py").write_text(MARKER_PLUGIN.format(marker=str(marker)))
        if os.geteuid() == 0:  # the service's own user owns the state; cron runs as root
            for path in [root, *root.rglob("*")]:
                os.chown(path, 65534, 65534)
        before = tree_snapshot(root)
        out = run_cli("audit", "--root", str(root), env={"SERVICE_HOST": "127.0.0.1"})
        assert out.returncode == 0, out.stdout + out.stderr
        assert not marker.exists()  # the plugin file was never executed
        assert "evil_one.py" in out.stdout
        assert "(plugin-evil-one)" in out.stdout
        assert tree_snapshot(root) == before  # nothing created, rewritten or re-owned
        assert "no server is running on this root" in out.stdout.splitlines()[1]

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_audit_reads_the_running_servers_effective_settings(self, tmp_path):
        secret = "Zq8vN3xR7tLp2Wc9Hs5Kd1Fg6Jm4Yb0Ue"
        env = {"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": secret}
        with running(tmp_path, "--cors", "*", env=env) as server:
            record_path = tmp_path / ".notesvc" / "effective.json"
            assert stat.S_IMODE(record_path.stat().st_mode) == 0o600
            text = record_path.read_text()
            assert secret not in text
            record = json.loads(text)
            assert record["pid"] == server.proc.pid
            assert record["startedAt"].endswith("Z")
            assert record["settings"]["cors"] == ["*"]
            assert record["settings"]["port"] == server.port
            assert record["secrets"]["jwt_secret"]["set"] is True
            assert record["secrets"]["agent_api_key"]["set"] is False
            assert "jwt_secret" not in record["settings"]
            # The CLI's own environment says nothing of CORS or JWT: the record wins.
            out = run_cli("audit", "--root", str(tmp_path))
            lines = out.stdout.splitlines()
            assert lines[1].startswith(
                f"auditing the running server (pid {server.proc.pid}, started "
            ), lines[:3]
            assert lines[1].endswith("with its effective settings")
            assert "(cors-wildcard)" in out.stdout
            assert "(jwt-mode)" in out.stdout  # a strong secret, judged by recorded figures
            assert "(jwt-secret-weak)" not in out.stdout
            assert secret not in out.stdout
        assert not record_path.exists()  # a clean stop takes the record away
        out = run_cli("audit", "--root", str(tmp_path))
        assert "no server is running on this root" in out.stdout.splitlines()[1]
        assert "(cors-wildcard)" not in out.stdout

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root")
    def test_rotate_key_as_root_writes_the_state_as_its_owner(self, tmp_path):
        folder = tmp_path / ".notesvc"
        make_state(tmp_path)
        for path in [tmp_path, folder, *folder.iterdir()]:
            os.chown(path, 65534, 65534)
        out = run_cli("rotate-key", "--root", str(tmp_path))
        assert out.returncode == 0, out.stderr
        key = out.stdout.strip()
        for name in ("state.json", "state.lock"):
            st = (folder / name).stat()
            assert (st.st_uid, st.st_gid) == (65534, 65534), name
            assert stat.S_IMODE(st.st_mode) == 0o600
        state = json.loads((folder / "state.json").read_text())
        assert state["keyHash"] == notesvc.key_hash(key)
        assert not list(folder.glob(".tmp-*"))

    def test_rotate_key_as_another_user_names_sudo(self, tmp_path, monkeypatch, capsys):
        make_state(tmp_path)
        before = (tmp_path / ".notesvc" / "state.json").read_bytes()
        owner = (tmp_path / ".notesvc").stat().st_uid
        monkeypatch.setattr(os, "geteuid", lambda: owner + 4242)  # a user who is not root
        assert notesvc.main(["rotate-key", "--root", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert re.search(r"run: sudo -u \S+ .*rotate-key --root ", err[0]), err
        assert (tmp_path / ".notesvc" / "state.json").read_bytes() == before

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root")
    def test_rotate_key_as_a_real_other_user_refuses(self, tmp_path):
        python = system_python_with_bottle()
        if python is None:
            pytest.skip("needs Debian's python3-bottle under /usr/bin/python3")
        root = Path(tempfile.mkdtemp(prefix="notesvc-other-", dir="/tmp"))
        try:
            os.chmod(root, 0o755)
            make_state(root)
            os.chmod(root / ".notesvc", 0o755)  # nobody may look, not write
            os.chmod(root / ".notesvc" / "state.json", 0o644)
            out = subprocess.run(
                [python, "-I", NOTESVC, "rotate-key", "--root", str(root)],
                capture_output=True,
                text=True,
                user=65534,
                timeout=30,
                cwd="/",
            )
            assert out.returncode == 2, out.stderr
            assert out.stderr.strip().splitlines() == [
                f"notesvc: error: the state at {root}/.notesvc belongs to root; run: "
                f"sudo -u root python3 notesvc.py rotate-key --root {root}"
            ]
        finally:
            shutil.rmtree(root)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_banner_without_a_terminal_shows_no_key(self, tmp_path):
        with running(tmp_path) as server:
            # the banner's lines after "listening on" may still be on their way
            banner = wait_for(
                lambda: "open the setup URL" in "".join(server.lines) and "".join(server.lines)
            )
            _, _, body = server.request("GET", f"{API}/system/setup")
            key = body["data"]["apiKey"]
            assert key.startswith("nsk_")
            assert "nsk_" not in banner
            assert "open the setup URL on this machine" in banner
            assert f"setup:  {server.url}{API}/system/setup" in banner

    @pytest.mark.real_server
    @pytest.mark.slow
    @pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
    def test_banner_on_a_terminal_shows_the_key(self, tmp_path):
        master, slave = os.openpty()
        proc = subprocess.Popen(
            [
                sys.executable,
                NOTESVC,
                "--port",
                "0",
                "--host",
                "127.0.0.1",
                "--root",
                str(tmp_path),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
            env={**os.environ, "SERVICE_RESCAN_SECONDS": "0"},
        )
        os.close(slave)
        try:
            text, deadline = "", time.monotonic() + 20
            while not re.search(r"key: .*\n", text) and time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.5)
                if ready:
                    text += os.read(master, 4096).decode(errors="replace")
            port = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text).group(1)
            url = f"http://127.0.0.1:{port}{API}/system/setup"
            with urllib.request.urlopen(url, timeout=10) as resp:
                key = json.loads(resp.read())["data"]["apiKey"]
            assert f"key:    {key}" in text
        finally:
            proc.terminate()
            proc.wait(10)
            os.close(master)

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_missing_bottle_prints_one_line_and_exits_2(self, tmp_path):
        # -I -S: no user or site packages, so neither pip's nor Debian's bottle is found.
        probe = subprocess.run([sys.executable, "-I", "-S", "-c", "import bottle"])
        if probe.returncode == 0:
            pytest.skip("bottle is importable without site-packages here")
        out = subprocess.run(
            [sys.executable, "-I", "-S", NOTESVC, "--root", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert "sudo apt install python3-bottle python3-waitress" in lines[0]
        assert "pip" in lines[0]
        assert "Traceback" not in out.stderr
        assert not (tmp_path / ".notesvc").exists()
        # `import notesvc` (tests, plugins) still fails the ordinary way.
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import notesvc"
        imp = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True)
        assert imp.returncode == 1
        assert b"ModuleNotFoundError" in imp.stderr
