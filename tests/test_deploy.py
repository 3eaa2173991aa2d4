"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas (strict:
unknown fields refused), and every kvpush command line in them parses with kvpush's own
CLI (a renamed or misspelled flag fails here, not in a cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvpush.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in MANIFESTS:
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def test_manifests_exist():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in _docs()}
    assert {("StatefulSet", "etcd"), ("Deployment", "kvpush-router"),
            ("Deployment", "kvpush-prefill"), ("Deployment", "kvpush-decode")} <= kinds
    assert (DEPLOY / "README.md").is_file()


def test_manifests_match_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate "
                                                           "(requirements.txt)")
    for name, doc in _docs():
        try:
            kv.validate(doc, kv.latest_version(), strict=True)
        except kv.ValidationError as e:
            raise AssertionError(f"{name} {doc['kind']}/{doc['metadata']['name']}: "
                                 f"{e.message} at {list(e.path)}") from None


def _kvpush_args() -> list[tuple[str, list[str], dict]]:
    out = []
    for name, doc in _docs():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("kvpush"):
                env = {e["name"]: e for e in c.get("env", [])}
                out.append((f"{name}:{doc['metadata']['name']}", c["args"], env))
    return out


def test_kvpush_command_lines_parse():
    cmds = _kvpush_args()
    assert len(cmds) == 3
    parser = build_parser()
    for where, args, env in cmds:
        assert "$(POD_IP)" not in " ".join(args) or "POD_IP" in env, where
        argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in args]
        ns = parser.parse_args(argv)
        if argv[0] == "serve":
            assert ns.register and ns.advertise_url == "http://10.1.2.3:8000", where
            assert ns.host == "0.0.0.0" and ns.side_channel_host == "10.1.2.3", where
            assert ns.kv_secret_file and not ns.insecure_kv_params, where
        else:
            assert argv[0] == "router" and ns.discover, where
            assert ns.kv_secret_file, where
        # secrets reach the process through files and the environment, never argv
        assert not any("api-key" in a or "password" in a for a in argv), where


def test_the_secret_file_is_mounted_owner_only():
    """kvpush refuses a --kv-secret-file that group or others can read (issue 40), and a
    Kubernetes secret volume's files are 0644 unless the volume says otherwise: the
    pods of these manifests refused to start (failed before: no mode given)."""
    seen = 0
    for name, doc in _docs():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for vol in spec.get("volumes", []):
            secret = vol.get("secret")
            if not secret or not any(i.get("key") == "kv-secret"
                                     for i in secret.get("items", [])):
                continue
            seen += 1
            for item in secret["items"]:
                mode = item.get("mode", secret.get("defaultMode", 0o644))
                assert mode & 0o077 == 0, (name, vol["name"], oct(mode))
    assert seen >= 3
