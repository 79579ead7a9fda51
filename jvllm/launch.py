"""`jvllm launch`: run one command as N cooperating processes on this host, one per GPU group,
the way tensor parallelism runs fastest on one host (one process per GPU beat both GPUs driven
from one process, whose host launch time bounded every step: benchmarks/results/INDEX.md).

    jvllm launch --nproc 2 -- jvllm bench all --model random:llama3-8b -tp 2
    jvllm launch --nproc 2 -- python my_script.py        # my_script builds LLM(..., tensor_parallel_size=2)

Each process gets JVLLM_COORDINATOR (127.0.0.1 and a free port), JVLLM_NUM_PROCESSES and
JVLLM_PROCESS_ID, which `LLM(...)` and the CLI read to start `jax.distributed`, and
CUDA_VISIBLE_DEVICES set to its own `--devices-per-process` GPUs (a slice of the launcher's
CUDA_VISIBLE_DEVICES when that is set). Process 0's output passes through; the others' goes to
log files in `--log-dir` (a new temporary folder unless given). Contract: every process runs the
same program and submits the same requests in the same order (multi-controller JAX); the
launcher's exit status is the first failing process's, and when one process fails the others are
stopped (they would otherwise wait forever in a collective for the one that is gone)."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_envs(nproc: int, devices_per_process: int = 1, port: int | None = None,
                 base: dict | None = None) -> list[dict]:
    """The environment of each of `nproc` processes (see the module docstring). Raises ValueError
    naming the sizes when CUDA_VISIBLE_DEVICES lists fewer GPUs than nproc x devices_per_process."""
    if nproc < 1 or devices_per_process < 1:
        raise ValueError(f"--nproc ({nproc}) and --devices-per-process ({devices_per_process}) must be >= 1")
    base = dict(os.environ if base is None else base)
    port = port or free_port()
    visible = base.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x.strip()] if visible else None
    need = nproc * devices_per_process
    if ids is not None and len(ids) < need:
        raise ValueError(f"--nproc {nproc} x --devices-per-process {devices_per_process} = {need} GPUs, but "
                         f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)}")
    envs = []
    for i in range(nproc):
        mine = range(i * devices_per_process, (i + 1) * devices_per_process)
        env = dict(base, JVLLM_COORDINATOR=f"127.0.0.1:{port}", JVLLM_NUM_PROCESSES=str(nproc),
                   JVLLM_PROCESS_ID=str(i),
                   CUDA_VISIBLE_DEVICES=",".join(ids[j] for j in mine) if ids is not None else
                   ",".join(str(j) for j in mine))
        envs.append(env)
    return envs


def launch(cmd: list[str], nproc: int, devices_per_process: int = 1, log_dir: str | None = None,
           port: int | None = None, poll_s: float = 0.2, grace_s: float = 10.0) -> int:
    """Run `cmd` as `nproc` processes; returns 0 when all succeed, else the first failure's exit
    status (the others are then terminated, killed after `grace_s`)."""
    if not cmd:
        raise ValueError("no command to launch (put it after --)")
    envs = process_envs(nproc, devices_per_process, port)
    log_dir = log_dir or tempfile.mkdtemp(prefix="jvllm_launch_")
    os.makedirs(log_dir, exist_ok=True)
    logs, procs = [], []
    print(f"jvllm launch: {nproc} processes, {devices_per_process} device(s) each, coordinator "
          f"{envs[0]['JVLLM_COORDINATOR']}; processes 1..{nproc - 1} log to {log_dir}", file=sys.stderr, flush=True)
    try:
        for i, env in enumerate(envs):
            if i == 0:
                out = None  # inherits the launcher's stdout/stderr
            else:
                out = open(os.path.join(log_dir, f"process_{i}.log"), "w")
                logs.append(out)
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
        failed = None
        while failed is None and any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    failed = i
                    break
            else:
                time.sleep(poll_s)
        if failed is None:
            failed = next((i for i, p in enumerate(procs) if p.returncode), None)
        if failed is None:
            return 0
        rc = procs[failed].returncode
        print(f"jvllm launch: process {failed} exited with status {rc}; stopping the others", file=sys.stderr,
              flush=True)
        if failed:
            path = os.path.join(log_dir, f"process_{failed}.log")
            for f in logs:
                f.flush()
            with open(path, errors="replace") as f:
                tail = f.read()[-3000:]
            print(f"--- last lines of {path} ---\n{tail}", file=sys.stderr, flush=True)
        return rc if rc else 1
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        return 130
    finally:
        _stop(procs, grace_s)
        for f in logs:
            f.close()


def _stop(procs, grace_s: float):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def register(sub):
    p = sub.add_parser("launch", help="run a command as N processes on this host, one per GPU (multi-process TP)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, required=True, help="number of processes (e.g. one per GPU)")
    p.add_argument("--devices-per-process", type=int, default=1, help="GPUs each process sees (default 1)")
    p.add_argument("--log-dir", default=None, help="where processes 1.. write their output (default: a new temp folder)")
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every process runs")
    p.set_defaults(func=cmd_launch)


def cmd_launch(a):
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    try:
        rc = launch(cmd, a.nproc, a.devices_per_process, a.log_dir, a.port)
    except ValueError as e:
        raise SystemExit(f"jvllm launch: {e}")
    raise SystemExit(rc)
