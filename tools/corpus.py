"""Assemble the demo model's multi-domain corpus from Debian packages and the local Python stdlib.

    python -m tools.corpus [--cache .corpus] [--heldout-kb 60] [--max-mb 4]

Downloads the Debian packages below with `apt-get download` into CACHE/debs, unpacks them with
`dpkg -x` into CACHE/root, and writes per domain:
    CACHE/<domain>.jsonl             training documents, one JSON object {"text": ...} a line
    data/heldout/<domain>.txt        held-out documents (a deterministic, hash-chosen subset)
    CACHE/manifest.json              sources, licences and sizes per domain
The held-out documents never appear in the training text.
"""

import argparse
import gzip
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HELDOUT_DIR = REPO / "data" / "heldout"

# domain -> list of (Debian package, licence as stated in its copyright file)
PACKAGES = {
    "en": [("fortunes", "BSD-style (fortune-mod), see the package copyright"),
           ("debian-reference-en", "GPL-2+"),
           ("debian-faq", "verbatim-copying permission (Software in the Public Interest)"),
           ("maint-guide", "GPL-2.0+ / MIT")],
    "de": [("fortunes-de", "GPL-2+"),
           ("debian-reference-de", "GPL-2+"),
           ("debian-faq-de", "verbatim-copying permission (Software in the Public Interest)"),
           ("maint-guide-de", "GPL-2.0+ / MIT")],
    "fr": [("debian-reference-fr", "GPL-2+"),
           ("debian-faq-fr", "verbatim-copying permission (Software in the Public Interest)"),
           ("maint-guide-fr", "GPL-2.0+ / MIT"),
           ("manpages-fr", "GPL-3+ (translations); see the package copyright")],
    "man": [("manpages", "Linux-man-pages-copyleft, GPL-2+, BSD (per page; see the package copyright)"),
            ("manpages-dev", "Linux-man-pages-copyleft, GPL-2+, BSD (per page; see the package copyright)")],
}
DOMAINS = ["en", "de", "fr", "python", "man"]
CHUNK = 3000  # long texts are cut at blank lines into documents of about this many characters


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def fetch_packages(cache):
    """apt-get download + dpkg -x every package once; returns the unpack root."""
    debs, root = cache / "debs", cache / "root"
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    for domain, pkgs in PACKAGES.items():
        for pkg, _ in pkgs:
            if list(debs.glob(f"{pkg}_*.deb")):
                continue
            log(f"downloading {pkg} ({domain})")
            got = subprocess.run(["apt-get", "download", pkg], cwd=debs, capture_output=True, text=True)
            if got.returncode != 0:
                sys.exit(f"apt-get download {pkg} failed (run `apt-get update` first?):\n{got.stderr}")
    for deb in sorted(debs.glob("*.deb")):
        stamp = root / f".{deb.name}.done"
        if not stamp.exists():
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
            stamp.touch()
    return root


def chunks(text, size=CHUNK):
    """Cut text at blank lines into pieces of about `size` characters."""
    out, cur = [], []
    n = 0
    for para in re.split(r"\n\s*\n", text):
        if not para.strip():
            continue
        cur.append(para.rstrip())
        n += len(para)
        if n >= size:
            out.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        out.append("\n\n".join(cur))
    return out


def read_gz(path):
    return gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")


def fortunes(folder):
    """Every fortune (entries split by lines holding a single %) of the plain files in folder."""
    docs = []
    for f in sorted(folder.iterdir()):
        if f.is_symlink() or not f.is_file() or f.suffix in (".dat", ".u8"):
            continue
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        docs += [d.strip("\n") for d in re.split(r"^%$", text, flags=re.M) if d.strip()]
    return docs


def debian_docs(root, lang):
    """debian-reference, debian-faq and maint-guide plain-text renderings in one language."""
    docs = []
    for path in [root / f"usr/share/debian-reference/debian-reference.{lang}.txt.gz",
                 root / f"usr/share/doc/debian/FAQ/debian-faq.{lang}.txt.gz",
                 next((root / "usr/share/doc").glob(f"maint-guide*/maint-guide.{lang}.txt.gz"))]:
        docs += chunks(read_gz(path))
    return docs


