"""The house: the build, the module map, the docs."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import API, HERE, NOTESVC, data, notesvc, put_note, running, search, with_key


class TestStructure:
    """The module's shape: sections in data-flow order, and what the Service owns."""

    @pytest.mark.slow
    def test_no_section_uses_a_name_defined_in_a_later_one(self):
        import ast
        import bisect

        src = Path(NOTESVC).read_text()
        tree = ast.parse(src)
        lines = src.splitlines()
        banners = [  # the sections: a seam `# == src/notesvc/<module>.py` starts each module
            i + 1 for i, line in enumerate(lines) if line.startswith("# == src/notesvc/")
        ]

        def section(lineno: int) -> int:
            return bisect.bisect_right(banners, lineno)

        defined: dict = {}
        for node in tree.body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            for name in names:
                defined.setdefault(name, section(node.lineno))

        class Uses(ast.NodeVisitor):  # every name loaded, annotations left out
            def __init__(self):
                self.names: list = []

            def visit_arg(self, node):
                pass

            def visit_FunctionDef(self, node):
                for part in [*node.decorator_list, *node.args.defaults, *node.body]:
                    self.visit(part)
                for default in node.args.kw_defaults:
                    if default is not None:
                        self.visit(default)

            visit_AsyncFunctionDef = visit_FunctionDef

            def visit_AnnAssign(self, node):
                if node.value is not None:
                    self.visit(node.value)

            def visit_Name(self, node):
                if isinstance(node.ctx, ast.Load):
                    self.names.append((node.lineno, node.id))

        outline = [lines[b - 1][len("# == src/notesvc/") :].strip(" =") for b in banners]
        late = []
        for node in tree.body:
            uses = Uses()
            uses.visit(node)
            here = section(node.lineno)
            late += [
                f"line {line}: {name} (defined in {outline[defined[name] - 1]})"
                for line, name in uses.names
                if defined.get(name, 0) > here
            ]
        assert late == []
        # the Service comes right after who may do what: the grants, then the people
        assert outline.index("grants.py") + 1 == outline.index("people.py")
        assert outline.index("people.py") + 1 == outline.index("service.py")
        assert outline.index("web.py") < outline.index("relay.py") < outline.index("http/route.py")

    @pytest.mark.slow
    def test_service_declares_every_attribute_in_init(self, anon):
        """What a later module makes on first use (the task book, WebDAV's state) is
        declared in Service.__init__ too, never attached from below: after those first
        uses, and in every `svc.<name> = ...` / `setattr(svc, ...)` of the sources."""
        svc = anon.app.service
        notesvc.task_book(svc)
        notesvc.dav_state(svc)
        declared = set(vars(notesvc.build_service(svc.config, readonly=True)))
        assert set(vars(svc)) <= declared
        attached = set()
        for path in (HERE / "src" / "notesvc").rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        for t in ast.walk(target):
                            if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "svc":
                                attached.add(t.attr)
                elif (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", "") in ("setattr", "getattr")
                    and len(node.args) >= 2
                    and getattr(node.args[0], "id", "") == "svc"
                    and isinstance(node.args[1], ast.Constant)
                ):
                    attached.add(node.args[1].value)
        assert attached - declared == set()

    def test_a_failed_index_update_is_retried_by_the_next_rescan(self, make_app, caplog):
        client = with_key(make_app())
        svc = client.app.service

        class FlakyIndex(notesvc.SearchIndex):  # the write happens; indexing it fails once
            failed = False

            def add(self, *args, **kwargs):
                if not FlakyIndex.failed:
                    FlakyIndex.failed = True
                    raise RuntimeError("index full of gremlins")
                return super().add(*args, **kwargs)

        svc.index = FlakyIndex()
        svc.sync_index()
        caplog.set_level("ERROR", logger="notesvc")
        rid = "gremlin-request-1"
        client.post_json(
            f"{API}/notes",
            {"path": "notes/g.md", "content": "kumquat"},
            headers={"X-Request-Id": rid},
            status=201,
        )
        assert any(rid in r.getMessage() and "notes/g.md" in r.getMessage() for r in caplog.records)
        assert search(client, "kumquat")["total"] == 0  # not indexed yet
        svc.sync_index()  # what the rescan runs
        assert search(client, "kumquat")["total"] == 1


