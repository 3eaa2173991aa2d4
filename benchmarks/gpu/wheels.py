"""The wheels that travel to the GPU machine, and what travels in all.

The GPU machine (docs/GPU.md) has Python 3.12, torch 2.11 (CUDA 13), transformers,
numpy, httpx, uvloop, prometheus-client, msgpack and pytest, and no network. What
kvpush needs beyond that travels as cp312 manylinux x86-64 wheels in ``WHEEL_DIR``
(ignored by git, named in the device tool's ``carry``):

* :func:`download` fetches :data:`CARRIED` (pinned as in requirements.txt) with
  ``pip download --no-deps --only-binary=:all:`` for that platform;
* :func:`slim_nixl` rewrites the ``nixl-cu13`` wheel (56 MB) down to what NIXL's UCX
  backend loads (the UCX plugin, UCX with its CUDA and shared-memory modules, and the
  shared libraries those need, found from the ELF ``DT_NEEDED`` entries), as a valid
  wheel with a fresh RECORD;
* :func:`check_complete` asks pip to resolve kvpush's runtime dependencies (from
  pyproject.toml) plus NIXL for a clean cp312 environment from those wheels and from
  stand-ins for what the GPU machine already has (:data:`PROVIDED`), without
  installing anything: a missing wheel is a resolution error;
* :func:`travel_size` adds up what the device tool sends: the repository's tracked and
  untracked-not-ignored files plus the carried folder (limit: 64 MiB).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: relative to the repository root; ``/.cache/`` is in .gitignore
WHEEL_DIR = Path(".cache/gpu-wheels")
#: the device tool's limit on everything that travels in one run
TRAVEL_LIMIT = 64 << 20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
PYTHON_VERSION = "3.12"
NIXL_VERSION = "1.5.1"

#: packages kvpush needs that the GPU machine lacks (or whose version there is not
#: known to fit), with their own needs; versions come from requirements.txt
CARRIED = ("fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
           "annotated-doc", "typing-inspection", "typing-extensions", "opentelemetry-api",
           "anyio", "idna", "h11", "click", "uvicorn", "msgspec", "pyzmq", "nixl", "nixl-cu13",
           "httptools",  # the door of the router and of the instances (httptools' parser)
           "llguidance")  # structured outputs (kvpush.grammar)

#: what the GPU machine has, with the version pip resolves against. "kinds": read off
#: such a machine (the device tool's KINDS.md, 2026-11); "assumed": the package is
#: listed there without a version, so the version of requirements.txt stands in (the
#: check's env step prints the real ones).
PROVIDED: dict[str, tuple[str, str]] = {
    "torch": ("2.11.0", "kinds"),
    "numpy": ("2.5.2", "kinds"),
    "transformers": ("5.17.0", "kinds"),
    "tokenizers": ("0.23.2", "kinds"),
    "safetensors": ("0.8.0", "kinds"),
    "huggingface-hub": ("1.33.0", "kinds"),
    "jinja2": ("3.1.6", "assumed"),
    "httpx": ("0.28.1", "assumed"),
    "httpcore": ("1.0.9", "assumed"),  # httpx's own dependency, so there with it
    "prometheus-client": ("0.26.0", "assumed"),
    # nixl (the meta package) requires both CUDA builds; it imports nixl_cu13 when torch
    # is built for CUDA 13, so the CUDA 12 build stays behind
    "nixl-cu12": (NIXL_VERSION, "omitted"),
}

# -- nixl-cu13 slimming ----------------------------------------------------------------

#: ELF objects kept whatever they link: the Python extension modules, the UCX plugin
#: (both copies: the package's plugin folder and the auditwheel one) and the UCX
#: modules for GPU memory (cuda_copy, cuda_ipc, gdr_copy: libuct_cuda; memory hooks:
#: libucm_cuda) and cross-memory attach between processes (libuct_cma). UCX's TCP,
#: shared-memory (posix, sysv) and self transports live in libuct itself.
NIXL_ROOTS = (
    re.compile(r"nixl_cu13/[^/]+\.so$"),
    re.compile(r"\.nixl_cu13\.mesonpy\.libs/plugins/libplugin_UCX\.so$"),
    re.compile(r"nixl_cu13\.libs/nixl/libplugin_UCX\.so$"),
    re.compile(r"nixl_cu13\.libs/ucx/lib(uct_cuda|ucm_cuda|uct_cma)\.(so\.0\.0\.0|la)$"),
)
#: folders whose shared libraries are kept only when a kept object needs them
NIXL_LIB_DIRS = (".nixl_cu13.mesonpy.libs/", "nixl_cu13.libs/")


def elf_needed(data: bytes) -> list[str]:
    """The ``DT_NEEDED`` names of a 64-bit little-endian ELF file ([] if not one)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    out: list[str] = []
    for sh in sections:
        if sh[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[sh[6]]  # sh_link: the string table
        for off in range(sh[4], sh[4] + sh[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strtab[4] + val
                out.append(data[start:data.index(b"\0", start)].decode())
    return out


def nixl_keep(files: dict[str, bytes]) -> set[str]:
    """Which members of the nixl-cu13 wheel to keep: Python sources, metadata and
    licences, :data:`NIXL_ROOTS`, and the closure of what the kept ELF objects need."""
    keep = {n for n in files
            if n.startswith("nixl_cu13/") and not n.endswith(".so")
            or n.startswith("nixl_cu13-") and ".dist-info/" in n}
    keep |= {n for n in files if any(r.search(n) for r in NIXL_ROOTS)}
    libs = {Path(n).name: n for n in files if n.startswith(NIXL_LIB_DIRS)
            and "/plugins/" not in n and "/nixl/" not in n and "/ucx/" not in n}
    todo = [n for n in keep if files[n][:4] == b"\x7fELF"]
    while todo:
        for dep in elf_needed(files[todo.pop()]):
            path = libs.get(dep)
            if path is not None and path not in keep:
                keep.add(path)
                todo.append(path)
    keep.discard(next((n for n in files if n.endswith(".dist-info/RECORD")), ""))
    return keep


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def rewrite_wheel(src: Path, dst: Path, keep: set[str]) -> None:
    """Write ``dst``: ``src``'s members in ``keep`` (same order and permissions) and a
    RECORD listing each with its hash and size."""
    buf = io.StringIO()
    rec = csv.writer(buf, lineterminator="\n")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(
            dst, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(i.filename for i in zin.infolist()
                           if i.filename.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if info.filename not in keep:
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            rec.writerow([info.filename, _record_hash(data), len(data)])
        rec.writerow([record_name, "", ""])
        zout.writestr(record_name, buf.getvalue())


def slim_nixl(wheel: Path) -> tuple[int, int]:
    """Slim the nixl-cu13 wheel in place (once: a wheel already slimmed is left alone);
    returns its size (before, after)."""
    before = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as z:
        files = {i.filename: z.read(i) for i in z.infolist()}
    keep = nixl_keep(files)
    if len(keep) + 1 == len(files):
        return before, before
    tmp = wheel.with_suffix(".slim")
    rewrite_wheel(wheel, tmp, keep)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


def verify_wheel(wheel: Path) -> list[str]:
    """Problems with a wheel's RECORD (missing, unlisted or mismatched members)."""
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        listed: set[str] = set()
        for row in csv.reader(io.StringIO(z.read(record).decode())):
            if not row:
                continue
            name, digest, size = row
            listed.add(name)
            if name == record:
                continue
            if name not in names:
                problems.append(f"RECORD lists {name}, not in the wheel")
                continue
            data = z.read(name)
            if digest != _record_hash(data) or int(size) != len(data):
                problems.append(f"{name}: hash or size differs from RECORD")
        problems += [f"{n} not in RECORD" for n in sorted(names - listed)]
    return problems


# -- download ----------------------------------------------------------------------------

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions(root: Path = ROOT) -> dict[str, str]:
    """name -> version from requirements.txt and requirements-nodeps.txt."""
    pins: dict[str, str] = {}
    for f in ("requirements.txt", "requirements-nodeps.txt"):
        for line in (root / f).read_text().splitlines():
            m = re.match(r"\s*([A-Za-z0-9_.\-]+)==([^\s#;]+)", line)
            if m:
                pins[_norm(m.group(1))] = m.group(2)
    pins.setdefault("nixl-cu13", NIXL_VERSION)
    return pins


def carried_specs(root: Path = ROOT) -> list[str]:
    pins = pinned_versions(root)
    missing = [n for n in CARRIED if _norm(n) not in pins]
    if missing:
        raise SystemExit(f"no pinned version for {', '.join(missing)} in requirements*.txt")
    return [f"{n}=={pins[_norm(n)]}" for n in CARRIED]


def platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION,
            "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for p in (*PLATFORMS, "any"):
        args += ["--platform", p]
    return args


def download(dest: Path, root: Path = ROOT) -> None:
    """Fetch every carried wheel into ``dest`` (pip skips what is already there), drop
    wheels of other versions, and slim nixl-cu13."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = carried_specs(root)
    wanted = {_norm(s.split("==")[0]): s.split("==")[1] for s in specs}
    have = {wheel_name_version(w) for w in dest.glob("*.whl")}
    # a wheel already here is kept as it is (pip would fetch the slimmed one again)
    todo = [s for s in specs if (_norm(s.split("==")[0]), s.split("==")[1]) not in have]
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        *platform_args(), "-d", str(dest), *todo], check=True)
    for w in dest.glob("*.whl"):
        name, version = wheel_name_version(w)
        if wanted.get(name) != version:
            print(f"removing {w.name}: not a carried version")
            w.unlink()
    for w in dest.glob("nixl_cu13-*.whl"):
        before, after = slim_nixl(w)
        print(f"{w.name}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
        problems = verify_wheel(w)
        if problems:
            raise SystemExit(f"{w.name}: " + "; ".join(problems[:5]))


def wheel_name_version(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return _norm(name), version


# -- completeness -------------------------------------------------------------------------

def runtime_requirements(root: Path = ROOT) -> list[str]:
    """kvpush's runtime dependencies (pyproject.toml) plus NIXL for CUDA 13."""
    import tomllib

    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    return [*deps, f"nixl=={NIXL_VERSION}", f"nixl-cu13=={NIXL_VERSION}"]


def stub_wheel(folder: Path, name: str, version: str, requires: Iterable[str] = ()) -> Path:
    """A metadata-only wheel standing in for a package the GPU machine has."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    needs = "".join(f"Requires-Dist: {r}\n" for r in requires)
    meta = {f"{dist}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{needs}",
            f"{dist}.dist-info/WHEEL":
            "Wheel-Version: 1.0\nGenerator: kvpush-gpu\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as z:
        for n, text in meta.items():
            z.writestr(n, text)
        z.writestr(f"{dist}.dist-info/RECORD",
                   "".join(f"{n},,\n" for n in [*meta, f"{dist}.dist-info/RECORD"]))
    return path


@dataclass
class Completeness:
    ok: bool
    carried: list[str]  # wheels pip would install from the carried folder
    provided: list[str]  # resolved to what the GPU machine has
    unused: list[str]  # carried wheels nothing needs
    error: str = ""


def check_complete(wheel_dir: Path, root: Path = ROOT, timeout: float = 120) -> Completeness:
    """Resolve :func:`runtime_requirements` for cp312 manylinux x86-64 from ``wheel_dir``
    and stand-ins for :data:`PROVIDED`, offline (``--no-index``), installing nothing."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        return Completeness(False, [], [], [], f"no wheels in {wheel_dir} (make gpu-wheels)")
    with tempfile.TemporaryDirectory(prefix="kvpush-gpu-wheels-") as tmp:
        stubs = Path(tmp) / "provided"
        stubs.mkdir()
        for name, (version, _) in PROVIDED.items():
            stub_wheel(stubs, name, version)
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
               "--disable-pip-version-check", "--no-index", "--ignore-installed",
               "--find-links", str(wheel_dir), "--find-links", str(stubs),
               "--target", str(Path(tmp) / "site"), *platform_args(),
               "--report", str(report), *runtime_requirements(root)]
        env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)  # offline: no configured indexes
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return Completeness(False, [], [], [], f"pip did not answer in {timeout:.0f} s")
        if run.returncode != 0:
            lines = [ln for ln in (run.stderr + run.stdout).splitlines() if ln.strip()]
            return Completeness(False, [], [], [], " ".join(lines[-4:]))
        items = json.loads(report.read_text())["install"]
    provided = {_norm(n) for n in PROVIDED}
    names = {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    carried = sorted(f"{n}=={v}" for n, v in names.items() if n not in provided)
    used = {n for n in names if n not in provided}
    unused = sorted(w.name for w in wheels if wheel_name_version(w)[0] not in used)
    return Completeness(True, carried, sorted(f"{n}=={v}" for n, v in names.items()
                                              if n in provided), unused)


# -- size -----------------------------------------------------------------------------------

#: skipped when there is no git to ask what is ignored (an export without .git)
UNTRACKED_DIRS = {".git", ".venv", ".cache", "__pycache__", ".pytest_cache", ".ruff_cache"}


def _git_files(root: Path) -> list[Path]:
    """What travels: git's tracked and untracked-not-ignored files; without git, every
    file outside :data:`UNTRACKED_DIRS` (an estimate from above)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=root, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [p for p in root.rglob("*")
                if not UNTRACKED_DIRS.intersection(p.relative_to(root).parts)]
    return [root / p for p in out.decode().split("\0") if p]


def _sizes(paths: Iterable[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


@dataclass
class TravelSize:
    tree: int  # tracked and untracked-not-ignored files
    carried: int  # the carried folders
    limit: int = TRAVEL_LIMIT

    @property
    def total(self) -> int:
        return self.tree + self.carried

    @property
    def ok(self) -> bool:
        return self.total < self.limit

    def describe(self) -> str:
        mib = 2**20
        return (f"travelling: {self.total / mib:.1f} MiB of {self.limit / mib:.0f} MiB "
                f"(tree {self.tree / mib:.1f} MiB, carried wheels {self.carried / mib:.1f} MiB)")


def travel_size(root: Path = ROOT, carry: Iterable[Path] = (WHEEL_DIR,)) -> TravelSize:
    """What one device run sends: git's view of the tree, plus each carried folder."""
    tree = _sizes(_git_files(root))
    carried = sum(_sizes((root / c).rglob("*")) for c in carry if (root / c).exists())
    return TravelSize(tree, carried)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Fetch, slim and check the GPU machine's wheels.")
    p.add_argument("--dir", type=Path, default=ROOT / WHEEL_DIR)
    p.add_argument("--check-only", action="store_true", help="no download")
    args = p.parse_args(argv)
    if not args.check_only:
        download(args.dir)
    comp = check_complete(args.dir)
    if comp.ok:
        print(f"complete for cp312 + the GPU machine's packages: {len(comp.carried)} carried "
              f"({', '.join(comp.carried)}); provided there: {', '.join(comp.provided)}")
        if comp.unused:
            print(f"carried but not needed: {', '.join(comp.unused)}")
    else:
        print(f"INCOMPLETE: {comp.error}")
    size = travel_size()
    print(size.describe())
    return 0 if comp.ok and size.ok else 1


if __name__ == "__main__":
    sys.exit(main())
