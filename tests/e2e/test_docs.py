"""The README and docs/ against the binary: every `shardmerge` (and `shardmerge-gen`) command in
README.md and docs/*.md names a subcommand that exists and only flags that subcommand accepts;
the README's merge example runs on the bundled demo; the README stays a front door (at most 200
lines); every relative link in them points to a file that exists (and, with a #fragment, to a
heading of that file).

Commands are taken from fenced code blocks (``` and ```sh/bash/shell/console; python blocks are
not shell) and from inline code spans that start with `shardmerge ` or `shardmerge-gen `. In a
fenced block a command is a shell command's first word or follows a launcher's arguments
(`mpirun ... shardmerge merge ...`), after `&&`, `;` or `|` too, and may continue over `\\`
line ends; `# comments` are dropped. No placeholder is skipped: a command line whose subcommand
is not one the binary lists fails. The oracle is the binary's own
`--help` (CLI11's option lists), not a list kept here."""
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README] + sorted((REPO / "docs").glob("*.md"))
SHELL_INFOS = {"", "sh", "bash", "shell", "console"}
PROGRAMS = ("shardmerge", "shardmerge-gen")
# Commands that run another command given after their own arguments.
LAUNCHERS = ("mpirun", "mpiexec", "srun", "torchrun", "env", "time", "nohup", "sudo", "timeout", "taskset", "numactl")
README_MAX_LINES = 200


def rel(path):
    return str(Path(path).relative_to(REPO))


# ---------------------------------------------------------------------------------------------
# Markdown: fenced blocks, the prose between them, inline code, links


def split_markdown(text):
    """([(info, first_line_no, [lines])] fenced blocks, prose text with fenced lines blanked)."""
    blocks, prose = [], []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        fence, info = m.group(1), m.group(2).lower()
        body, start = [], i + 2
        prose.append("")
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            prose.append("")
            i += 1
        assert i < len(lines), f"unclosed code fence opened at line {start - 1}"
        prose.append("")
        i += 1
        blocks.append((info, start, body))
    return blocks, "\n".join(prose)


def strip_comment(line):
    return re.sub(r"(^|\s)#.*$", "", line).rstrip()


def logical_lines(first_line_no, body):
    """Shell lines with `\\` continuations joined and comments dropped: [(line_no, text)]."""
    out, buf, start = [], "", None
    for n, raw in enumerate(body, first_line_no):
        line = strip_comment(raw)
        if start is None:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            out.append((start, buf.strip()))
        buf, start = "", None
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def commands_in_shell_line(text):
    """Each `shardmerge ...` / `shardmerge-gen ...` invocation of one shell line: (program, argv
    text). The program is a command's first word, or comes after a launcher's arguments."""
    found = []
    for segment in re.split(r"\s*(?:&&|\|\||;|\s\|\s)\s*", text):
        tokens = segment.split()
        if not tokens:
            continue
        starts = [0] if os.path.basename(tokens[0]) not in LAUNCHERS else range(1, len(tokens))
        for k in starts:
            if os.path.basename(tokens[k]) in PROGRAMS:
                found.append((os.path.basename(tokens[k]), " ".join(tokens[k + 1:])))
                break
    return found


def commands_in_text(text, name):
    """[(where, program, argv text)] for every command of one markdown text."""
    blocks, prose = split_markdown(text)
    cmds = []
    for info, first, body in blocks:
        if info not in SHELL_INFOS:
            continue
        for n, line in logical_lines(first, body):
            for prog, args in commands_in_shell_line(line):
                cmds.append((f"{name}:{n}", prog, args))
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(strip_comment(m.group(1)).split())
        prog = span.split(" ", 1)[0]
        if prog in PROGRAMS and " " in span:
            n = prose.count("\n", 0, m.start()) + 1
            cmds.append((f"{name}:{n} (inline)", prog, span.split(" ", 1)[1]))
    return cmds


def doc_commands(path):
    return commands_in_text(path.read_text(), rel(path))