def render_man(path):
    """A gzipped man page rendered to plain UTF-8 text by groff (justification spaces collapsed)."""
    src = gzip.decompress(path.read_bytes())
    got = subprocess.run(["groff", "-k", "-t", "-man", "-Tutf8", "-rHY=0", "-P-cbou"],
                         input=src, capture_output=True)
    text = got.stdout.decode("utf-8", errors="replace")
    lines = [re.sub(r"(?<=\S) {2,}(?=\S)", " ", ln.rstrip()) for ln in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def man_pages(folder, max_chars):
    docs, total = [], 0
    for page in sorted(folder.glob("man*/*.gz")):
        if page.is_symlink():
            continue
        text = render_man(page)
        if len(text) < 200:  # .so redirections and empty stubs
            continue
        docs += chunks(text)
        total += len(text)
        if total >= max_chars:
            break
    return docs


def python_stdlib(max_chars):
    """Python standard library sources (no tests, no codec tables, no generated data)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "pydoc_data")
    docs, total = [], 0
    for f in sorted(stdlib.rglob("*.py")):
        rel = f.relative_to(stdlib)
        if any(part in skip for part in rel.parts) or f.stat().st_size > 150_000:
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        docs += chunks(f"# {rel}\n{text}")
        total += len(text)
        if total >= max_chars:
            break
    return docs, stdlib


def collect(root, max_chars):
    """domain -> (documents, source notes)."""
    games = root / "usr/share/games"
    out = {}
    out["en"] = (fortunes(games / "fortunes") + debian_docs(root, "en"), None)
    out["de"] = (fortunes(games / "fortunes/de") + debian_docs(root, "de"), None)
    out["fr"] = (debian_docs(root, "fr") + man_pages(root / "usr/share/man/fr", max_chars // 4), None)
    out["man"] = (man_pages(root / "usr/share/man", max_chars), None)
    py_docs, stdlib = python_stdlib(max_chars)
    out["python"] = (py_docs, f"Python {sys.version.split()[0]} standard library at {stdlib} (PSF-2.0)")
    return out


def split_heldout(docs, budget):
    """Pick documents by a content hash (stable across runs) until `budget` characters."""
    ranked = sorted(range(len(docs)), key=lambda i: zlib.crc32(docs[i].encode()))
    held, n = set(), 0
    for i in ranked:
        if n >= budget:
            break
        held.add(i)
        n += len(docs[i])
    train = [d for i, d in enumerate(docs) if i not in held]
    test = [d for i, d in enumerate(docs) if i in held]
    return train, test


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=REPO / ".corpus")
    ap.add_argument("--heldout-kb", type=int, default=60, help="held-out characters per domain (thousands)")
    ap.add_argument("--max-mb", type=float, default=8.0, help="cap on a domain's raw text (millions of chars)")
    args = ap.parse_args()
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None or shutil.which("groff") is None:
        sys.exit("tools/corpus.py needs apt-get, dpkg and groff (a Debian machine)")
    root = fetch_packages(args.cache)
    max_chars = int(args.max_mb * 1e6)
    HELDOUT_DIR.mkdir(parents=True, exist_ok=True)
    manifest = {}
    collected = collect(root, max_chars)
    for domain in DOMAINS:
        docs, note = collected[domain]
        docs = [d for d in docs if d.strip()]
        train, test = split_heldout(docs, args.heldout_kb * 1000)
        kept, n = [], 0
        for doc in train:
            if n >= max_chars:
                break
            kept.append(doc)
            n += len(doc)
        with open(args.cache / f"{domain}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in kept)
        (HELDOUT_DIR / f"{domain}.txt").write_text("\n\n".join(test) + "\n", encoding="utf-8")
        sources = [{"package": p, "licence": lic} for p, lic in PACKAGES.get(domain, [])]
        if note:
            sources.append({"source": note})
        manifest[domain] = {"sources": sources, "documents": len(docs), "train_chars": n,
                            "heldout_chars": sum(len(d) for d in test)}
        log(f"{domain:7s} docs {len(docs):6d}  train {n / 1e6:5.2f} M chars  "
            f"held-out {len(test)} docs")
    (args.cache / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(manifest, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
