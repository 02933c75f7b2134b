"""`dflash regenerate --server` against `transformers serve` on the tiny target, beside the in-process path.

For each concurrency (default 1, 4, 16): rows/s and requests/s through the server; the client's CPU time per
row (this process's user + system time over the run: the asyncio loop, httpx, JSON, the output files) and the
server's time per row (the run's wall time over its rows: the server is the bottleneck, so that is what a row
costs it), and their ratio (the goal: under 5 %, the client never the bottleneck). The server's own CPU time
(its processes, children included) is shown beside it. Two server modes: `transformers serve` as it starts by
default (one request generated at a time) and with `--continuous-batching` (the requests in flight batched
together, as vLLM and SGLang serve). The in-process path (HF generate, batched) on the same rows is the
baseline. Greedy, every assistant turn (the default); each run starts from an empty output.

    python bench/regenerate_server.py                 # 48 chat rows, 64 new tokens per turn
    python bench/regenerate_server.py --smoke         # 6 rows, 8 tokens, concurrency 1 and 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "data" / "tiny-target"
CHAT = REPO / "data" / "sample" / "chat.jsonl"


def cpu_of(pid: int) -> float:
    """User + system seconds of a process and its children (the server's model process), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                     for c in (t / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def start_server(continuous: bool) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; "
           "sys.argv[0] = 'transformers'; sys.exit(main())", "serve", str(TARGET), "--device", "cpu",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    # its paged KV cache sized for these rows: left to itself on a CPU it takes a share of the machine's memory
    # (14 GB here)
    cmd += ["--continuous-batching", "--cb-num-blocks", "512", "--cb-block-size", "32"] if continuous else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    while True:
        if proc.poll() is not None or time.monotonic() - t0 > 180:
            raise SystemExit(f"transformers serve did not start: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url + "/v1"
        except httpx.TransportError:
            time.sleep(0.2)


def regenerate(data: Path, out: Path, **options) -> tuple[dict, float, float]:
    """(summary, wall s, this process's CPU s) of one `dflash regenerate` run, in this process."""
    from dflash.config import RegenerateConfig
    from dflash.regenerate import regenerate as run

    for p in out.parent.glob(out.name + "*"):
        p.unlink()
    cfg = RegenerateConfig(data=[str(data)], out=str(out), **options)
    wall, cpu = time.perf_counter(), time.process_time()
    summary = run(cfg)
    return summary, time.perf_counter() - wall, time.process_time() - cpu


def server_runs(data: Path, work: Path, args, continuous: bool) -> list[dict]:
    proc, url = start_server(continuous)
    try:
        regenerate(data, work / "warm.jsonl", server=url, model=str(TARGET), max_new_tokens=4, limit=2)
        results = []
        for c in args.concurrency:
            before = cpu_of(proc.pid)
            s, wall, cpu = regenerate(data, work / f"server-{c}.jsonl", server=url, model=str(TARGET),
                                      max_new_tokens=args.max_new_tokens, concurrency=c)
            server_cpu = cpu_of(proc.pid) - before
            rows = s["written"]
            results.append({"mode": "continuous batching" if continuous else "one request at a time",
                            "concurrency": c, "rows": rows, "requests": s["requests"], "tokens": s["tokens"],
                            "wall_s": wall, "rows_per_s": rows / wall, "requests_per_s": s["requests"] / wall,
                            "client_cpu_ms_per_row": 1000 * cpu / rows, "server_ms_per_row": 1000 * wall / rows,
                            "server_cpu_ms_per_row": 1000 * server_cpu / rows, "client_share": cpu / wall})
            print(json.dumps(results[-1]), flush=True)
        return results
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=48, help="chat rows of data/sample/chat.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--out", help="write the results here (JSON)")
    ap.add_argument("--smoke", action="store_true", help="6 rows, 8 tokens, concurrency 1 and 4")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.max_new_tokens, args.concurrency = 6, 8, "1,4"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="dflash-bench-regen-") as tmp:
        work = Path(tmp)
        data = work / "chat.jsonl"
        data.write_text("".join(CHAT.read_text().splitlines(keepends=True)[: args.rows]))
        s, wall, _ = regenerate(data, work / "local.jsonl", target=str(TARGET), device="cpu",
                                max_new_tokens=args.max_new_tokens)
        local = {"mode": "in-process (HF generate, batch 16)", "rows": s["written"], "tokens": s["tokens"],
                 "wall_s": wall, "rows_per_s": s["written"] / wall}
        print(json.dumps(local), flush=True)
        runs = server_runs(data, work, args, False) + server_runs(data, work, args, True)
    print(f"\n{args.rows} chat rows, {args.max_new_tokens} new tokens a turn, greedy; in-process "
          f"{local['rows_per_s']:.2f} rows/s ({local['wall_s']:.1f} s, model load included)\n")
    print("| server | concurrency | rows/s | requests/s | client CPU / row | server time / row (wall) | "
          "client share | server CPU / row |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['mode']} | {r['concurrency']} | {r['rows_per_s']:.2f} | {r['requests_per_s']:.2f} | "
              f"{r['client_cpu_ms_per_row']:.1f} ms | {r['server_ms_per_row']:.0f} ms | "
              f"{100 * r['client_share']:.1f} % | {r['server_cpu_ms_per_row']:.0f} ms |")
    if args.out:
        Path(args.out).write_text(json.dumps({"in_process": local, "server": runs}, indent=2))


if __name__ == "__main__":
    main()
