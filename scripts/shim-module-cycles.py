#!/usr/bin/env python3
"""Fails when the shim's modules (agent/shim/src, one module per file) import each other in a
cycle (issue 20). An edge A -> B is any `crate::B…` path in A's non-test code (also inside
`use crate::{…}` groups) or, in the crate root, any `B::` path; a `crate::item` or `super::item`
naming something of the crate root is an edge into the root (`lib`). Test code (`tests.rs`,
a `#[cfg(test)]` module at the end of a file) is left out: tests may reach anywhere.

Usage: scripts/shim-module-cycles.py [SRC_DIR]   (prints the edge list; exit 1 on a cycle)
       scripts/shim-module-cycles.py --self-test  (the check finds the cycles it must find)
"""
import re
import sys
from pathlib import Path

ROOT = "lib"


def strip(text):
    """The file's non-test code, without comments, string and character literals."""
    m = re.search(r"^#\[cfg\(test\)\]\s*\n\s*mod\s+\w+\s*(;|\{)", text, re.M)
    if m:
        text = text[: m.start()]
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            i = text.find("*/", i + 2)
            i = n if i < 0 else i + 2
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.match(r"\w", text[i - 1 : i] or " "):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + len(hashes) + 2)
            i = n if end < 0 else end + 1 + len(hashes)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.[^']*|[^'\\])'", text[i:]):
            i += re.match(r"'(\\.[^']*|[^'\\])'", text[i:]).end()
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def group_heads(text, start):
    """First path segment of each item of the `{…}` group opening at `start`."""
    depth, item, heads = 0, "", []
    for ch in text[start:]:
        if ch == "{":
            depth += 1
            if depth == 1:
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                heads.append(item)
                break
        if depth == 1 and ch == ",":
            heads.append(item)
            item = ""
        elif depth >= 1:
            item += ch
    out = []
    for h in heads:
        m = re.match(r"\s*(\w+)", h)
        if m:
            out.append(m.group(1))
    return out


def edges(src):
    files = sorted(p for p in src.rglob("*.rs") if p.stem != "tests")
    owner = {p: p.relative_to(src).parts[0].removesuffix(".rs") for p in files}
    modules = set(owner.values()) - {ROOT}
    graph = {}
    for p in files:
        me = owner[p]
        text = strip(p.read_text())
        heads = []
        # In a file of a module's folder, `super` is that module itself.
        prefix = r"\b(crate|super)::" if len(p.relative_to(src).parts) == 1 else r"\b(crate)::"
        for m in re.finditer(prefix + r"\s*(\{|\w+)", text):
            if m.group(2) == "{":
                heads += group_heads(text, m.start(2))
            else:
                heads.append(m.group(2))
        if me == ROOT:
            heads += re.findall(r"(?<![:\w])(\w+)::", text)
            heads += re.findall(r"\buse\s+(\w+)\b", text)
        out = set()
        for h in heads:
            if h in modules:
                out.add(h)
            elif h not in ("self", "super", "crate") and (me != ROOT):
                out.add(ROOT)
        out.discard(me)
        graph.setdefault(me, set()).update(out)
    return graph


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def self_test():
    """Small crates, with and without cycles, each checked as a shim's source would be."""
    import tempfile

    cases = [
        # (files, modules expected in cycles)
        ({"lib.rs": "mod a;\nmod b;\n", "a.rs": "use crate::b::f;\n", "b.rs": "pub fn f() { crate::a::g() }\n"}, [["a", "b"]]),
        # a module calling a function of the root, which uses the module
        ({"lib.rs": "mod a;\npub fn r() { a::g() }\n", "a.rs": "pub fn g() { super::r() }\n"}, [["a", "lib"]]),
        # grouped imports count
        ({"lib.rs": "mod a;\nmod b;\n", "a.rs": "use crate::{b::{f, h}, x};\n", "b.rs": "pub fn f() { crate::a::g() }\n"}, [["a", "b"]]),
        # a test module, comments and strings do not
        ({"lib.rs": "mod a;\nmod b;\n", "a.rs": "use crate::b::f;\n", "b.rs": "// crate::a::g\nfn s() -> &'static str { \"crate::a::g\" }\n#[cfg(test)]\nmod tests {\n    use crate::a::g;\n}\n"}, []),
        # a module's folder is the module; its `super` is that module
        ({"lib.rs": "mod a;\nmod b;\n", "a.rs": "mod c;\n", "a/c.rs": "use super::*;\nuse crate::b::f;\n", "b.rs": "use crate::a::g;\n"}, [["a", "b"]]),
    ]
    for files, want in cases:
        with tempfile.TemporaryDirectory() as d:
            for name, text in files.items():
                (Path(d) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(d) / name).write_text(text)
            got = cycles(edges(Path(d)))
            if got != want:
                print(f"self-test failed on {files}: cycles {got}, expected {want}", file=sys.stderr)
                sys.exit(1)
    print(f"self-test: {len(cases)} cases as expected")


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "agent/shim/src")
    graph = edges(src)
    for a in sorted(graph):
        for b in sorted(graph[a]):
            print(f"{a} -> {b}")
    bad = cycles(graph)
    for c in bad:
        print("cycle among: " + ", ".join(c), file=sys.stderr)
    if bad:
        sys.exit(1)
    print(f"no cycle among the shim's {len(graph)} modules")


if __name__ == "__main__":
    main()