def flags_of(args):
    """Every option word of a command's arguments: --long, -s (also inside [..], before =)."""
    return re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", args)


# ---------------------------------------------------------------------------------------------
# The binary's own --help


def help_text(binary, *args):
    proc = subprocess.run([binary, *args, "--help"], capture_output=True, text=True, timeout=60)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{binary} {' '.join(args)} --help exited {proc.returncode}:\n{text}"
    return text


def options_in_help(text):
    """Option names of a CLI11 help text: the `-v,--verbose TEXT ...` lines of its Options."""
    names = set()
    for line in text.splitlines():
        m = re.match(r"^\s{1,8}(-[^\s]+)", line)
        if m:
            names.update(n for n in m.group(1).split(",") if n.startswith("-"))
    return names


def subcommands_in_help(text):
    subs, inside = set(), False
    for line in text.splitlines():
        if line.strip().lower().startswith("subcommands:"):
            inside = True
            continue
        if inside:
            if not line.strip():
                if subs:
                    break
                continue
            m = re.match(r"^\s+([A-Za-z][\w-]*)\s", line + " ")
            if m:
                subs.add(m.group(1))
    return subs


@pytest.fixture(scope="session")
def cli(shardmerge_bin):
    """{"shardmerge": {subcommand or "": options}, "shardmerge-gen": {...} or None}."""
    top = help_text(shardmerge_bin)
    subs = subcommands_in_help(top)
    assert {"merge", "inspect", "verify"} <= subs, f"no subcommands read from --help:\n{top}"
    table = {"": options_in_help(top)}
    for s in sorted(subs):
        table[s] = options_in_help(help_text(shardmerge_bin, s))
    return {"shardmerge": table, "shardmerge-gen": None}


def gen_options(shardmerge_gen_bin):
    return {"": options_in_help(help_text(shardmerge_gen_bin))}


# ---------------------------------------------------------------------------------------------


def problems_in(cmds, cli, request):
    problems = []
    for where, prog, args in cmds:
        table = cli[prog]
        if table is None:  # shardmerge-gen: only when it is built (skips otherwise)
            table = cli[prog] = gen_options(request.getfixturevalue("shardmerge_gen_bin"))
        words = args.split()
        if prog == "shardmerge-gen":
            sub, rest = "", args
        elif not words or words[0].startswith("-"):
            sub, rest = "", args
            if not words:
                problems.append(f"{where}: `shardmerge` without a subcommand")
        else:
            sub, rest = words[0], " ".join(words[1:])
            if sub not in table:
                problems.append(f"{where}: `shardmerge {sub}`: no such subcommand "
                                f"(the binary lists {', '.join(sorted(k for k in table if k))})")
                continue
        for flag in flags_of(rest):
            if flag not in table[sub]:
                problems.append(f"{where}: `{prog}{' ' + sub if sub else ''}` does not accept {flag}")
    return problems


def test_the_docs_name_commands_at_all():
    """Guards the parser: if it found nothing, the flag test would pass vacuously."""
    per_doc = {rel(p): doc_commands(p) for p in DOCS}
    assert len(DOCS) > 1, "docs/*.md not found"
    assert per_doc["README.md"], "no shardmerge command found in README.md"
    assert sum(len(c) for c in per_doc.values()) >= 30, per_doc


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_command_uses_a_real_subcommand_and_real_flags(doc, cli, request):
    cmds = doc_commands(doc)
    problems = problems_in(cmds, cli, request)
    assert not problems, f"{len(problems)} command(s) in {rel(doc)} that the binary does not take:\n" + \
        "\n".join(problems)


def test_a_bogus_flag_or_subcommand_is_caught(cli, request):
    """The checker itself fails on what does not exist, in a block and inline."""
    text = ("```sh\nshardmerge merge --local_dir X --no-such-flag  # c\nshardmerge frobnicate --x\n```\n"
            "and `shardmerge verify --local_dir A --test_hf_dir B --bogus`\n")
    problems = problems_in(commands_in_text(text, "t"), cli, request)
    assert len(problems) == 3, problems
    assert "--no-such-flag" in problems[0] and "frobnicate" in problems[1] and "--bogus" in problems[2], problems