class TestHouse:
    """Several files to write, one file to ship: src/notesvc/ is built into notesvc.py by
    .ci/build.py, and both forms run (docs/contributing.md)."""

    BUILD = str(HERE / ".ci" / "build.py")

    def build(self, *args: str, root: Path = HERE) -> subprocess.CompletedProcess:
        cmd = [sys.executable, self.BUILD, *args, "--root", str(root)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    @pytest.mark.slow
    def test_where_maps_a_line_of_notesvc_py_to_its_source(self):
        lines = Path(NOTESVC).read_text().splitlines()
        asked = [
            lines.index("def create_app(config: Config | None = None) -> NotesApp:") + 1,
            lines.index("class NoteStore(FileTree):") + 1,
            lines.index("const core = (() => {") + 1,  # web/core.js, embedded
        ]
        done = self.build("--where", *map(str, asked))
        assert done.returncode == 0, done.stderr
        found = re.findall(r"notesvc\.py:(\d+) -> (\S+):(\d+)", done.stdout)
        assert [int(n) for n, _, _ in found] == asked
        for n, path, line in found:
            assert path.startswith(("src/notesvc/", "web/")), path
            source = (HERE / path).read_text().splitlines()[int(line) - 1]
            assert source == lines[int(n) - 1]
        assert [p for _, p, _ in found][:2] == [
            "src/notesvc/http/app.py",
            "src/notesvc/notes/store.py",
        ]
        assert self.build("--where", str(len(lines) + 5)).returncode == 1

    @pytest.mark.slow
    def test_the_outline_and_the_seams_are_in_notesvc_py(self):
        """One map: the seams follow MODULES, each carrying its module's summary (the first
        line of its docstring), and the outline ending the file's docstring is made from
        the same; `grep -n '^# ==' notesvc.py` prints the seams and nothing else."""
        text = Path(NOTESVC).read_text()
        assert text.startswith("# Generated by .ci/build.py from src/notesvc/ and web/")
        order = [m.replace(".", "/") + ".py" for m in self.modules()[1:]]
        src = HERE / "src" / "notesvc"
        summaries = [ast.get_docstring(ast.parse((src / m).read_text())) for m in order]
        summaries = [doc.splitlines()[0] for doc in summaries]
        assert all(len(s) <= 90 for s in summaries)
        seams = re.findall(r"^# == src/notesvc/(\S+) =+\n# (.*)\n", text, re.M)
        assert seams == list(zip(order, summaries))
        assert len(re.findall(r"^# ==", text, re.M)) == len(order)  # the seams, only
        docstring = ast.get_docstring(ast.parse(text))
        outline = docstring[docstring.index("\nOutline (") :]
        listed = re.findall(r"^  (\S+\.py) +(.*)((?:\n {6,}.*)*)", outline, re.M)
        assert [path for path, _, _ in listed] == order
        assert [" ".join((first + more).split()) for _, first, more in listed] == summaries
        assert not re.search(r"^\s*(from|import) notesvc\b", text, re.M)  # between modules
        assert text.count("from __future__ import annotations") == 1

    def test_no_module_keeps_a_banner_of_its_own(self):
        """A module's sections are `# --` lines: `# ==` is the build's seam alone."""
        for path in sorted((HERE / "src" / "notesvc").rglob("*.py")):
            assert not re.search(r"^# ==", path.read_text(), re.M), path

    def test_the_contributing_table_lists_every_module_in_order(self):
        """docs/contributing.md's "Where things live" names the modules of MODULES, in the
        order of the build."""
        guide = (HERE / "docs" / "contributing.md").read_text()
        table = guide[guide.index("## Where things live") :].split("\n## ")[0]
        rows = re.findall(r"^\| `([\w/]+\.py)` \|", table, re.M)
        assert rows == [m.replace(".", "/") + ".py" for m in self.modules()]

    def test_no_source_file_is_over_the_size_tools_read(self):
        sources = sorted((HERE / "src" / "notesvc").rglob("*.py"))
        assert len(sources) >= 30
        for path in sources:
            assert path.stat().st_size < 1 << 20, path
            lines = len(path.read_text().splitlines())  # "about 1,500"
            assert lines <= 1550, (
                f"{path.relative_to(HERE)} has {lines} lines: split it by job (a module for "
                "each thing it holds, named for it), not by moving pieces to where there is room"
            )

    @pytest.mark.slow
    def test_each_job_has_a_module_of_its_own(self):
        """Code placed by job, not by budget: the index's helper process, MCP, who else gets
        in, the calendar feed and hybrid search each have their module, and the package's
        helper process is started by that module's name."""
        rooms = {
            "search/helper.py": ("index_helper", "IndexHelper", "EarlyHelper", "read_items"),
            "search/hybrid.py": ("find_notes", "related_notes", "MODES"),
            "http/mcp.py": ("mcp_endpoint", "authenticate_mcp", "RpcError"),
            "http/access.py": ("create_scoped_key", "claim_device", "create_share", "oauth_token"),
            "http/feed.py": ("create_feed", "get_feed", "feed_events"),
        }
        src = HERE / "src" / "notesvc"
        owner = {}
        for path in src.rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                for name in [getattr(node, "name", None)] + [
                    t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)
                ]:
                    owner[name] = path.relative_to(src).as_posix()
        for room, names in rooms.items():
            assert {owner.get(n) for n in names} == {room}, room
        assert "from notesvc.search.helper import index_helper" in notesvc._HELPER_PACKAGE_CODE

    def test_one_syntax_is_compiled_into_one_pattern(self):
        """⏰ lines are a task's alarm and a reminder alike: one regex (ALARM_RE, where
        REMINDER_RE was a copy); no two names of the package hold the same pattern."""
        seen: dict = {}
        for name, value in sorted(vars(notesvc).items()):
            if isinstance(value, re.Pattern):
                seen.setdefault((value.pattern, value.flags), []).append(name)
        assert [names for names in seen.values() if len(names) > 1] == []

    def test_both_stores_make_and_prune_folders_with_one_implementation(self):
        for name in ("_new_parents", "_prune"):
            assert getattr(notesvc.NoteStore, name) is getattr(notesvc.AttachmentStore, name)
            assert name in vars(notesvc.FileTree)

    @pytest.mark.slow
    def test_no_type_checking_block_is_left_empty(self):
        for path in sorted((HERE / "src" / "notesvc").rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                    kinds = {type(n) for n in node.body}
                    assert kinds <= {ast.Import, ast.ImportFrom}, f"{path}:{node.lineno}"

    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("module", "line", "refusal"),
        [
            ("cli.py", "\n\ndef load_config():\n    pass\n", "load_config is defined in"),
            ("settings.py", "\nfrom notesvc.cli import main\n", "comes before cli"),
            ("errors.py", "\nfrom notesvc.settings import Config as C\n", "no `as`"),
            ("errors.py", "\nfrom notesvc import settings\n", "not imported as objects"),
            ("errors.py", "\nimport notesvc.settings\n", "write `from notesvc.<module>"),
            ("errors.py", "\nfrom notesvc.settings import nothing_here\n", "defines no"),
            ("settings.py", "\n\ndef f():\n    global log\n    log = None\n", "global log"),
            ("settings.py", "\nfrom notesvc.boot import _hand_over\n", "_hand_over is private"),
            ("__main__.py", "\nfrom notesvc.boot import _hand_over\n", "_hand_over is private"),
        ],
    )
    def test_the_build_refuses_what_would_split_the_two_forms(
        self, tmp_path, module, line, refusal
    ):
        shutil.copytree(HERE / "src", tmp_path / "src")
        shutil.copytree(HERE / "web", tmp_path / "web")
        shutil.copy(NOTESVC, tmp_path / "notesvc.py")
        with open(tmp_path / "src" / "notesvc" / module, "a") as f:
            f.write(line)
        done = self.build(root=tmp_path)
        assert done.returncode == 1
        assert refusal in done.stderr
        assert done.stderr.startswith("build: src/notesvc/")  # names the file (and line)
        assert (tmp_path / "notesvc.py").read_bytes() == Path(NOTESVC).read_bytes()

    @pytest.mark.slow
    def test_the_build_refuses_a_module_without_a_one_line_summary(self, tmp_path):
        shutil.copytree(HERE / "src", tmp_path / "src")
        shutil.copytree(HERE / "web", tmp_path / "web")
        shutil.copy(NOTESVC, tmp_path / "notesvc.py")
        errors = tmp_path / "src" / "notesvc" / "errors.py"
        text = errors.read_text()
        for doc in ('"""ApiError and\nthe envelope."""', '"""' + "x" * 91 + '"""', "#"):
            errors.write_text(doc + "\n" + text.split('"""', 2)[2])
            done = self.build(root=tmp_path)
            assert done.returncode == 1
            assert done.stderr.startswith("build: src/notesvc/errors.py:1: a module"), doc
        assert (tmp_path / "notesvc.py").read_bytes() == Path(NOTESVC).read_bytes()

    @pytest.mark.slow
    def test_check_names_the_first_difference_and_a_build_mends_it(self, tmp_path):
        shutil.copytree(HERE / "src", tmp_path / "src")
        shutil.copytree(HERE / "web", tmp_path / "web")
        shutil.copy(NOTESVC, tmp_path / "notesvc.py")
        markdown = tmp_path / "web" / "markdown.js"
        markdown.write_text(markdown.read_text() + "// one more line\n")
        done = self.build("--check", root=tmp_path)
        assert done.returncode == 1
        assert "web/markdown.js" in done.stderr
        assert "run python .ci/build.py" in done.stderr
        assert self.build(root=tmp_path).returncode == 0
        assert "// one more line" in (tmp_path / "notesvc.py").read_text()
        assert self.build("--check", root=tmp_path).returncode == 0

    @pytest.mark.slow
    def test_the_package_has_every_name_the_file_has(self):
        """Plugins and embedders write `import notesvc`: the same names in both forms."""
        code = (  # the file by its path, or the package from the folder that holds it
            "import importlib.util as u, json, sys\n"
            "f = sys.argv[1]\n"
            "if f.endswith('.py'):\n"
            "    s = u.spec_from_file_location('notesvc', f)\n"
            "    sys.modules['notesvc'] = u.module_from_spec(s)\n"
            "    s.loader.exec_module(sys.modules['notesvc'])\n"
            "else:\n"
            "    sys.path.insert(0, f)\n"
            "import notesvc\n"
            "print(notesvc.__file__)\n"
            "print(json.dumps(sorted(vars(notesvc))))\n"
        )

        def names(where: str) -> tuple:
            cmd = [sys.executable, "-c", code, where]
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=60, cwd=HERE / "docs"
            )
            assert done.returncode == 0, done.stderr
            file, listed = done.stdout.splitlines()
            return file, {n for n in json.loads(listed) if not n.startswith("__")}

        file, in_file = names(NOTESVC)
        package_file, in_package = names(str(HERE / "src"))
        assert (file, package_file) == (NOTESVC, str(HERE / "src/notesvc/__init__.py"))
        modules = {"boot", "notes", "search", "providers", "transfer", "http", "MODULES"}
        modules.add("passthrough")
        modules.add("TYPE_CHECKING")  # annotations only: the build drops those imports
        modules |= {m.split(".")[-1] for m in self.modules()}
        assert in_file - in_package == set()
        assert in_package - in_file <= modules
        for name in ("create_app", "load_config", "Plugin", "channel_sender", "TOOLS", "main"):
            assert name in in_package

    @staticmethod
    def modules() -> list:
        """Return MODULES of src/notesvc/__init__.py: the build's order."""
        tree = ast.parse((HERE / "src" / "notesvc" / "__init__.py").read_text())
        found = [
            n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "MODULES"
        ]
        return list(ast.literal_eval(found[0]))

    @pytest.mark.slow
    @pytest.mark.real_server
    def test_python_m_notesvc_serves_the_same_page_from_the_package(self, tmp_path):
        empty = tmp_path / "elsewhere"
        empty.mkdir()
        env = {"PYTHONPATH": str(HERE / "src")}
        version = subprocess.run(
            [sys.executable, "-m", "notesvc", "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=empty,
            env={**os.environ, **env},
        )
        assert version.stdout.strip() == f"notesvc {notesvc.__version__}"
        with running(tmp_path / "root", program=("-m", "notesvc"), cwd=empty, env=env) as server:
            assert server.request("GET", f"{API}/health")[0] == 200
            with urllib.request.urlopen(server.url + "/", timeout=30) as resp:
                page = resp.read().decode()
            assert page == notesvc.web_client_page()
            log = "".join(server.lines)
            assert "python3 -m notesvc rotate-key" in log  # how this owner runs it
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(15) == 0

    @pytest.mark.slow
    @pytest.mark.real_server
    def test_notesvc_py_alone_in_an_empty_folder_serves(self, tmp_path):
        alone = tmp_path / "pi"
        alone.mkdir()
        shutil.copy(NOTESVC, alone / "notesvc.py")
        program = (str(alone / "notesvc.py"),)
        with running(alone / "data", program=program, cwd=alone) as server:
            status, _, body = server.request("GET", f"{API}/health")
            assert (status, body["data"]["version"]) == (200, notesvc.__version__)
            with urllib.request.urlopen(server.url + "/", timeout=30) as resp:
                assert resp.read().decode() == notesvc.web_client_page()
        assert sorted(p.name for p in alone.iterdir() if p.name != "__pycache__") == [
            "data",
            "notesvc.py",
        ]


class TestTheTests:
    """tests/ is cut like src/ (docs/contributing.md: Where a module's tests live)."""

    TESTS = HERE / "tests"

    @pytest.mark.slow
    def test_every_test_of_the_one_file_is_still_collected(self):
        """tests/ was cut from one file, test_notesvc.py: each of its 989 Class::test names
        is still a test, under its class and name (a later issue rewrites a test under its
        name, never drops or renames it)."""
        names = set()
        for path in sorted(self.TESTS.glob("test_*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef):
                    names |= {
                        f"{node.name}::{f.name}"
                        for f in node.body
                        if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
                    }
                elif isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                    names.add(node.name)
        kept = (self.TESTS / "names-cfe814e.txt").read_text(encoding="utf-8").split()
        assert len(kept) == len(set(kept)) == 989
        assert [n for n in kept if n not in names] == []

    def test_each_file_is_a_room_of_the_sources_and_none_is_too_long(self):
        tree = ast.parse((HERE / "src" / "notesvc" / "__init__.py").read_text(encoding="utf-8"))
        modules = next(  # (MODULES as the build reads it: the artifact has no such name)
            ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "MODULES"
        )
        rooms = {"test_" + m.replace(".", "_") for m in modules} | {"test_house"}
        assert not (HERE / "test_notesvc.py").exists()
        files = sorted(self.TESTS.glob("*.py"))
        assert {"conftest.py", "standins.py", "browsers.py"} <= {p.name for p in files}
        for path in files:
            lines = len(path.read_text(encoding="utf-8").splitlines())
            assert lines <= 1500, f"{path.name}: {lines} lines: split it by what it tests"
            if path.name.startswith("test_"):
                stem = path.stem
                assert any(stem == r or stem.startswith(r + "_") for r in rooms), (
                    f"{path.name} is named for no module of MODULES (test_<module>[_part].py)"
                )
        order = [m.replace(".", "_") for m in modules]
        assert "test_notes_store.py" in {p.name for p in files}  # (a room that must be there)
        assert order.index("notes_store") < order.index("http_caldav")

    def test_the_fast_loop_runs_the_sources(self):
        """The in-process tests import the package from src/ unless NOTESVC_FORM=artifact."""
        want = "notesvc.py" if os.environ.get("NOTESVC_FORM") == "artifact" else "src"
        assert Path(notesvc.__file__).is_relative_to(HERE / want)


class TestDocs:
    @pytest.mark.slow
    @pytest.mark.skipif(not shutil.which("node"), reason="no node (apt install nodejs)")
    def test_the_web_clients_logic_passes_its_own_tests(self):
        tests = sorted(str(p) for p in (HERE / "web" / "test").glob("*.test.js"))
        assert len(tests) >= 3
        done = subprocess.run(
            ["node", "--test", *tests], capture_output=True, text=True, timeout=120, cwd=HERE
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]

    @pytest.mark.slow
    def test_the_web_sources_are_what_notesvc_py_carries(self):
        """web/ is embedded by .ci/build.py: --check fails on any difference."""
        done = subprocess.run(
            [sys.executable, str(HERE / ".ci" / "build.py"), "--check"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        for name in ("app.html", "app.css", "app.js", "markdown.js", "consent.js", "share.js"):
            assert (HERE / "web" / name).is_file(), name
        assert (HERE / "web" / "markdown.js").read_text("utf-8") == notesvc.MARKDOWN_JS

    def test_the_documented_example_plugin_works(self, make_app, root):
        api = (HERE / "docs" / "api.md").read_text()
        code = re.search(r"```python\n(import notesvc\n.*?)```", api, re.S).group(1)
        assert len([line for line in code.splitlines() if line.strip()]) <= 10
        (root / ".notesvc" / "plugins").mkdir(parents=True)
        (root / ".notesvc" / "plugins" / "wordcount.py").write_text(code)
        client = with_key(make_app())
        put_note(client, "notes/a.md", "one two three")
        put_note(client, "notes/b.md", "four five")
        assert data(client.get(f"{API}/plugins/wordcount/totals")) == {"words": 5, "notes": 2}

    def test_every_setting_is_documented(self):
        reference = (HERE / "docs" / "configuration.md").read_text()
        for s in notesvc.SETTINGS:
            assert f"`{s.env}`" in reference, s.env
            if s.flag:
                assert f"`{s.flag}`" in reference, s.flag

    def test_readme_is_a_guide_and_its_links_resolve(self):
        readme = (HERE / "README.md").read_text()
        assert len(readme.splitlines()) <= 450
        documents = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]
        documents.append(HERE / "bench" / "README.md")
        for doc in documents:
            text = doc.read_text()
            # nothing a user of the project cannot see: no issue numbers, no outside documents
            outside = re.search(r"\bissue \d|\bCONTRACT\b|\bthe contract\b", text)
            assert outside is None, doc.name
            prose = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)  # examples aside
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose):
                if "://" not in target:
                    assert (doc.parent / target).exists(), f"{doc.name}: {target}"
        first_run = readme[readme.index("## First run") : readme.index("## On a Raspberry Pi")]
        assert "on your phone" in first_run
        assert "Set up this server" in first_run

    @pytest.mark.real_server
    @pytest.mark.slow
    def test_the_venv_command_installs_and_runs_as_written(self, tmp_path):
        """README's second command, in a copy of the project (it needs PyPI or a wheel cache)."""
        readme = (HERE / "README.md").read_text()
        command = re.findall(r"```sh\n(.*?)```", readme, re.S)[1].strip()
        for name in ("notesvc.py", "pyproject.toml", "README.md", "LICENSE"):
            shutil.copy(HERE / name, tmp_path / name)
        for folder in ("src", "web"):  # the package pip installs, and its assets
            shutil.copytree(
                HERE / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
            )
        env = {
            **os.environ,
            "SERVICE_PORT": "0",
            "SERVICE_HOST": "127.0.0.1",
            "SERVICE_NOTES_ROOT": str(tmp_path / "data"),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }
        limit, started = 240, time.monotonic()
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # pip, its builds and the server: one group to end
        )
        # The limit holds even while pip prints nothing: past it, the whole group is ended.
        watchdog = threading.Timer(limit, os.killpg, (proc.pid, signal.SIGKILL))
        watchdog.start()
        try:
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if re.search(r"listening on http://127\.0\.0\.1:\d+", line):
                    break
            took = time.monotonic() - started
            assert any(f"notesvc {notesvc.__version__} serving" in x for x in lines), (
                f"no server after {took:.0f} s (limit {limit} s)",
                lines[-20:],
            )
        finally:
            watchdog.cancel()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            proc.stderr.close()

    def test_readme_starts_with_the_debian_command_then_the_venv_ones(self):
        readme = (HERE / "README.md").read_text()
        blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
        assert blocks[0].strip() == (
            "sudo apt install python3-bottle python3-waitress python3-segno && python3 notesvc.py"
        )
        assert blocks[1].strip() == (
            "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/notesvc"
        )
        assert blocks[2].strip() == (
            "python3 -m venv .venv && .venv/bin/pip install -c .ci/constraints.txt '.[test]' "
            "&& .venv/bin/pytest"
        )

    def test_readme_banner_samples_match_the_real_banner(self, monkeypatch, capsys):
        readme = (HERE / "README.md").read_text()
        blocks = re.findall(r"\n   ```\n((?:   .*\n)+?)   ```", readme)
        sample = next(b for b in blocks if " serving " in b).replace("\n   ", "\n")[3:]
        key = re.search(r"nsk_[A-Za-z0-9_-]{43}", sample).group(0)
        config = notesvc.load_config(env={"SERVICE_NOTES_ROOT": "/home/pi/data"})
        state = {"setupComplete": False, "apiKey": key}
        phone = notesvc.phone_url(config, 3000)  # this machine's, as a phone would open it

        class Terminal(io.StringIO):
            def isatty(self) -> bool:
                return True

        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        notesvc.print_banner(config, state, 3000)
        text, _, qr = terminal.getvalue().partition("█")  # the words, then the QR code
        text = text[: text.rindex("\n") + 1]
        assert text.replace(phone, "http://raspberrypi.local:3000") == sample
        if importlib.util.find_spec("segno"):
            assert qr  # a terminal gets the phone's address as a QR code too
        monkeypatch.undo()
        notesvc.print_banner(config, state, 3000)  # to pytest's capture: no terminal
        journal = capsys.readouterr().err
        assert key not in journal
        key_line = next(line for line in journal.splitlines() if "key:" in line)
        assert f"```\n   {key_line}\n   ```" in readme  # indented in a list item

    def test_every_subcommand_and_the_proxy_example_are_documented(self):
        readme = (HERE / "README.md").read_text()
        reference = (HERE / "docs" / "configuration.md").read_text()
        for command in notesvc.COMMANDS:
            assert re.search(rf"^\| `{command}`", reference, re.M), command
        caddyfile = (HERE / "deploy" / "Caddyfile").read_text()
        assert "reverse_proxy 127.0.0.1:3000" in caddyfile
        proxy = reference[reference.index("## Behind a reverse proxy") :]
        assert "SERVICE_TRUST_PROXY=true" in proxy
        assert "SERVICE_PUBLIC_URL=https://" in proxy
        for kept in ("notes/", ".notesvc/state.json", ".notesvc/trash/", ".notesvc/effective.json"):
            assert f"`{kept}`" in readme[readme.index("## Backup and restore") :], kept

    def test_every_proxy_example_names_the_client_and_the_readme_says_who_sets_up(self):
        """Setup judges the client a trusted proxy names: every example in deploy/ names it
        (Caddy's reverse_proxy sets X-Forwarded-For by itself; nginx is told to)."""
        for path in sorted((HERE / "deploy").iterdir()):
            text = path.read_text()
            if "Caddyfile" in path.name:
                assert "reverse_proxy" in text, path.name
                assert "header_up -X-Forwarded-For" not in text, path.name
            elif "proxy_pass" in text:
                assert re.search(
                    r"proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for", text
                )
        readme = " ".join((HERE / "README.md").read_text().split())
        for sentence in (
            "Only a browser on the server itself or on its own network (home Wi-Fi) can set up a "
            "new server, and only until the first device is set up. This holds for the API as "
            "well:",
            "A tunnel or proxy in front of notesvc that adds no `X-Forwarded-For` makes every "
            "client look local;",
        ):
            assert sentence in readme
