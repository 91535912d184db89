"""Docs link check: every relative markdown link in README.md and docs/**/*.md points at a file or folder that
exists; lists evidence files under docs/ that no page links to; docs/ must stay under 1 MB without design.md.

    python3 docs/check_links.py            # from the repository root; exit 1 on a broken link or docs/ too large
"""
import re, sys, subprocess, pathlib
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
files = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
link = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
bad, cited = [], set()
for f in files:
    text = f.read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # links inside code blocks are not links
    for m in link.finditer(text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        p = (f.parent / target).resolve()
        if not p.exists():
            bad.append(f"{f.relative_to(root)}: {m.group(1)}")
        else:
            cited.add(p)
tracked = subprocess.run(["git", "ls-files", "docs"], cwd=root, capture_output=True, text=True).stdout.split()
uncited = [t for t in tracked if (root / t).resolve() not in cited and not t.startswith("docs/results/") and t != "docs/design.md" and not t.endswith(".py")]
for b in bad: print("BROKEN", b)
for u in uncited: print("UNCITED", u)
size = sum((root / t).stat().st_size for t in tracked if t != "docs/design.md")
print(f"{len(bad)} broken links; {len(uncited)} uncited evidence files; docs/ without design.md: {size} bytes")
sys.exit(1 if bad or size >= 1_000_000 else 0)