def test_readme_is_a_front_door():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move the manual's parts to docs/ (at most {README_MAX_LINES})"


def github_slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"`", "", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors_of(path):
    _, prose = split_markdown(path.read_text())
    slugs, seen = set(), {}
    for line in prose.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = github_slug(m.group(1))
            k = seen.get(s, 0)
            seen[s] = k + 1
            slugs.add(s if k == 0 else f"{s}-{k}")
    return slugs


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_relative_link_resolves(doc):
    _, prose = split_markdown(doc.read_text())
    prose = re.sub(r"`[^`]*`", "", prose)  # links inside inline code are not links
    bad = []
    for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, frag = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.exists():
            bad.append(f"{target}: no such file ({dest})")
            continue
        if frag and dest.is_file() and dest.suffix == ".md" and frag not in anchors_of(dest):
            bad.append(f"{target}: no heading #{frag} in {rel(dest)}")
    assert not bad, f"{rel(doc)}: broken links:\n" + "\n".join(bad)


def readme_merge_example():
    """The shell lines of the first code block under the README's "One merge" heading."""
    text = README.read_text()
    m = re.search(r"^## One merge\s*$", text, re.M)
    assert m, "README.md has no \"## One merge\" section"
    blocks, _ = split_markdown(text[m.end():])
    assert blocks, "no code block under \"## One merge\""
    _, first, body = blocks[0]
    return [line for _, line in logical_lines(first, body)]


def test_the_readme_merge_example_runs_on_the_demo(shardmerge_bin, tmp_path):
    """Run as written (with the binary for `shardmerge`), in a directory holding a copy of demo/."""
    shutil.copytree(REPO / "demo", tmp_path / "demo", symlinks=True)
    lines = readme_merge_example()
    assert any(line.startswith("shardmerge merge ") for line in lines), lines
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "shardmerge", f"README merge example: not a shardmerge command: {line}"
        proc = subprocess.run([shardmerge_bin, *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"README: `{line}` exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def plan_file_spec_keys():
    """The keys docs/plan-file.md lists for the top level and for each object (its tables' first
    column), by section: {"The top level": {...}, "Source": {...}, ...}."""
    keys, section = {}, None
    for line in (REPO / "docs" / "plan-file.md").read_text().splitlines():
        heading = re.match(r"^#{2,3} (.+)$", line)
        if heading:
            section = heading.group(1).strip()
            continue
        row = re.match(r"^\| ((?:`[a-z_0-9]+`(?:, )?)+) \|", line)
        if section and row:
            keys.setdefault(section, set()).update(re.findall(r"`([a-z_0-9]+)`", row.group(1)))
    return keys


def test_the_plan_file_spec_lists_every_field_the_writer_writes(shardmerge_bin, tmp_path):
    """docs/plan-file.md against `plan --json` of the demo (with a cast): every object's keys, no
    more and no fewer, and the cast op's fields."""
    shutil.copytree(REPO / "demo", tmp_path / "demo", symlinks=True)
    proc = subprocess.run([shardmerge_bin, "plan", "--local_dir", "demo", "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    tensor = plan["tensors"][0]
    written = {"The top level": plan, "Source": plan["sources"][0], "File": plan["files"][0], "Tensor": tensor,
               "Slice": tensor["copies"][0], "Record": plan["records"][0], "Sidecar": plan["sidecars"][0]}
    spec = plan_file_spec_keys()
    for section, obj in written.items():
        assert spec.get(section) == set(obj), f"docs/plan-file.md '{section}': {sorted(spec.get(section, []))} " \
                                              f"!= what plan --json writes: {sorted(obj)}"
    cast = next(op for op in tensor["ops"] if op["op"] == "cast")
    assert set(cast) == {"op", "from", "to"}, cast
    assert plan["shardmerge_plan"] == 1
