"""Building kvrag's C kernels: each source compiled once per machine with the system's C compiler.

The shared library lands in ``$KVRAG_HOME/kernels/<stem>-<hash>.so``, the hash covering the source, the compiler and
the machine, so an edited source or another compiler builds anew; concurrent processes each build and the last
atomic rename wins. Built with OpenMP where the compiler has it (the kernels then share the runtime torch loaded).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvrag.paths import kvrag_home


def build(source: Path) -> Path:
    """The shared library built from ``source`` for this machine (built now if missing); RuntimeError when there is
    no C compiler or it fails."""
    src = source.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        msg = "no C compiler (cc / gcc) on PATH"
        raise RuntimeError(msg)
    key = hashlib.sha256(src + cc.encode() + os.uname().machine.encode()).hexdigest()[:16]
    out = kvrag_home() / "kernels" / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        base = [cc, "-O3", "-shared", "-fPIC", str(source), "-o", str(so)]
        res = subprocess.run([*base[:4], "-fopenmp", *base[4:]], capture_output=True, text=True, check=False)
        if res.returncode != 0:  # a compiler without OpenMP: one thread
            res = subprocess.run(base, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            msg = f"{cc} failed on {source.name}: {res.stderr.strip()[-400:]}"
            raise RuntimeError(msg)
        os.replace(so, out)
    return out


__all__ = ["build"]
