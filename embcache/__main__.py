"""Command line: ``python -m embcache demo`` runs the main job (see ``embcache.tools.demo``).

Exit status: 0 when the run is clean, 1 when a request failed, a response differed from a
fresh encode (``--verify``), the leak check found something or the run could not go on (one
line on stderr; ``--verbose`` adds the traceback and Mooncake's own log), 2 for bad options.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import signal
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from types import FrameType

from embcache import __version__
from embcache.core.policy import POLICIES
from embcache.tools.demo import (
    DTYPES,
    DemoConfig,
    free_loopback_port,
    result_json,
    run_demo,
    write_plot,
)

_DEFAULTS = DemoConfig()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds each option's default to its help, except for flags and defaults of None."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m embcache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"embcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="run an encode worker with the cache under a Zipf load and report",
        description="Drive concurrent requests of synthetic images through EncodePipeline "
        "(TinyViT encoder, a small pool, a global store), then print a summary and a leak "
        "check. A progress bar goes to stderr when it is a terminal.",
        formatter_class=_DefaultsFormatter,
    )
    d = _DEFAULTS
    demo.add_argument("--requests", type=int, default=d.requests, help="requests to send")
    demo.add_argument("--catalogue", type=int, default=d.catalogue, help="distinct images")
    demo.add_argument(
        "--images-per-request", type=int, default=d.images_per_request,
        help="each request has 1..N images",
    )
    demo.add_argument("--zipf", type=float, default=d.zipf, help="popularity skew s >= 0")
    demo.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    demo.add_argument("--pool-mib", type=float, default=d.pool_mib, help="pool size in MiB")
    demo.add_argument("--hidden", type=int, default=d.hidden, help="embedding width")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="embedding dtype")
    demo.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks (gloo)")
    demo.add_argument(
        "--store", choices=["none", "mooncake"], default=d.store,
        help="global store (none: the pool is the whole cache)"
    )
    demo.add_argument(
        "--master", default=None,
        help="mooncake_master host:port (default: start one on loopback for this run)",
    )
    demo.add_argument(
        "--metadata-server", default=None,
        help="Mooncake metadata server URL (default: the started master's; with --master: "
        "P2PHANDSHAKE)",
    )  # fmt: skip
    demo.add_argument(
        "--segment-mib", type=int, default=d.segment_mib,
        help="memory this worker lends to the Mooncake store",
    )
    demo.add_argument(
        "--store-fault-rate", type=float, default=d.store_fault_rate,
        help="fraction of store reads that fail on purpose (with --store mooncake)",
    )
    demo.add_argument(
        "--prefetch-timeout", type=float, default=d.prefetch_timeout,
        help="seconds to wait for store loads before encoding instead",
    )
    demo.add_argument("--seed", type=int, default=d.seed, help="seed of the workload and faults")
    demo.add_argument(
        "--policy", choices=sorted(POLICIES), default=d.policy,
        help="the cache's eviction policy (default: EmbeddingCache's)",
    )  # fmt: skip
    demo.add_argument(
        "--verify", action="store_true", help="check every response against a fresh encode"
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object, not a summary")
    demo.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png",
        help="draw hit ratios, pool occupancy and fragmentation over time (extra: plot)",
    )  # fmt: skip
    demo.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT during the run, 0: a free port "
        "(extra: metrics)",
    )  # fmt: skip
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--verbose", action="store_true",
        help="tracebacks for errors, embcache's info log and Mooncake's native log on stderr",
    )  # fmt: skip
    return parser


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DemoConfig:
    """Validate the options; ``parser.error`` (exit 2) names the first bad one."""
    for name in ("requests", "catalogue", "images_per_request", "concurrency", "hidden", "tp"):
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.tp > 8:
        parser.error(f"--tp must be <= 8 on one host, got {args.tp}")
    if not math.isfinite(args.zipf) or args.zipf < 0:
        parser.error(f"--zipf must be a finite number >= 0, got {args.zipf}")
    if not math.isfinite(args.pool_mib) or args.pool_mib * (1 << 20) < 256:
        parser.error(f"--pool-mib must be at least 256 bytes, got {args.pool_mib}")
    if not math.isfinite(args.prefetch_timeout) or args.prefetch_timeout <= 0:
        parser.error(f"--prefetch-timeout must be > 0 seconds, got {args.prefetch_timeout}")
    if not 0 <= args.store_fault_rate < 1:
        parser.error(f"--store-fault-rate must be in [0, 1), got {args.store_fault_rate}")
    if args.segment_mib < 1:
        parser.error(f"--segment-mib must be >= 1, got {args.segment_mib}")
    if args.store != "mooncake" and (args.master or args.metadata_server):
        parser.error("--master and --metadata-server need --store mooncake")
    if args.store == "mooncake":
        if importlib.util.find_spec("mooncake") is None:
            parser.error("--store mooncake needs the extra: pip install 'embcache[mooncake]'")
        from embcache.store.mooncake_master import master_binary

        if args.master is None and master_binary() is None:
            parser.error(
                "--store mooncake without --master starts mooncake_master, which is not on "
                "PATH: pip install 'embcache[mooncake]' or give --master HOST:PORT"
            )
    if args.metrics_port is not None:
        if not 0 <= args.metrics_port < 65536:
            parser.error(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
        if importlib.util.find_spec("prometheus_client") is None:
            parser.error("--metrics-port needs the extra: pip install 'embcache[metrics]'")
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs the extra: pip install 'embcache[plot]'")
        if args.plot.suffix.lower() != ".png":
            parser.error(f"--plot writes a PNG: give a FILE.png, got {args.plot}")
        if not args.plot.resolve().parent.is_dir():
            parser.error(f"--plot: directory {args.plot.parent} does not exist")
    return DemoConfig(
        requests=args.requests,
        catalogue=args.catalogue,
        images_per_request=args.images_per_request,
        zipf=args.zipf,
        concurrency=args.concurrency,
        pool_mib=args.pool_mib,
        hidden=args.hidden,
        dtype=args.dtype,
        tp=args.tp,
        store=args.store,
        master=args.master,
        metadata_server=args.metadata_server,
        segment_mib=args.segment_mib,
        store_fault_rate=args.store_fault_rate,
        prefetch_timeout=args.prefetch_timeout,
        seed=args.seed,
        verify=args.verify,
        policy=args.policy,
        metrics_port=args.metrics_port,
    )


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)  # unwinds, so a mooncake_master started here is stopped


def main(argv: list[str] | None = None) -> int:
    """Parse, run, report; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    config = _config(parser, args)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if config.store == "mooncake" and not args.verbose:
        from embcache.store.mooncake import quiet_native_logging

        quiet_native_logging()
    if config.metrics_port == 0:
        config = replace(config, metrics_port=free_loopback_port())
    if config.metrics_port is not None:
        print(f"metrics: http://127.0.0.1:{config.metrics_port}/metrics", file=sys.stderr)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        result = run_demo(config, progress=None if args.quiet else sys.stderr)
        if args.plot is not None:
            write_plot(result.timeline, args.plot)
    except KeyboardInterrupt:
        print("embcache demo: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line for the operator; the traceback with --verbose
        if args.verbose:
            traceback.print_exc()
        print(f"embcache demo: {_one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(result_json(result) if args.json else result.summary())
    if args.plot is not None and not args.json:
        print(f"plot              {args.plot}")
    clean = not result.errors and not result.leaks and not result.verify_mismatches
    return 0 if clean else 1


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` and where to find the rest."""
    lines = str(exc).strip().splitlines() or [""]
    more = " ..." if len(lines) > 1 else ""
    return f"{type(exc).__name__}: {lines[0]}{more} (--verbose shows the details)"


if __name__ == "__main__":
    sys.exit(main())
