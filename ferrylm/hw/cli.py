"""`ferry doctor`: read (and with --measure, measure) this machine, print each check, optionally as JSON
or as a script of fixes. Exit status 1 when a check fails."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ferrylm import files
from ferrylm.errors import FerryError


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="read this machine and say what to fix for serving (changes nothing)")
    p.add_argument("--model-path", default=None, help="model directory or store whose disk to check")
    p.add_argument("--log-path", default=".", help="where logs go (disk and inodes checked)")
    p.add_argument("--plan-host-gb", type=_gb, default=0.0,
                   help="host memory the plan keeps pinned, GB (ferry plan's placement host bytes; 0: not known)")
    p.add_argument("--measure", action="store_true", help="also measure memory and PCIe bandwidth (takes seconds)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--write-fixes", metavar="FILE", default=None,
                   help="write the fix commands into a shell script for review (replaced whole, never half-written)")
    p.set_defaults(func=cmd_doctor)


def _gb(text: str) -> float:
    """A --plan-host-gb value: a finite number of GB, 0 or more."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GB (a number >= 0; 0: not known)")
    return v


def run_checks(a: argparse.Namespace) -> list:
    from ferrylm.cli import LOG_LEVEL_ENV
    from ferrylm.hw import doctor, probe

    need = int(a.plan_host_gb * 1e9)
    host = probe.read_host()
    checks = doctor.host_checks(host, need)
    paths = {"logs": probe.disk_usage(a.log_path)}
    if a.model_path:
        paths["model"] = probe.disk_usage(a.model_path)
    checks += doctor.disk_checks(paths)
    checks.append(doctor.log_level_check(os.environ.get(LOG_LEVEL_ENV)))
    from ferrylm.layers import host_native

    checks.append(doctor.host_kernels_check(host_native.why_unavailable(), host_native.nf4_bf16(), host_native.amx(),
                                            {"amx_tile", "amx_bf16"} <= set(host.flags)))
    gpus = probe.read_gpus()
    checks += doctor.gpu_checks(gpus, probe.nvml() is not None)
    if a.measure:
        from ferrylm.hw import bandwidth

        m = bandwidth.measure(a.plan_host_gb, host.numa_nodes)
        for g in gpus:
            if g.index in m["gpus"]:
                m["gpus"][g.index].update(pcie_gen=g.pcie_gen_max, numa_node=g.numa_node)
        checks += doctor.bandwidth_checks(m, bool(m["gpus"]))
    return checks


def cmd_doctor(a: argparse.Namespace) -> None:
    from ferrylm.hw import doctor

    if a.write_fixes is not None:  # '' too: a path that names nothing is refused, not ignored
        fixes_target(a.write_fixes)  # a bad path fails before the checks (and --measure) take their time
    checks = run_checks(a)
    if a.write_fixes is not None:
        write_atomic(a.write_fixes, doctor.fixes_script(checks))
    if a.json:
        print(json.dumps({"checks": [c.to_dict() for c in checks], "summary": doctor.summary(checks)}))
    else:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        colour = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
        t = Table(title="ferry doctor")
        for col in ("check", "status", "found", "expected", "why / fix"):
            t.add_column(col)
        for c in checks:
            where = " [dim](in the shell that starts ferry)[/]" if c.scope == doctor.SHELL else ""
            note = escape(c.why) + (f"\n[bold]{escape(c.fix)}[/]{where}" if c.fix and c.status != "ok" else "")
            t.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", escape(c.value), escape(c.expected), note)
        Console(file=sys.stdout, width=160).print(t)
        s = doctor.summary(checks)
        print(", ".join(f"{n} {k}" for k, n in s.items()))
    if any(c.status == "fail" for c in checks):
        sys.exit(1)


def fixes_target(path: str) -> str:
    """`--write-fixes FILE` as an absolute path, or a `FerryError` saying why it cannot be written
    (`files.writable_target`)."""
    return files.writable_target("--write-fixes", path, "fixes.sh")


def write_atomic(path: str, text: str) -> None:
    """`--write-fixes`: `files.write_atomic` into the checked target, its failure a `FerryError` naming the flag."""
    p = fixes_target(path)
    try:
        files.write_atomic(p, text)
    except OSError as e:
        raise FerryError(f"--write-fixes {path}: {e.strerror or e}") from None
