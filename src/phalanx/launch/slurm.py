"""``phalanx run`` inside a SLURM allocation: the hosts come from SLURM's variables, not from flags.

``srun --ntasks-per-node=1 phalanx run -n 4 train.py`` starts one launcher per node;
each reads ``SLURM_JOB_NODELIST`` (the first node hosts the store), ``SLURM_NODEID``
(its node rank), ``SLURM_NNODES`` and ``SLURM_JOB_ID`` (the store's port is derived
from it, so every node picks the same one). ``-n`` defaults to ``SLURM_GPUS_ON_NODE``
where SLURM gave the node GPUs. A flag that disagrees with SLURM is refused in one line.

Example:
    >>> expand_nodelist("gpu[01-03,7],login1")
    ['gpu01', 'gpu02', 'gpu03', 'gpu7', 'login1']
    >>> s = SlurmEnv.from_environ({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "1",
    ...                            "SLURM_NNODES": "2", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"})
    >>> s.hosts, s.node_id, s.port
    (('n1', 'n2'), 1, 15042)
"""
from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping

from ..errors import ConfigError, usage

PORT_BASE, PORT_SPAN = 15000, 20000  # the store's port: PORT_BASE + job id mod PORT_SPAN, the same on every node


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list (``a[1-3,05],b``) as names, in order; ``scontrol show hostnames`` in Python."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if match is None:
            names.append(part)
            continue
        prefix, ranges, rest = match.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                names += [f"{prefix}{i:0{width}d}{tail}" for tail in expand_nodelist(rest)] if rest \
                    else [f"{prefix}{i:0{width}d}"]
    return names


@dataclass(frozen=True)
class SlurmEnv:
    """The allocation this launcher runs in, read once from SLURM's variables."""

    job_id: int
    hosts: tuple[str, ...]
    node_id: int
    nnodes: int
    in_step: bool  # started by srun (SLURM_STEP_ID): one launcher per node; else the batch script, on node 0 only
    tasks_per_node: int
    gpus_on_node: int | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "SlurmEnv | None":
        """None outside SLURM (no ``SLURM_JOB_ID``); raises :class:`ConfigError` for variables that do not parse."""
        if "SLURM_JOB_ID" not in env or "SLURM_JOB_NODELIST" not in env:
            return None
        try:
            hosts = tuple(expand_nodelist(env["SLURM_JOB_NODELIST"]))
            nnodes = int(env.get("SLURM_NNODES", len(hosts)))
            ntasks = int(env.get("SLURM_NTASKS", nnodes))
            per_node = env.get("SLURM_NTASKS_PER_NODE", "")
            tasks = int(re.match(r"\d+", per_node).group()) if re.match(r"\d+", per_node) else -(-ntasks // nnodes)
            gpus = int(env["SLURM_GPUS_ON_NODE"]) if env.get("SLURM_GPUS_ON_NODE", "").isdigit() else None
            out = cls(job_id=int(env["SLURM_JOB_ID"]), hosts=hosts, node_id=int(env.get("SLURM_NODEID", "0")),
                      nnodes=nnodes, in_step="SLURM_STEP_ID" in env, tasks_per_node=tasks, gpus_on_node=gpus)
        except (ValueError, AttributeError):
            shown = " ".join(f"{n}={env.get(n)!r}" for n in ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID"))
            raise ConfigError(usage(shown,
                                    "the variables SLURM sets in an allocation",
                                    "Run phalanx run inside sbatch/srun, or unset the SLURM_* variables.")) from None
        if len(hosts) != nnodes or not 0 <= out.node_id < nnodes:
            raise ConfigError(usage(f"SLURM_JOB_NODELIST with {len(hosts)} host(s), SLURM_NNODES={nnodes}, "
                                    f"SLURM_NODEID={out.node_id}", "one host per node and 0 <= SLURM_NODEID < NNODES",
                                    "Run phalanx run inside sbatch/srun, or unset the SLURM_* variables."))
        return out

    @property
    def port(self) -> int:
        """The store's port on the first node, the same on every node of the job."""
        return PORT_BASE + self.job_id % PORT_SPAN

    def check_launchers(self) -> None:
        """One ``phalanx run`` per node: refuse a batch script on several nodes, or several tasks per node."""
        if self.nnodes > 1 and not self.in_step:
            raise ConfigError(usage(f"`phalanx run` in the batch script of a {self.nnodes}-node job (it runs on "
                                    "the first node only)", "one phalanx run per node",
                                    "Start it with `srun --ntasks-per-node=1 phalanx run ...`."))
        if self.tasks_per_node > 1:
            raise ConfigError(usage(f"{self.tasks_per_node} SLURM tasks per node (each would start its own "
                                    "phalanx run)", "one task per node; phalanx run starts the workers (-n)",
                                    "Use `srun --ntasks-per-node=1 phalanx run -n N ...`."))


def node_address(name: str) -> str:
    """The address SLURM reaches node ``name`` at (its ``NodeAddr``; the name itself when scontrol says nothing)."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    if shutil.which("scontrol") is None:
        return name
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return name
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else name


def requeue(job_id: int) -> str:
    """``scontrol requeue JOB``; returns the line to print."""
    try:
        done = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"phalanx: could not requeue SLURM job {job_id}: {err}"
    if done.returncode:
        return f"phalanx: `scontrol requeue {job_id}` failed: {(done.stderr or done.stdout).strip()}"
    return f"phalanx: requeued SLURM job {job_id} (`scontrol requeue`)"
